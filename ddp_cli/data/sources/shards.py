"""The index of a packed data set (`layout = "shards"`): what `ddp datasets pack` writes beside its tars.

Shards follow the WebDataset convention: a plain tar whose members are grouped
by key (`<key>.jpg`, `<key>.cls`, ...), so `webdataset.WebDataset` reads them as
they are. Beside them, `index.json` says what the folder holds (classes, splits,
shards with their image count, bytes and sha256, the source and how it was
re-encoded, the images skipped on the way), and one `<split>-samples.npz` per
split says where every image lies: its shard, the byte offset and size of its
`.jpg` member, its label, its key and its original path. With that table a
loader reads any image with one ranged read, and `datasets check` can verify
every shard against its digest. Arrays only (`allow_pickle=False`): loading an
index never runs code.
"""

from __future__ import annotations

import io
import json
import zipfile
import zlib
from dataclasses import asdict, dataclass, field
from typing import Any

import fsspec
import numpy as np

from ddp_cli.data.fetch.retry import with_retries
from ddp_cli.data.sources.packed import PackedStrings, Split
from ddp_cli.data.sources.table import IndexTable, select_classes
from ddp_cli.errors import DataError
from ddp_cli.userfiles import decode, parse_json

SHARDS = "shards"  # the layout: written by `ddp datasets pack`, an index, not a listing of files
FORMAT, VERSION = "ddp-shards", 1
INDEX = "index.json"
# what np.load and its zip reader raise on a file cut short or altered (a zip "version" it does not
# implement, an "encrypted" flag (RuntimeError), a bad CRC, a header that is no dict, a missing array)
NOT_AN_NPZ = (ValueError, KeyError, OSError, EOFError, NotImplementedError, RuntimeError, zipfile.BadZipFile,
              zlib.error)


def samples_name(split: str) -> str:
    return f"{split}-samples.npz"


@dataclass
class ShardInfo:
    """One tar: its file name (under the root), images, bytes and sha256 of the whole file."""

    name: str
    images: int
    bytes: int
    sha256: str


@dataclass
class SplitInfo:
    """One split's shards in order, and the source images left out (`path`, `reason`)."""

    images: int
    shards: list[ShardInfo]
    skipped: list[dict[str, str]] = field(default_factory=list)


@dataclass
class ShardsIndex:
    """`index.json`: classes in label order, splits, and where the images came from."""

    synsets: list[str]
    descriptions: list[str]
    splits: dict[str, SplitInfo]
    source: dict[str, Any] = field(default_factory=dict)  # dataset, layout, root, split sizes
    max_side: int | None = None  # longest side after re-encoding (None: kept as it was)
    quality: int | None = None  # JPEG quality of re-encoded images (None: bytes copied as they were)

    def to_json(self) -> str:
        body = {"format": FORMAT, "version": VERSION, **asdict(self)}
        return json.dumps(body, indent=1)

    @classmethod
    def from_json(cls, text: str, where: str) -> ShardsIndex:
        raw = parse_json(text, where)
        try:
            if not isinstance(raw, dict) or raw.get("format") != FORMAT or raw.get("version") != VERSION:
                found = raw if not isinstance(raw, dict) else f"{raw.get('format')!r} v{raw.get('version')!r}"
                raise ValueError(f"found {str(found)[:40]}")
            synsets, descriptions = raw["synsets"], raw["descriptions"]
            if not (_names(synsets) and _names(descriptions) and len(synsets) == len(descriptions)):
                raise ValueError("synsets and descriptions must be lists of names, one of each per class")
            splits = {name: _split_info(s) for name, s in _table(raw["splits"]).items()}
            return cls(synsets, descriptions, splits, raw.get("source", {}), raw.get("max_side"),
                       raw.get("quality"))
        except (ValueError, KeyError, TypeError) as e:
            raise DataError(f"{where}: not a {FORMAT} v{VERSION} index ({e}); write it with "
                            "`ddp datasets pack` or `ddp datasets index`") from e


def _names(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(v, str) for v in value)


def _table(value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise TypeError(f"expected a table, found {str(value)[:40]}")
    return value


SHARD_FIELDS = {"name": str, "images": int, "bytes": int, "sha256": str}


def _split_info(raw: Any) -> SplitInfo:
    """One split of index.json, its fields of the types the dataclasses declare (TypeError if not)."""
    raw = _table(raw)
    shards = [_table(s) for s in raw["shards"]]
    if (type(raw["images"]) is not int or not isinstance(raw.get("skipped", []), list)
            or not all(set(s) == set(SHARD_FIELDS) and all(type(s[k]) is t for k, t in SHARD_FIELDS.items())
                       for s in shards)):
        raise TypeError("a split holds images (a number), shards (each: name, images, bytes, sha256) "
                        "and skipped (a list)")
    outside = next((s["name"] for s in shards if "/" in s["name"] or s["name"] in ("", ".", "..")), None)
    if outside is not None:
        raise ValueError(f"shard {outside!r} is not a file name in the index's folder")
    return SplitInfo(raw["images"], [ShardInfo(**s) for s in shards], raw.get("skipped", []))


@dataclass
class Samples:
    """`<split>-samples.npz`: row i is the image at `offset[i]` (`size[i]` bytes) of shard `shard[i]`
    (an index into the split's shard list); rows are grouped by shard, in shard order."""

    shard: np.ndarray  # int32
    offset: np.ndarray  # int64: start of the image member's data in the tar
    size: np.ndarray  # int64
    label: np.ndarray  # int64: index into the data set's classes
    key: PackedStrings  # the WebDataset key (member name without its extension)
    member: PackedStrings  # the image member's name in the tar (`<key>.jpg`)
    path: PackedStrings  # the image's path in the source data set ("" if unknown)

    def __len__(self) -> int:
        return len(self.label)

    def save(self, f: io.BufferedIOBase) -> None:
        arrays = {"shard": self.shard.astype(np.int32), "offset": self.offset.astype(np.int64),
                  "size": self.size.astype(np.int64), "label": self.label.astype(np.int64)}
        for name in ("key", "member", "path"):
            strings: PackedStrings = getattr(self, name)
            arrays[f"{name}_data"], arrays[f"{name}_offsets"] = strings.data, strings.offsets
        np.savez(f, **arrays)

    @classmethod
    def load(cls, data: bytes, where: str) -> Samples:
        try:
            with np.load(io.BytesIO(data), allow_pickle=False) as z:
                strings = {name: PackedStrings(z[f"{name}_data"], z[f"{name}_offsets"])
                           for name in ("key", "member", "path")}
                return cls(z["shard"], z["offset"], z["size"], z["label"], **strings)
        except NOT_AN_NPZ as e:
            raise DataError(f"{where}: not a samples table ({type(e).__name__}: {e}); pack the data set "
                            "again") from e

    def check(self, classes: int, shards: int, where: str, labelled: bool = True) -> None:
        """DataError naming `where` unless every column is a flat integer array of one length whose
        values the index can mean: labels of `classes` (or -1, unknown, in a split nobody labelled), rows
        grouped by `shards` in order, offsets and sizes not negative, strings whose offsets lie in their
        buffer."""
        n = len(self.label)
        columns = {"shard": self.shard, "offset": self.offset, "size": self.size, "label": self.label}
        for name in ("key", "member", "path"):
            strings: PackedStrings = getattr(self, name)
            columns[f"{name}_offsets"], columns[f"{name}_data"] = strings.offsets, strings.data
        for name, column in columns.items():
            length = n + 1 if name.endswith("_offsets") else None if name.endswith("_data") else n
            if column.ndim != 1 or column.dtype.kind not in "iu" or length not in (None, len(column)):
                raise DataError(f"{where}: column {name} is not a flat array of integers of the right "
                                "length; pack the data set again")
        problem = self._problem(classes, shards, 0 if labelled else -1)
        if problem:
            raise DataError(f"{where}: {problem}; pack the data set again")

    def _problem(self, classes: int, shards: int, lowest: int) -> str | None:
        if len(self) and not lowest <= self.label.min() <= self.label.max() < classes:
            return f"a label outside the {classes} classes {INDEX} lists"
        if len(self) and (self.shard.min() < 0 or self.shard.max() >= shards
                          or np.any(np.diff(self.shard) < 0)):
            return f"a shard outside the {shards} shards {INDEX} lists, or rows not grouped by shard"
        if len(self) and min(self.offset.min(), self.size.min()) < 0:
            return "a negative offset or size"
        for name in ("key", "member", "path"):
            offsets, data = getattr(self, name).offsets, getattr(self, name).data
            if offsets[0] != 0 or offsets[-1] > len(data) or np.any(np.diff(offsets) < 0):
                return f"{name} offsets outside its strings"
        return None

    def starts(self, shards: int) -> np.ndarray:
        """The first row of each of `shards` shards, then len(self)."""
        return np.searchsorted(self.shard, np.arange(shards + 1)).astype(np.int64)


def read_index(fs: fsspec.AbstractFileSystem, root: str) -> ShardsIndex:
    """`root/index.json`; DataError naming it when absent or not an index."""
    where = f"{root.rstrip('/')}/{INDEX}"
    try:
        data = with_retries(lambda: fs.cat_file(where), where)
    except FileNotFoundError as e:
        raise DataError(f"{where}: missing; a shards root is written by `ddp datasets pack` (or indexed "
                        "by `ddp datasets index` for webdataset shards)") from e
    return ShardsIndex.from_json(decode(data, where), where)


def read_samples(fs: fsspec.AbstractFileSystem, root: str, split: str) -> Samples:
    where = f"{root.rstrip('/')}/{samples_name(split)}"
    try:
        return Samples.load(with_retries(lambda: fs.cat_file(where), where), where)
    except FileNotFoundError as e:
        raise DataError(f"{where}: missing; pack the data set again") from e


def shards_table(fs: fsspec.AbstractFileSystem, root: str, classes: int | list[str] | None,
                 splits: tuple[str, ...]) -> IndexTable:
    """The index table of a shards root: per split a sharded `Split` (paths `<shard>/<member>`), and
    the classes chosen by `classes` (rows of the others dropped, relabelled 0..k-1). The images the pack
    left out are not problems of this data set: `datasets show` lists them from the index."""
    root = root.rstrip("/")
    meta = read_index(fs, root)
    keep = select_classes(meta.synsets, meta.descriptions, classes)
    relabel = np.full(len(meta.synsets), -1, dtype=np.int64)
    relabel[keep] = np.arange(len(keep))
    out = {name: packed_split(fs, root, meta, name, relabel) for name in splits}
    return IndexTable([meta.synsets[i] for i in keep], [meta.descriptions[i] for i in keep], out)


def packed_split(fs: fsspec.AbstractFileSystem, root: str, meta: ShardsIndex, name: str,
                 relabel: np.ndarray | None) -> Split:
    """Split `name` of the shards root: its rows of the classes `relabel` keeps (old label -> new, -1: left
    out); `relabel` None: every row, of label -1 (an unlabelled split, whatever labels it was packed with)."""
    if name not in meta.splits:
        raise DataError(f"{root}/{INDEX}: no {name} split (it holds {', '.join(meta.splits)}); pack "
                        "it with `ddp datasets pack ... --split all`")
    info, samples = meta.splits[name], read_samples(fs, root, name)
    samples.check(len(meta.synsets), len(info.shards), f"{root}/{samples_name(name)}", relabel is not None)
    labels = relabel[samples.label] if relabel is not None else np.full(len(samples), -1, dtype=np.int64)
    chosen = np.flatnonzero(labels >= 0) if relabel is not None else np.arange(len(samples))
    shard_names = [s.name for s in info.shards]
    paths = (f"{shard_names[samples.shard[i]]}/{samples.member[i]}" for i in chosen)
    members = np.stack([samples.offset, samples.size], 1)[chosen]
    starts = np.searchsorted(samples.shard[chosen], np.arange(len(shard_names) + 1))
    return Split.of(paths, labels[chosen], members, starts)


def describe(meta: ShardsIndex) -> dict[str, Any]:
    """What `datasets show` adds for a shards root: how it was packed, and per split its shards."""
    return {"max_side": meta.max_side, "quality": meta.quality, "source": meta.source,
            "splits": {name: {"shards": len(info.shards), "bytes": sum(s.bytes for s in info.shards),
                              "skipped_when_packed": info.skipped}
                       for name, info in meta.splits.items()}}
