"""`ddp datasets index`: tar shards written by the webdataset library, made a `layout = "shards"` root.

WebDataset groups a tar's members into samples by key: the member's path up to
the first dot of its file name (`webdataset.tariterators.base_plus_ext`); the
rest is the extension. A sample is trainable when it has an image (`.jpg`,
`.jpeg`, `.png`, `.webp`) and a `.cls` label (decimal text). Each shard is read
once, as a stream: the members' data offsets come from their headers (a tar
stores each member's data right after its header), the `.cls` labels are read,
and the whole file passes through sha256 on the way. Samples missing a part
are listed as skipped, not fatal: the index says why each was left out.
"""

from __future__ import annotations

import fnmatch
import hashlib
import io
import re
import tarfile
from collections.abc import Callable
from typing import Any, BinaryIO

import numpy as np

from ddp_cli.data.pack.writer import Destination
from ddp_cli.data.sources.layouts import infer_layout
from ddp_cli.data.sources.packed import PackedStrings
from ddp_cli.data.sources.shards import (
    INDEX,
    SHARDS,
    Samples,
    ShardInfo,
    ShardsIndex,
    SplitInfo,
    samples_name,
)
from ddp_cli.errors import DataError
from ddp_cli.userfiles import read_text

KEY_EXT = re.compile(r"^((?:.*/|)[^./]+)[.]([^/]*)$")  # webdataset's base_plus_ext
IMAGE_EXTS = ("jpg", "jpeg", "png", "webp")
MAX_LABEL = 6  # digits of a .cls label: up to 999,999 classes (a longer one is no label: skipped)


class HashingReader:
    """A read-only stream that hashes what is read through it (tarfile reads a stream in order)."""

    def __init__(self, f: BinaryIO) -> None:
        self.f, self.digest, self.size = f, hashlib.sha256(), 0

    def read(self, n: int = -1) -> bytes:
        data = self.f.read(n)
        self.digest.update(data)
        self.size += len(data)
        return data

    def drain(self) -> None:
        while self.read(1 << 20):
            pass


def scan_shard(f: BinaryIO, name: str) -> tuple[ShardInfo, list[tuple[str, str, int, int, int]], list[dict]]:
    """One shard's (info, samples as (key, image member, offset, size, label), skipped samples)."""
    reader = HashingReader(f)
    images: dict[str, tuple[str, int, int]] = {}
    labels: dict[str, int] = {}
    order: list[str] = []
    try:
        with tarfile.open(fileobj=reader, mode="r|") as tar:
            for member in tar:
                match = KEY_EXT.match(member.name)
                if not member.isfile() or not match:
                    continue
                key, ext = match.group(1), match.group(2).lower()
                if key not in images and key not in labels:
                    order.append(key)
                if ext in IMAGE_EXTS:
                    images[key] = (member.name, member.offset_data, member.size)
                elif ext == "cls":
                    text = tar.extractfile(member).read(MAX_LABEL + 2).strip()  # a newline may follow
                    labels[key] = int(text) if text.isdigit() and len(text) <= MAX_LABEL else -1  # ASCII only
    except tarfile.TarError as e:
        raise DataError(f"{name}: not a readable tar ({e})") from e
    reader.drain()
    samples, skipped = [], []
    for key in order:
        if key in images and labels.get(key, -1) >= 0:
            samples.append((key, *images[key], labels[key]))
        else:
            reason = "no image member" if key not in images else "no .cls label (a decimal number)"
            skipped.append({"path": f"{name}/{key}", "reason": reason})
    info = ShardInfo(name, len(samples), reader.size, reader.digest.hexdigest())
    return info, samples, skipped


def read_as_it_is(dest: Destination) -> str | None:
    """What to do instead, where `dest` holds a data set ddp reads without an index (Parquet, an
    ImageFolder tree, ImageNet's layout) or one indexed already; None where it holds none of them."""
    try:
        layout = infer_layout(dest.fs, dest.root)
    except DataError:
        return None
    if layout == SHARDS:
        return f"its {INDEX} is there already: point a registry entry with layout = \"shards\" at it"
    return (f"it holds a data set of layout {layout!r}, which ddp reads as it is (no index needed): point a "
            f"registry entry with layout = \"{layout}\" at it")


def index_shards(root: str, splits: dict[str, str], classes_file: str | None,
                 progress: Callable[[int, int], None] | None = None) -> dict[str, Any]:
    """Write index.json and the samples tables for the shards of `root` matching each split's glob."""
    dest = Destination(root)
    found = {name: sorted(p.rsplit("/", 1)[-1] for p in dest.fs.ls(dest.root, detail=False)
                          if fnmatch.fnmatch(p.rsplit("/", 1)[-1], pattern))
             for name, pattern in splits.items()}
    for name, shards in found.items():
        if not shards:
            raise DataError(f"{dest.url}: no shard matches {splits[name]!r} for the {name} split; "
                            f"{read_as_it_is(dest) or f'give --split {name}=GLOB'}")
    total, done = sum(map(len, found.values())), 0
    infos: dict[str, SplitInfo] = {}
    highest, highest_in = -1, ""  # the highest label, and the shard holding it
    for name, shards in found.items():
        rows, shard_infos, skipped = [], [], []
        for j, shard in enumerate(shards):
            with dest.fs.open(f"{dest.root}/{shard}", "rb") as f:
                info, samples, bad = scan_shard(f, shard)
            rows += [(j, *sample) for sample in samples]
            top = max((sample[-1] for sample in samples), default=-1)
            if top > highest:
                highest, highest_in = top, shard
            shard_infos.append(info)
            skipped += bad
            done += 1
            if progress:
                progress(done, total)
        infos[name] = SplitInfo(len(rows), shard_infos, skipped)
        dest.write(samples_name(name), _samples_bytes(rows))
    synsets = _class_names(classes_file, highest + 1, highest_in)
    index = ShardsIndex(synsets, list(synsets), infos, source={"written_by": "webdataset", "root": dest.url})
    dest.write(INDEX, index.to_json().encode())
    dest.clear_work([])
    return {"root": dest.url, "index": f"{dest.url}/{INDEX}", "classes": len(synsets),
            "splits": {name: {"images": info.images, "shards": len(info.shards), "skipped": len(info.skipped)}
                       for name, info in infos.items()}}


def _class_names(classes_file: str | None, count: int, highest_in: str) -> list[str]:
    if classes_file is None:
        return [str(i) for i in range(count)]
    names = [line.strip() for line in read_text(classes_file).splitlines() if line.strip()]
    if len(names) < count:
        raise DataError(f"{classes_file}: names {len(names)} classes, but shard {highest_in} holds label "
                        f"{count - 1}; list one name per line for every label")
    return names


def _samples_bytes(rows: list[tuple[int, str, str, int, int, int]]) -> bytes:
    shard, keys, members, offsets, sizes, labels = zip(*rows, strict=True) if rows else ([],) * 6
    table = Samples(np.array(shard, np.int32), np.array(offsets, np.int64), np.array(sizes, np.int64),
                    np.array(labels, np.int64), PackedStrings.pack(keys), PackedStrings.pack(members),
                    PackedStrings.pack("" for _ in keys))
    out = io.BytesIO()
    table.save(out)
    return out.getvalue()
