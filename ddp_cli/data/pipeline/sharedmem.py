"""Shared memory for loader batches: what a node's loaders hold in /dev/shm, checked before a run.

A loader process hands each batch to its rank through shared memory (/dev/shm);
a container's default is small (Docker: 64 MB) and running out is a bus error
(SIGBUS) in the first batch, which reads as a crash, not as a setting.

Refused (exit 2), not worked around. torch's other sharing strategy,
`file_system`, only changes how the handle reaches the rank: its segments are
shm_open()ed in /dev/shm too, so it would fail the same way (and leaks them
when a process dies). Loading in-process (data.workers = 0) would fit, but
turns a GPU run into a loader-bound one without a word. The fix is a setting
the user owns: a larger /dev/shm, or fewer batches in flight.

It can still run out once the run has started (another process filled it); whichever process meets
it, the run ends with the same one line (exit 2; `ran_out`, `exhausted`), never a bug's traceback.
"""

from __future__ import annotations

import errno
import math
import os
import re
import shutil
import traceback

from ddp_cli.config import DataConfig
from ddp_cli.errors import ConfigError

SHM = "/dev/shm"
MIB = 2**20
PAGE = 4096  # tmpfs allocates whole pages: a batch's 256 bytes of labels take 4 KiB


def batch_bytes(cfg: DataConfig) -> int:
    """One collated batch as it lies in shared memory: uint8 HWC images (the larger of the train and
    val sides) and their int64 labels, each a segment of its own, in whole pages."""
    side = max(cfg.image_size, cfg.val_image_size or cfg.image_size)
    return pages(cfg.batch_size * side * side * 3) + pages(cfg.batch_size * 8)


def pages(nbytes: int) -> int:
    """`nbytes` as tmpfs holds them: in whole pages."""
    return -(-nbytes // PAGE) * PAGE


def loader_bytes(cfg: DataConfig, workers: int, prefetch: int, ranks: int) -> int:
    """The batches a node's loaders keep in shared memory at once: each rank has two loaders (train and
    val) whose processes persist, and at an epoch's end both hold `prefetch` collated batches per
    process (`batch_bytes`); and the rank itself one more, the batch it reads (or, with pinned memory,
    the one its pin thread is copying out). Every batch that can be alive at once is counted, so the
    estimate is what /dev/shm must hold at the peak, not on average."""
    return ranks * (2 * workers * prefetch + 1) * batch_bytes(cfg)


def free_bytes(path: str = SHM) -> int | None:
    """Free bytes in /dev/shm; None where there is none (not Linux)."""
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def check_shared_memory(cfg: DataConfig, workers: int, prefetch: int, ranks: int) -> None:
    """Refuse loaders whose batches do not fit in this node's /dev/shm, naming both sizes and the fixes."""
    need = loader_bytes(cfg, workers, prefetch, ranks) if workers else 0
    free = free_bytes() if need else None
    if free is None or need <= free:
        return
    side = max(cfg.image_size, cfg.val_image_size or cfg.image_size)
    batches = (f"{ranks} workers x (2 loaders x data.workers {workers} x data.prefetch_factor {prefetch} + 1)"
               f" x data.batch_size {cfg.batch_size} images of {side}x{side}x3 bytes and their labels")
    raise ConfigError(f"{SHM} has {free / MIB:.0f} MiB free and this node's loaders need {need / MIB:.0f} "
                      f"MiB for their batches ({batches}): a bus error in the first batch. {fixes(need)}")


def fixes(need: int) -> str:
    """What the user can change: a larger /dev/shm (at least `need` bytes), or fewer batches in flight."""
    return (f"In a container, give it more: docker run --shm-size={math.ceil(need * 1.25 / 2**30)}g "
            f"(Kubernetes: an emptyDir, medium Memory, at {SHM}); or lower data.workers, "
            "data.prefetch_factor or data.batch_size")


# How running out of /dev/shm reads, in torch's words: a segment that could not be made (`_share_fd_cpu_`,
# `_new_shared`), or a loader process killed by SIGBUS writing to one (the DataLoader's own account)
RAN_OUT = re.compile(r"unable to (allocate shared memory|write to file </torch_|open shared memory)|"
                     r"out of shared memory|killed by signal: Bus error")
SEMAPHORES = "multiprocessing/synchronize.py"  # Python's semaphores (queues' locks) live in /dev/shm too


def ran_out(e: BaseException | None) -> bool:
    """Whether `e` (or an error it came from) is /dev/shm running out, whichever process met it: a loader
    process (re-raised in its rank by the DataLoader, with the loader's traceback in the text), a rank, or
    the launcher making the queues it starts workers with (ENOSPC from a semaphore: no file named)."""
    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        semaphore = isinstance(e, OSError) and e.errno == errno.ENOSPC and raised_in(e, SEMAPHORES)
        if semaphore or RAN_OUT.search(str(e)):
            return True
        e = e.__cause__ or e.__context__
    return False


def raised_in(e: BaseException, source: str) -> bool:
    """Whether the innermost Python frame of `e`'s traceback is in a file whose path ends with `source`."""
    frames = traceback.extract_tb(e.__traceback__)
    return bool(frames) and frames[-1].filename.replace(os.sep, "/").endswith(source)


def exhausted(cfg: DataConfig | None = None, ranks: int = 1) -> ConfigError:
    """/dev/shm ran out during the run (something else filled it, or the estimate fell short): the same
    one line as the check before the run, with what is there now, and what the loaders need where
    `cfg` (the resolved one the workers read: concrete data.workers and data.prefetch_factor) is known;
    where not, the fix asks for twice the size there is."""
    resolved = cfg is not None and isinstance(cfg.workers, int) and isinstance(cfg.prefetch_factor, int)
    need = loader_bytes(cfg, cfg.workers, cfg.prefetch_factor, ranks) if resolved else 0
    try:
        usage = shutil.disk_usage(SHM)
    except OSError:
        usage = None
    sizes = f"{usage.total / MIB:.0f} MiB in all, {usage.free / MIB:.0f} MiB free now" if usage else "size?"
    needs = f"; this node's loaders need about {need / MIB:.0f} MiB for their batches" if need else ""
    return ConfigError(f"{SHM} ran out during the run ({sizes}{needs}): a batch or a queue could not be "
                       f"placed there. {fixes(need or 2 * (usage.total if usage else 2**30))}")
