"""Reading an image out of a packed shard: one ranged read of bytes whose place the index knows.

Local shards are read in place: `os.pread` at the member's offset, through a
few open files per process (the page cache does the rest, shared by every rank
and loader process of the node). A remote (S3) shard is fetched WHOLE, once per
node, into a local shard cache, and read there: one request per shard of
thousands of images instead of one per image. The training order reads a few
shards at a time (sampler.py), so a shard's images are read within a short span
and the cache need only hold a few windows of shards: it keeps the `keep` most
recently downloaded and deletes the rest (a reader that still has one open keeps
reading it: POSIX unlinks lazily; one that needs it again downloads it again).
Downloads (s3_download.py: botocore's synchronous client, the cheapest in CPU)
go to a temporary file renamed into place, under a per-shard lock:
every process of the node waits for the one download instead of starting its
own, and none ever reads half a shard.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import BinaryIO

import fsspec

from ddp_cli.data.fetch.retry import IoPolicy, with_retries
from ddp_cli.data.fetch.s3_download import download
from ddp_cli.data.fetch.storage import (
    UNSAFE_PATH,
    UnsafePath,
    _is_local,
    cache_folder,
    escapes,
    filesystem_after_fork,
    storage_error,
)
from ddp_cli.errors import DataError
from ddp_cli.io import writing

DEFAULT_CACHE = Path(tempfile.gettempdir()) / "ddp-shards"


class ShardReader:
    """Reads `(offset, size)` of `<shard>/<member>` under a shards root: fork-safe, local or remote; one
    per thread (its open files are its own)."""

    def __init__(self, fs: fsspec.AbstractFileSystem, root: str, cache_dir: str | Path | None = None,
                 keep: int = 32, policy: IoPolicy = IoPolicy()) -> None:
        self._fs, self._pid, self.policy = fs, os.getpid(), policy
        self.root = root.rstrip("/")
        self.cache = None if _is_local(fs) else cache_folder(fs, self.root, cache_dir or DEFAULT_CACHE)
        self.keep = keep
        self._open: OrderedDict[str, BinaryIO] = OrderedDict()
        self._ahead: tuple[int, ThreadPoolExecutor, dict[str, Future]] | None = None  # pid, pool, pending

    @property
    def fs(self) -> fsspec.AbstractFileSystem:
        if self._pid != os.getpid():  # a forked loader process: its own filesystem and files
            self._fs, self._open, self._pid = filesystem_after_fork(self._fs), OrderedDict(), os.getpid()
        return self._fs

    def prefetch(self, paths: list[str]) -> None:
        """Nothing to gather: a remote shard is fetched whole on its first image."""

    def download_ahead(self, shards: list[str]) -> None:
        """Start downloading remote `shards` in the background (the ones read next), so that reading
        does not wait at each window's first image; local shards need nothing."""
        if self.cache is None:
            return
        if self._ahead is None or self._ahead[0] != os.getpid():
            self._ahead = os.getpid(), ThreadPoolExecutor(2, "shards-ahead"), {}
        _, pool, pending = self._ahead
        for shard, running in list(pending.items()):
            if running.done():
                del pending[shard]
        for shard in shards:  # asked again once evicted: a later epoch reads it again
            if shard not in pending and not (self.cache / shard).exists():
                pending[shard] = pool.submit(self._fetch_quietly, shard)

    def _fetch_quietly(self, shard: str) -> None:
        """A download ahead: a failure here is met again, and reported, when the shard is read. One that
        another process has begun is left to it (this one goes on to the next): every loader process
        asks for the same shards, and waiting in turn would download them one or two at a time."""
        with contextlib.suppress(Exception):
            self.fetch(shard, wait=False)

    def read(self, path: str, member: tuple[int, int]) -> bytes:
        """The `size` bytes at `offset` of the shard `path` starts with. FileNotFoundError if the
        shard is missing, OSError if it is shorter than the index says, DataError for remote failures."""
        if escapes(path):
            raise UnsafePath(UNSAFE_PATH)
        shard = path.split("/", 1)[0]
        offset, size = (int(v) for v in member)
        data = os.pread(self._file(shard).fileno(), size, offset)
        if len(data) != size:
            raise OSError(f"shard {shard} ends at byte {offset + len(data)}, before this image's end; "
                          "the shard is truncated")
        return data

    def _file(self, shard: str) -> BinaryIO:
        """The open shard (most recently used last); the least recently used closes past `keep`."""
        opened = self._opened()
        f = opened.get(shard)
        if f is None:
            f = open(self.fetch(shard) if self.cache else f"{self.root}/{shard}", "rb")  # noqa: SIM115
            opened[shard] = f
            if len(opened) > self.keep:
                opened.popitem(last=False)[1].close()
        opened.move_to_end(shard)
        return f

    def _opened(self) -> OrderedDict[str, BinaryIO]:
        """This process's open shards: none yet in a freshly forked loader process."""
        self.fs  # noqa: B018 - resets the filesystem and the open files after a fork
        return self._open

    def fetch(self, shard: str, wait: bool = True) -> Path:
        """The node-local copy of remote `shard`, downloaded by whichever process asks first; without
        `wait`, BlockingIOError if another process is downloading it."""
        assert self.cache is not None
        target = self.cache / shard
        if not target.exists():
            with writing(target):  # the cache's disk full: one line naming the shard, in any process
                self.cache.mkdir(parents=True, exist_ok=True)
                with open(self.cache / f".{shard}.lock", "w") as lock:
                    fcntl.flock(lock, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))  # released on close
                    if not target.exists():
                        self._download(shard, target)
                        self._evict()
        return target

    def _download(self, shard: str, target: Path) -> None:
        partial, where = target.with_name(f".{shard}.{os.getpid()}.part"), f"{self.root}/{shard}"
        try:
            with_retries(lambda: download(self.fs, where, partial), where, self.policy)
        except (FileNotFoundError, DataError):
            partial.unlink(missing_ok=True)
            raise
        except Exception as e:
            partial.unlink(missing_ok=True)
            mapped = storage_error(e, f"{self.root}/{shard}")
            if mapped is None:
                raise
            raise mapped from e
        os.replace(partial, target)

    def _evict(self) -> None:
        """Keep the `keep` most recently downloaded shards of this root in the cache."""
        cached = sorted((p for p in self.cache.glob("*.tar")), key=lambda p: p.stat().st_mtime, reverse=True)
        for old in cached[self.keep:]:
            old.unlink(missing_ok=True)
