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
from dataclasses import asdict, dataclass, field
from typing import Any

import fsspec
import numpy as np

from ddp_cli.data.fetch.retry import with_retries
from ddp_cli.data.sources.packed import PackedStrings, Split
from ddp_cli.data.sources.table import IndexTable, select_classes
from ddp_cli.errors import DataError

FORMAT, VERSION = "ddp-shards", 1
INDEX = "index.json"


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
        try:
            raw = json.loads(text)
            if raw.get("format") != FORMAT or raw.get("version") != VERSION:
                raise ValueError(f"format {raw.get('format')!r} version {raw.get('version')!r}")
            splits = {name: SplitInfo(s["images"], [ShardInfo(**shard) for shard in s["shards"]],
                                      s.get("skipped", []))
                      for name, s in raw["splits"].items()}
            return cls(raw["synsets"], raw["descriptions"], splits, raw.get("source", {}),
                       raw.get("max_side"), raw.get("quality"))
        except (ValueError, KeyError, TypeError) as e:
            raise DataError(f"{where}: not a {FORMAT} v{VERSION} index ({e}); write it with "
                            "`ddp datasets pack` or `ddp datasets index`") from e


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
        except (ValueError, KeyError, OSError) as e:
            raise DataError(f"{where}: not a samples table ({e}); pack the data set again") from e

    def starts(self, shards: int) -> np.ndarray:
        """The first row of each of `shards` shards, then len(self)."""
        return np.searchsorted(self.shard, np.arange(shards + 1)).astype(np.int64)


def read_index(fs: fsspec.AbstractFileSystem, root: str) -> ShardsIndex:
    """`root/index.json`; DataError naming it when absent or not an index."""
    where = f"{root.rstrip('/')}/{INDEX}"
    try:
        text = with_retries(lambda: fs.cat_file(where), where).decode()
    except FileNotFoundError as e:
        raise DataError(f"{where}: missing; a shards root is written by `ddp datasets pack` (or indexed "
                        "by `ddp datasets index` for webdataset shards)") from e
    return ShardsIndex.from_json(text, where)


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
    out = {}
    for name in splits:
        if name not in meta.splits:
            raise DataError(f"{root}/{INDEX}: no {name} split (it holds {', '.join(meta.splits)}); pack "
                            "it with `ddp datasets pack ... --split all`")
        info, samples = meta.splits[name], read_samples(fs, root, name)
        labels = relabel[samples.label]
        chosen = np.flatnonzero(labels >= 0)
        shard_names = [s.name for s in info.shards]
        paths = (f"{shard_names[samples.shard[i]]}/{samples.member[i]}" for i in chosen)
        members = np.stack([samples.offset, samples.size], 1)[chosen]
        starts = np.searchsorted(samples.shard[chosen], np.arange(len(shard_names) + 1))
        out[name] = Split.of(paths, labels[chosen], members, starts)
    return IndexTable([meta.synsets[i] for i in keep], [meta.descriptions[i] for i in keep], out)


def describe(meta: ShardsIndex) -> dict[str, Any]:
    """What `datasets show` adds for a shards root: how it was packed, and per split its shards."""
    return {"max_side": meta.max_side, "quality": meta.quality, "source": meta.source,
            "splits": {name: {"shards": len(info.shards), "bytes": sum(s.bytes for s in info.shards),
                              "skipped_when_packed": info.skipped}
                       for name, info in meta.splits.items()}}
