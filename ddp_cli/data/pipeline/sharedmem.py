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
"""

from __future__ import annotations

import math
import shutil

from ddp_cli.config import DataConfig
from ddp_cli.errors import ConfigError

SHM = "/dev/shm"
MIB = 2**20


def loader_bytes(cfg: DataConfig, workers: int, prefetch: int, ranks: int) -> int:
    """The batches a node's loaders keep in shared memory at once: every loader process of every rank
    holds `prefetch` batches of uint8 HWC images (the larger of the train and val sides). A lower bound:
    the batch a rank is reading and labels come on top."""
    side = max(cfg.image_size, cfg.val_image_size or cfg.image_size)
    return ranks * workers * prefetch * cfg.batch_size * side * side * 3


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
    batches = (f"{ranks} workers x data.workers {workers} x data.prefetch_factor {prefetch} x "
               f"data.batch_size {cfg.batch_size} images of {side}x{side}x3 bytes")
    raise ConfigError(
        f"{SHM} has {free / MIB:.0f} MiB free and this node's loaders need {need / MIB:.0f} MiB for their "
        f"batches ({batches}): a bus error in the first batch. In a container, give it more: docker run "
        f"--shm-size={math.ceil(need * 1.25 / 2**30)}g (Kubernetes: an emptyDir, medium Memory, at {SHM});"
        " or lower data.workers, data.prefetch_factor or data.batch_size"
    )
