"""Reading an image out of Hugging Face-style Parquet: one row group's image column at a time.

A Parquet file is read by column chunk: one row group of the image column is
the smallest read that yields an image (`ParquetFile.read_row_group(g,
columns=[image])`), never the whole file. The index (sources/parquet.py)
records each row's file, row group and row within the group; the training
order reads a few row groups at a time (sampler.py, the shards' windows), so a
process keeps the last `keep` row groups it read (a bounded cache: loader
memory does not grow with the data set) and reads each once per window. The
training and validation loaders go further (`shared`, row_groups.py): every
loader process of the node reads rows of every group of the window, so a group
is decoded once per node and its images read from the node's copy (without it,
every loader process would decode every group again for its few rows);
unless the process is the node's only reader (`readers_on_node`).

Local files are read in place. Remote ones (S3) are read by range through
fsspec, the file's footer once per process and then one request per row group
of the image column, retried on transient errors (retry.py). Remote files are
not downloaded whole as shards are: a window's row groups lie in as many
different files, and a Hugging Face Parquet file is ~500 MB.

An image is the row's `bytes`; a row with none is read from its `path`, under
the data set root (a path that is absolute or climbs out of it is refused,
never read).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import fsspec
import numpy as np

from ddp_cli.data.fetch.retry import IoPolicy, with_retries
from ddp_cli.data.fetch.row_groups import NodeGroups, group_bytes, readers_on_node
from ddp_cli.data.fetch.storage import (
    UNSAFE_PATH,
    FileReader,
    UnsafePath,
    _is_local,
    escapes,
    filesystem_after_fork,
    storage_error,
)
from ddp_cli.errors import DataError, require_extra

ROW_MARK = "#"  # an index path is `<file>#<row in the file>`
HF_METADATA = b"huggingface"  # the schema metadata key `datasets` writes its features under


def row_file(path: str) -> str:
    """The Parquet file of an index path `<file>#<row>`."""
    return path.rsplit(ROW_MARK, 1)[0]


def open_parquet(fs: fsspec.AbstractFileSystem, where: str) -> Any:
    """A `pyarrow.parquet.ParquetFile` of `where` (local: in place; remote: ranged reads, no read-ahead);
    exit 2 naming the install when pyarrow is missing."""
    require_extra("parquet", f"{where}: layout parquet")
    import pyarrow.parquet as pq

    if _is_local(fs):
        return pq.ParquetFile(where)
    return pq.ParquetFile(fs.open(where, "rb", cache_type="none"))


def hf_features(schema: Any) -> dict[str, Any]:
    """The `datasets` features the file's schema metadata carries ({} if none)."""
    raw = (schema.metadata or {}).get(HF_METADATA)
    try:
        features = json.loads(raw)["info"]["features"] if raw else {}
    except (ValueError, KeyError, TypeError):
        return {}
    return features if isinstance(features, dict) else {}


def image_column(schema: Any) -> str | None:
    """The image column: a struct with `bytes` and/or `path` (`datasets`' Image), `image` first."""
    import pyarrow as pa

    names = [f.name for f in schema if pa.types.is_struct(f.type)
             and {"bytes", "path"} & {f.type.field(i).name for i in range(f.type.num_fields)}]
    return "image" if "image" in names else (names[0] if names else None)


class ParquetReader:
    """Reads row `row` of row group `group` of `<file>` under a root: fork-safe, thread-safe (one lock:
    threads asking for the same row group wait for one read), local or remote."""

    def __init__(self, fs: fsspec.AbstractFileSystem, root: str, keep: int = 8,
                 policy: IoPolicy = IoPolicy(), shared: NodeGroups | None = None) -> None:
        self._fs, self._pid, self.policy = fs, -1, policy
        self.root, self.keep, self.shared = root.rstrip("/"), keep, shared
        self.files = FileReader(fs, root, policy=policy)  # rows that name a path instead of bytes
        self._reset()

    def _reset(self) -> None:
        """A fresh process (the first use, or a forked loader process): its own files, groups and lock. A
        loader process also takes Arrow's allocations from malloc, which keeps freed row groups for the
        next; under pyarrow's default (mimalloc) a forked loader process spends markedly more CPU on each
        row group it reads, CPU the decoding needs."""
        if self._pid != -1:
            import pyarrow as pa

            pa.set_memory_pool(pa.system_memory_pool())
            keep_freed_memory()
            self._fs = filesystem_after_fork(self._fs)
        self._pid, self._lock = os.getpid(), threading.Lock()
        self._node = self.shared if self.shared is not None and readers_on_node() > 1 else None
        self._open: OrderedDict[str, tuple[Any, str]] = OrderedDict()  # file -> (ParquetFile, image column)
        self._groups: OrderedDict[tuple[str, int], tuple] = OrderedDict()  # `_group`'s
        self._versions: dict[str, str] = {}  # file -> `_version`
        self._ahead: ThreadPoolExecutor | None = None  # `read_ahead`'s thread, its open files, its reads
        self._open_ahead: OrderedDict[str, tuple[Any, str]] = OrderedDict()
        self._pending: dict[tuple[str, int], Future] = {}

    def prefetch(self, paths: list[str]) -> None:
        """Nothing to gather: a row group is read whole on its first image."""

    def read_ahead(self, groups: list[tuple[str, int]]) -> None:
        """Start reading remote `groups` (file, row group), the ones read next, on a background thread:
        into the node's copies, or this reader's own (`_group` takes them), so that the first image of a
        window does not wait for a round trip and its row groups' bytes. Local files need nothing: the
        thread's allocations only cost CPU there. A group that another process of the node is writing is
        left to it; a failure here is met again, and reported, when the group is read."""
        if _is_local(self._fs):
            return
        with self._locked():
            if self._ahead is None:
                self._ahead = ThreadPoolExecutor(1, "row-groups-ahead")
            for file, group in groups:
                name = self._name(file, group)
                if (file, group) in self._pending or (
                        self._node.written(name) if self._node else (file, group) in self._groups):
                    continue
                self._pending[(file, group)] = self._ahead.submit(self._read_ahead, file, group, name)

    def _read_ahead(self, file: str, group: int, name: str) -> Any:
        read = functools.partial(self._read_group, file, group, self._open_ahead)
        if self._node is None:
            return read()
        with contextlib.suppress(Exception):
            self._node.write(name, read, wait=False)
        return None

    def read(self, path: str, member: tuple[int, int]) -> bytes:
        """The image bytes of index path `<file>#<row>` at (row group, row in group). FileNotFoundError
        for a missing file or a row with no image, OSError for an unreadable one, DataError for remote
        failures, UnsafePath for a path that could leave the root."""
        file = row_file(path)
        if escapes(file):
            raise UnsafePath(UNSAFE_PATH)
        group, row = (int(v) for v in member)
        with self._locked():
            if self._node is not None:  # the node's copy of the group: decoded once per node
                self._pending.pop((file, group), None)
                name = self._name(file, group)
                if (data := self._node.read(name, row, lambda: self._read_group(file, group))) is not None:
                    return data
            images, data, spans = self._group(file, group)
            start, end = (int(v) for v in spans[row])
            if start >= 0:  # (a buffer whenever a row has bytes, if only b"")
                return bytes(data[start:end])
            image = images[row]
        name = image["path"].as_py() if "path" in image.type.names else None  # no bytes: its path
        if not name:
            raise FileNotFoundError(f"{path}: no image (bytes and path both empty)")
        return self.files.read(name)

    def _name(self, file: str, group: int) -> str:
        """The node's name of `file`'s row group `group`, as the file is now."""
        return f"{file.replace('/', '--')}.{self._version(file)}.{group}"

    def _version(self, file: str) -> str:
        """A token of `file`'s size and modification (its ETag remotely), so that a node's group files of
        a file since rewritten are never read: one stat per file per process."""
        if file not in self._versions:
            where = f"{self.root}/{file}"
            info = with_retries(lambda: self._fs.info(where), where, self.policy)
            stamp = [info.get(k) for k in ("size", "mtime", "ETag", "LastModified")]
            self._versions[file] = hashlib.sha1(repr(stamp).encode()).hexdigest()[:12]
        return self._versions[file]

    def _locked(self) -> threading.Lock:
        if self._pid != os.getpid():
            self._reset()
        return self._lock

    def _group(self, file: str, group: int) -> tuple[Any, memoryview | None, np.ndarray]:
        """Row group `group` of `file`'s image column, its bytes and their spans (`group_bytes`: a row's
        bytes without an Arrow scalar per row); most recently used last, the least recently used dropped
        past `keep`."""
        key = (file, group)
        if key not in self._groups:
            images = self._ahead_or_read(file, group)
            self._groups[key] = (images, *group_bytes(images))
            if len(self._groups) > self.keep:
                self._groups.popitem(last=False)
        self._groups.move_to_end(key)
        return self._groups[key]

    def _ahead_or_read(self, file: str, group: int) -> Any:
        """The group `read_ahead` read, or (none, or its read failed) read now."""
        if (pending := self._pending.pop((file, group), None)) is not None:
            with contextlib.suppress(Exception):
                if (images := pending.result()) is not None:
                    return images
        return self._read_group(file, group)

    def _read_group(self, file: str, group: int, opened: OrderedDict | None = None) -> Any:
        """Row group `group` of `file`'s image column, through the open files `opened` (the calling
        threads' by default; the reading-ahead thread has its own)."""
        import pyarrow as pa

        where = f"{self.root}/{file}"
        opened = self._open if opened is None else opened

        def read() -> Any:
            parquet, column = self._file(file, opened)
            try:
                table = parquet.read_row_group(group, columns=[column], use_threads=False)  # 3x faster: a
                chunks = table.column(column)  # loader process has one core's worth
                return chunks.chunk(0) if chunks.num_chunks == 1 else chunks.combine_chunks()  # no copy
            except Exception:
                opened.pop(file, None)  # a failed read may leave the remote file unusable: reopen
                raise

        try:
            return with_retries(read, where, self.policy)
        except (FileNotFoundError, DataError):
            raise
        except pa.ArrowException as e:
            raise OSError(f"not a readable Parquet row group {group} ({e})") from e
        except Exception as e:
            mapped = None if _is_local(self._fs) else storage_error(e, where)
            if mapped is None:
                raise
            raise mapped from e

    def _file(self, file: str, opened: OrderedDict) -> tuple[Any, str]:
        """`file` open, with its image column; a few stay open in `opened` (footers read once)."""
        if file not in opened:
            parquet = open_parquet(self._fs, f"{self.root}/{file}")
            column = image_column(parquet.schema_arrow)
            if column is None:
                raise OSError(f"{file}: no image column (a struct with bytes and/or path)")
            opened[file] = parquet, column
            if len(opened) > self.keep:
                opened.popitem(last=False)
        opened.move_to_end(file)
        return opened[file]


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt(3)
HEAP_KEPT = 1 << 30


def keep_freed_memory() -> None:
    """glibc: serve row groups (~10 MB) from the heap and keep what is freed there for the next one,
    instead of a fresh mmap per row group whose every page faults in (2,300 faults per group)."""
    import ctypes

    with contextlib.suppress(OSError, AttributeError):  # not glibc: its allocator's own choice
        libc = ctypes.CDLL(None)
        libc.mallopt(M_MMAP_THRESHOLD, 1 << 25)
        libc.mallopt(M_TRIM_THRESHOLD, HEAP_KEPT)
