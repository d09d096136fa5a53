"""A node's decoded Parquet row groups, shared by its loader processes and ranks.

Every loader process of every rank of a node reads the same window of row
groups (the training order hands each of them rows of every group of the
window), so each would decompress each group. Instead the first process to
need a group writes its images' bytes, decoded, to a file under the node's
folder (a temporary file renamed into place, under a per-group lock: the
others wait for it rather than decode it too), and every process reads an
image from there with one `pread` at its offset, as from a packed shard. The
folder keeps the `keep` most recently written groups (a process that still has
one open keeps reading it: POSIX unlinks lazily; one that needs it again writes
it again).

A group file: the row count n (int64), n (start, end) byte spans (int64; start
-1 for a row with no bytes), then the bytes.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import fsspec
import numpy as np

from ddp_cli.data.fetch.storage import cache_folder
from ddp_cli.io import writing

SUFFIX = ".rows"
GROUPS = Path(tempfile.gettempdir()) / f"ddp-row-groups-{os.getuid()}"  # the user's: /tmp is everyone's


def readers_on_node() -> int:
    """Processes of this node reading a data set as this one does: the node's ranks (torchrun's
    LOCAL_WORLD_SIZE) times each rank's loader processes (their count, inside one). One alone shares
    nothing, so it skips writing its groups to shared memory that no other process would read."""
    from torch.utils.data import get_worker_info

    loader = get_worker_info()
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1")) * (loader.num_workers if loader else 1)


def group_folder(fs: fsspec.AbstractFileSystem, root: str) -> Path:
    """The node's folder of `root`'s decoded row groups (remote: per endpoint, as the shard cache)."""
    return cache_folder(fs, root, GROUPS) or GROUPS / "local" / root.lstrip("/")


class NodeGroups:
    """Row groups' image bytes in `folder`, shared by the node's processes: fork-safe, one per reader."""

    def __init__(self, folder: Path, keep: int) -> None:
        self.folder, self.keep, self._pid = folder, keep, os.getpid()
        self._open: OrderedDict[str, tuple[int, np.ndarray]] = OrderedDict()  # name -> (fd, spans)

    def read(self, name: str, row: int, decode: Callable[[], Any]) -> bytes | None:
        """Row `row`'s image bytes of group `name` (None: it has none); `decode()` gives the group's image
        column (an Arrow StructArray) when no process of the node has written it yet."""
        fd, spans = self._opened(name, decode)
        start, end = (int(v) for v in spans[row])
        return None if start < 0 else os.pread(fd, end - start, start)

    def _opened(self, name: str, decode: Callable[[], Any]) -> tuple[int, np.ndarray]:
        if self._pid != os.getpid():  # a forked loader process: its own open files
            self._pid, self._open = os.getpid(), OrderedDict()
        if name not in self._open:
            self._open[name] = self._load(name, decode)
            if len(self._open) > self.keep:
                os.close(self._open.popitem(last=False)[1][0])
        self._open.move_to_end(name)
        return self._open[name]

    def _load(self, name: str, decode: Callable[[], Any]) -> tuple[int, np.ndarray]:
        with contextlib.suppress(FileNotFoundError):
            return self._open_file(name)
        opened = self.write(name, decode)
        assert opened is not None  # waiting for the lock, `write` always opens it
        return opened

    def written(self, name: str) -> bool:
        return (self.folder / f"{name}{SUFFIX}").exists()

    def write(self, name: str, decode: Callable[[], Any], wait: bool = True) -> tuple[int, np.ndarray] | None:
        """Group `name` written to the folder unless a process of the node has written it, and opened
        (fd, spans) before it is in place or, written by another, under its lock: the other processes
        writing groups evict the oldest at any time, and an open file stays readable once unlinked.
        `wait=False` (reading ahead): nothing done if another process is writing it, nothing kept open."""
        target = self.folder / f"{name}{SUFFIX}"
        with writing(target):  # the folder's disk full: one line naming the file, in any process
            self.folder.mkdir(parents=True, exist_ok=True)
            with open(self.folder / f".{name}.lock", "w") as lock:
                try:  # released on close
                    fcntl.flock(lock, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    return None
                try:
                    opened = self._open_file(name)  # another process wrote it meanwhile
                except FileNotFoundError:
                    opened = spans_of(write_group(decode(), target))
            self._evict()
        if not wait:
            os.close(opened[0])
            return None
        return opened

    def _open_file(self, name: str) -> tuple[int, np.ndarray]:
        return spans_of(os.open(self.folder / f"{name}{SUFFIX}", os.O_RDONLY))

    def _evict(self) -> None:
        """Keep the `keep` most recently written groups (and their locks: a lock only saves work). Other
        processes evict too: a file listed here may be gone by the time it is looked at."""
        written = []
        for path in self.folder.glob(f"*{SUFFIX}"):
            with contextlib.suppress(FileNotFoundError):
                written.append((path.stat().st_mtime, path))
        for _, old in sorted(written, key=lambda found: found[0], reverse=True)[self.keep:]:
            old.unlink(missing_ok=True)
            (old.parent / f".{old.name.removesuffix(SUFFIX)}.lock").unlink(missing_ok=True)


def spans_of(fd: int) -> tuple[int, np.ndarray]:
    """A group file open at `fd`, and its rows' (start, end) spans."""
    rows = int.from_bytes(os.pread(fd, 8, 0), "little")
    return fd, np.frombuffer(os.pread(fd, 16 * rows, 8), dtype="<i8").reshape(rows, 2)


def group_bytes(images: Any) -> tuple[memoryview | None, np.ndarray]:
    """The image bytes of the StructArray `images` as Arrow holds them, no copy: one buffer and each row's
    (start, end) span in it (int64; start -1 for a row with no bytes)."""
    import pyarrow as pa

    names = [images.type.field(i).name for i in range(images.type.num_fields)]
    column = (images.flatten()[names.index("bytes")] if "bytes" in names
              else pa.array([None] * len(images), pa.binary()))
    wide = np.int64 if pa.types.is_large_binary(column.type) else np.int32
    offsets = np.frombuffer(column.buffers()[1], dtype=wide)[column.offset:column.offset + len(column) + 1]
    spans = np.stack([offsets[:-1], offsets[1:]], 1).astype("<i8") - offsets[0]
    if column.null_count:  # from the validity bitmap: a process's first Arrow is_null() costs ~0.4 s
        valid = np.unpackbits(np.frombuffer(column.buffers()[0], np.uint8), bitorder="little")
        spans[valid[column.offset:column.offset + len(column)] == 0, 0] = -1
    data = column.buffers()[2]
    return (None if data is None else memoryview(data)[offsets[0]:offsets[-1]]), spans


def write_group(images: Any, target: Path) -> int:
    """The `bytes` of each row of the StructArray `images`, with their spans, atomically at `target`; the
    file open for reading (opened before it is in place, so whatever unlinks it since)."""
    data, spans = group_bytes(images)
    header = 8 + 16 * len(spans)
    spans = np.where(spans[:, :1] >= 0, spans + header, spans)
    partial = target.with_name(f".{target.name}.{os.getpid()}.part")
    fd = -1
    try:
        with open(partial, "wb") as out:
            out.write(len(spans).to_bytes(8, "little"))
            out.write(spans.astype("<i8").tobytes())
            if data is not None:
                out.write(data)
        fd = os.open(partial, os.O_RDONLY)
        os.replace(partial, target)
    except BaseException:
        partial.unlink(missing_ok=True)
        if fd >= 0:
            os.close(fd)
        raise
    return fd
