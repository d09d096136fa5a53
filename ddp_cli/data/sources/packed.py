"""A split's rows as flat buffers, so forked processes read the index without copying it.

A Python `str` is an object with a reference count: a DataLoader process that
merely reads one writes to its page, and the kernel copies that page out of the
forked parent (PyTorch issue #13246). Over a 1.28 M-row index each loader
process ends up with its own copy, ~165 MB. Packed, the paths are one UTF-8
buffer and its offsets, the labels one small-int array: no per-row object, so
nothing is written on access and the pages stay shared. Saved as .npy files and
loaded memory-mapped, they are page cache, shared by every rank of the node too.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ddp_cli.io import atomic_write

ENCODING, ERRORS = "utf-8", "surrogatepass"  # any str round-trips, lone surrogates included
TAR, PARQUET = "tar", "parquet"  # what a sharded split's members point into


class PackedStrings(Sequence[str]):
    """Strings as one uint8 buffer and int64 offsets; item i is decoded on access."""

    def __init__(self, data: np.ndarray, offsets: np.ndarray) -> None:
        self.data, self.offsets = data, offsets

    @classmethod
    def pack(cls, strings: Iterable[str]) -> PackedStrings:
        encoded = [s.encode(ENCODING, ERRORS) for s in strings]
        offsets = np.zeros(len(encoded) + 1, dtype=np.int64)
        np.cumsum(np.fromiter(map(len, encoded), np.int64, len(encoded)), out=offsets[1:])
        return cls(np.frombuffer(b"".join(encoded), dtype=np.uint8), offsets)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, index: int) -> str:
        n = len(self)
        if not -n <= index < n:
            raise IndexError(f"index {index} out of range for {n} strings")
        index %= n
        return self.data[self.offsets[index]:self.offsets[index + 1]].tobytes().decode(ENCODING, ERRORS)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, PackedStrings):
            return NotImplemented
        return np.array_equal(self.offsets, other.offsets) and np.array_equal(self.data, other.data)

    def __repr__(self) -> str:
        return f"PackedStrings({len(self)} strings, {len(self.data)} bytes)"


@dataclass(frozen=True, eq=False)
class Split:
    """One split of an index: row i is the image at `paths[i]` (under the root), of class `labels[i]`.

    Packed shards (`layout = "shards"`) add where each image lies: `paths[i]` is
    `<shard>/<member>`, `members[i]` its (byte offset, size) inside the shard, and
    the rows of shard j are `starts[j]:starts[j + 1]` (rows are grouped by shard).
    Parquet (`container` "parquet", `layout = "parquet"`): `paths[i]` is `<file>#<row in the file>`,
    `members[i]` its (row group, row in the group), and the "shards" of `starts` are row groups.
    """

    paths: PackedStrings
    labels: np.ndarray
    members: np.ndarray | None = None  # (n, 2) int64: offset and size of the image in its shard
    starts: np.ndarray | None = None  # (shards + 1,) int64: the first row of each shard, then n
    container: str = TAR  # what `members` point into: tar shards or Parquet row groups

    @classmethod
    def of(cls, paths: Iterable[str], labels: Sequence[int] | np.ndarray,
           members: np.ndarray | None = None, starts: np.ndarray | None = None,
           container: str = TAR) -> Split:
        labels = np.asarray(labels)
        return cls(PackedStrings.pack(paths), labels.astype(smallest_int(labels)),
                   None if members is None else np.asarray(members, dtype=np.int64).reshape(-1, 2),
                   None if starts is None else np.asarray(starts, dtype=np.int64), container)

    @property
    def sharded(self) -> bool:
        return self.members is not None

    def __len__(self) -> int:
        return len(self.labels)

    def __eq__(self, other: object) -> bool:
        """Exactly the same rows in the same order (label dtypes may differ)."""
        if not isinstance(other, Split):
            return NotImplemented
        return (self.paths == other.paths and np.array_equal(self.labels, other.labels)
                and _same(self.members, other.members) and _same(self.starts, other.starts)
                and self.container == other.container)

    def joined(self, other: Split) -> Split:
        """This split's rows, then `other`'s (of the same layout: files, shards or row groups alike)."""
        if self.sharded != other.sharded or self.container != other.container:
            raise ValueError("only splits of one layout join")
        text = self.paths.data
        paths = PackedStrings(np.concatenate([text, other.paths.data]),
                              np.concatenate([self.paths.offsets, other.paths.offsets[1:] + len(text)]))
        labels = np.concatenate([self.labels, other.labels])
        labels = labels.astype(smallest_int(labels))
        if not self.sharded:
            return Split(paths, labels)
        return Split(paths, labels, np.concatenate([self.members, other.members]),
                     np.concatenate([self.starts, other.starts[1:] + len(self)]), self.container)

    def classes(self) -> int:
        """How many distinct labels the split holds."""
        return len(np.unique(self.labels))

    def save(self, folder: Path, name: str) -> None:
        parts = {"paths": self.paths.data, "offsets": self.paths.offsets, "labels": self.labels,
                 "members": self.members, "starts": self.starts}
        for part, array in parts.items():
            if array is None:
                continue
            atomic_write(folder / f"{name}-{part}.npy", lambda f, a=array: np.save(f, a))
        if self.container != TAR:
            atomic_write(folder / f"{name}-container.npy", lambda f: np.save(f, np.array(self.container)))

    @classmethod
    def load(cls, folder: Path, name: str) -> Split:
        """Memory-mapped, read-only: pages come from the page cache, shared by every process."""
        def part(which: str) -> np.ndarray | None:
            file = folder / f"{name}-{which}.npy"
            return np.asarray(np.load(file, mmap_mode="r")) if file.exists() else None

        container = part("container")
        return cls(PackedStrings(part("paths"), part("offsets")), part("labels"), part("members"),
                   part("starts"), TAR if container is None else str(container))

    @staticmethod
    def saved(folder: Path, name: str) -> bool:
        return (folder / f"{name}-labels.npy").exists()


def _same(a: np.ndarray | None, b: np.ndarray | None) -> bool:
    return a is b or (a is not None and b is not None and np.array_equal(a, b))


def smallest_int(values: np.ndarray) -> np.dtype:
    """The smallest integer dtype that holds every value (uint8 for none)."""
    if not len(values):
        return np.dtype(np.uint8)
    return np.result_type(np.min_scalar_type(values.min()), np.min_scalar_type(values.max()))
