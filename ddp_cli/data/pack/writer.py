"""`ddp datasets pack`: a registry data set rewritten as tar shards, read sequentially at full speed.

Per image, three members in the WebDataset convention: `<key>.jpg` (always an
RGB JPEG), `<key>.cls` (the label, decimal text) and `<key>.json` (synset and
source path), so `webdataset.WebDataset` reads the shards as they are. Keys are
`<split>_<source row:08d>` (no dot: webdataset splits a member name at its first
dot). Train rows go into the shards in a fixed shuffled order (seed `ORDER_SEED`,
recorded in the index), so every shard mixes the classes and reading a few
shards at a time (the training order, `sampler.py`) still gives well-mixed
batches; val keeps its source order. A Parquet source, read by row group, is
shuffled `PACK_WINDOW` row groups at a time (`pack_order`): a global shuffle
would read a whole row group for every row.

What becomes what: a YCbCr JPEG (baseline or progressive) that needs no
shrinking is copied byte for byte, after a decode at 1/8 scale that reads its
whole entropy-coded stream (truncation shows there); everything else is
re-encoded at `--quality`: CMYK JPEGs, PNGs named .JPEG, any other format, and
grayscale JPEGs too (the loader would turn them into RGB anyway; as RGB JPEGs
every packed image decodes one way). `--max-side` shrinks through DCT scaling
(libjpeg-turbo decodes at the largest 1/2, 1/4, 1/8 scale still >= the target)
and then a Lanczos resize: about half the time of a full decode + Lanczos, with
pixels that differ from it below what the eye sees. Encoding runs on threads:
libjpeg-turbo and PIL's resize release the GIL, and processes would send the
image bytes across a pipe both ways.

Shards close at the same image whatever the number of workers: images are
encoded a chunk at a time in parallel, then added to the shard in pack order,
and a shard is closed before the image that would take its file over
`--shard-size` (computed exactly, tar padding included; an image bigger than
the limit gets a shard of its own). Tar members have fixed metadata (mode 0444,
mtime 0, uid/gid 0, no owner names): the same source and options give the same
bytes.

Nothing half-done is ever visible, and a killed pack resumes:
- a shard is written to a scratch file and then renamed (local, fsync'd) or
  uploaded in one request (S3: an object appears whole or not at all);
- after each shard, its rows' table goes to `.pack/<shard>.npz` and the
  progress (options, shards done with bytes and sha256, next row) to
  `.pack/progress.json`; a rerun with the same options and source continues
  after the last shard done and ends with the same bytes as an uninterrupted
  pack (other options: exit 2);
- `index.json` is written last (then `.pack/` is removed): a destination
  without it is not a data set yet.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import tarfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import fsspec
import numpy as np
import simplejpeg
from PIL import Image

from ddp_cli.data.pack.destination import WORK, Destination
from ddp_cli.data.pipeline.images import JPEG_MAGIC, BadImage, decode, open_image
from ddp_cli.data.pipeline.loaders import open_reader, read_row
from ddp_cli.data.pipeline.sampler import shard_order
from ddp_cli.data.sources.layouts import LayoutOptions, build_index
from ddp_cli.data.sources.packed import PARQUET, PackedStrings, Split
from ddp_cli.data.sources.shards import INDEX, Samples, ShardInfo, ShardsIndex, SplitInfo, samples_name
from ddp_cli.data.sources.table import UNLABELED, IndexTable
from ddp_cli.data.sources.unlabeled import unlabeled_split
from ddp_cli.errors import ConfigError, DataError
from ddp_cli.io import HashingFile, writing

ORDER_SEED = 0  # the train rows' order in the shards (recorded in the index)
PACK_WINDOW = 32  # row groups of a Parquet source shuffled together (and kept in memory) when packing
CHUNK = 256  # images read and encoded at once
PROGRESS = f"{WORK}/progress.json"


@dataclass(frozen=True)
class PackOptions:
    """What decides the shards' bytes (a resumed pack must be given the same), and the bad-image policy."""

    splits: tuple[str, ...] = ("train", "val")
    max_side: int | None = None
    quality: int = 90
    shard_mib: float = 256
    on_bad_image: str = "error"


@dataclass
class Encoded:
    """One source row, ready for its shard, or the reason it is bad."""

    row: int
    jpeg: bytes = b""
    reencoded: bool = False
    bad: str = ""


def encode(data: bytes, max_side: int | None, quality: int) -> tuple[bytes, bool]:
    """(RGB JPEG bytes, whether they were re-encoded); BadImage if `data` is no usable image."""
    img = open_image(data)
    side = max(img.width, img.height)
    if data[:2] == JPEG_MAGIC and (max_side is None or side <= max_side) and _plain_rgb_jpeg(data):
        decode(img, 1, 1)  # the whole entropy-coded stream, at 1/8 scale: truncation shows here
        return data, False
    scale = min(1.0, max_side / side) if max_side else 1.0
    width, height = max(1, round(img.width * scale)), max(1, round(img.height * scale))
    pixels = decode(img, width, height)[0].numpy()  # shrunk in the DCT, down to >= the target
    if pixels.shape[:2] != (height, width):
        pixels = np.asarray(Image.fromarray(pixels).resize((width, height), Image.Resampling.LANCZOS))
    return simplejpeg.encode_jpeg(np.ascontiguousarray(pixels), quality=quality, colorspace="RGB",
                                  colorsubsampling="420"), True


def _plain_rgb_jpeg(data: bytes) -> bool:
    try:
        return simplejpeg.decode_jpeg_header(data)[2] == "YCbCr"
    except ValueError:
        return False


def sample_members(key: str, jpeg: bytes, label: int, synset: str, path: str) -> list[tuple[str, bytes]]:
    """One image's tar members, the image first (its offset is the one the samples table records)."""
    meta = json.dumps({"synset": synset, "path": path}, ensure_ascii=False).encode()
    return [(f"{key}.jpg", jpeg), (f"{key}.cls", str(label).encode()), (f"{key}.json", meta)]


class _TellingHash(HashingFile):
    """The shard's sha256 computed as it is written (tarfile asks its file where it starts)."""

    def tell(self) -> int:
        return self.size


class ShardWriter:
    """One shard being written to a scratch file: members of fixed metadata, image offsets recorded."""

    def __init__(self, path: Path, name: str, index: int) -> None:
        self.name, self.index, self.path = name, index, path
        with self._writing():
            self.file = path.open("wb")
        self.hashing = _TellingHash(self.file)
        self.tar = tarfile.open(fileobj=self.hashing, mode="w", format=tarfile.USTAR_FORMAT)  # noqa: SIM115
        self.rows: list[tuple[int, int, int, str, str]] = []  # label, offset, size, key, source path

    def size_with(self, members: list[tuple[str, bytes]]) -> int:
        """The file's size if closed after adding `members`: a 512-byte header per member, data padded
        to 512 bytes, the two zero blocks that end a tar, all padded to tarfile's 10 KiB record."""
        end = self.tar.offset + 2 * tarfile.BLOCKSIZE + sum(
            tarfile.BLOCKSIZE + -(-len(data) // tarfile.BLOCKSIZE) * tarfile.BLOCKSIZE for _, data in members)
        return -(-end // tarfile.RECORDSIZE) * tarfile.RECORDSIZE

    def add(self, members: list[tuple[str, bytes]], label: int, path: str) -> None:
        with self._writing():
            offset = [self._member(name, data) for name, data in members][0]
        self.rows.append((label, offset, len(members[0][1]), members[0][0].rsplit(".", 1)[0], path))

    def _member(self, name: str, data: bytes) -> int:
        """Append a member; the offset of its data (one 512-byte ustar header after its start)."""
        info = tarfile.TarInfo(name)  # uid, gid 0 and no owner names by default
        info.size, info.mode, info.mtime = len(data), 0o444, 0
        start = self.tar.offset
        self.tar.addfile(info, io.BytesIO(data))
        return start + tarfile.BLOCKSIZE

    def close(self) -> tuple[Samples, ShardInfo]:
        """Finish the file (fsync'd: it is renamed into place next); its rows and its ShardInfo."""
        with self._writing():
            self.tar.close()
            self.file.flush()
            os.fsync(self.file.fileno())
            self.file.close()
        labels, offsets, sizes, keys, paths = zip(*self.rows, strict=True) if self.rows else ([],) * 5
        samples = Samples(np.full(len(labels), self.index, np.int32), np.array(offsets, np.int64),
                          np.array(sizes, np.int64), np.array(labels, np.int64), PackedStrings.pack(keys),
                          PackedStrings.pack(f"{k}.jpg" for k in keys), PackedStrings.pack(paths))
        return samples, ShardInfo(self.name, len(samples), self.hashing.size, self.hashing.digest.hexdigest())

    def discard(self) -> None:
        self.file.close()
        self.path.unlink(missing_ok=True)

    @contextmanager
    def _writing(self) -> Iterator[None]:
        """Local I/O errors as one line naming the scratch file: a refused write (a full disk) as
        `io.writing` says it, any other as a data error."""
        try:
            with writing(self.path):
                yield
        except OSError as e:
            raise DataError(f"{self.path}: cannot write this shard ({e.strerror or e}); check the free space "
                            "there") from e


@dataclass(frozen=True)
class Source:
    """The data set being packed: its files, and what the index records of it."""

    fs: fsspec.AbstractFileSystem
    root: str
    name: str
    layout: str
    url: str  # the registry's storage.path


def pack_index(fs: fsspec.AbstractFileSystem, root: str, layout: str, splits: tuple[str, ...],
               on_bad_image: str, options: LayoutOptions | None = None,
               unlabeled: str | None = None) -> IndexTable:
    """The source's index for `splits`, one split at a time so that each problem the index found (a row
    of an unknown synset, left out of the split) carries its split: `pack` lists it there, or stops.
    With `unlabeled` (a registry entry's), `UNLABELED` among `splits` is that split (unlabeled.py), packed
    under the name `UNLABELED`."""
    labelled = [name for name in splits if unlabeled is None or name != UNLABELED]
    tables = {name: build_index(fs, root, layout, splits=(name,), on_bad_image=on_bad_image, options=options)
              for name in labelled}
    first = tables[labelled[0]]
    rows = {name: t.splits[name] for name, t in tables.items()}
    if unlabeled is not None and UNLABELED in splits:
        rows[UNLABELED] = unlabeled_split(fs, root, layout, unlabeled, on_bad_image)
    return IndexTable(first.classes, first.descriptions, rows,
                      [{**p, "split": name} for name, t in tables.items() for p in t.problems])


def pack(source: Source, index: IndexTable, to: str, opts: PackOptions, workers: int,
         progress: Callable[[int, int], None] | None = None) -> dict[str, Any]:
    """Write `index`'s splits of `source` as shards under `to`; resume an unfinished pack there.

    `index` comes from `pack_index` (a `build_index` table works too, but the rows its index left out,
    having no split, are then neither listed nor stopped at)."""
    started = time.perf_counter()
    dest = Destination(to)
    try:
        packer = Packer(source, index, dest, opts)
        total = sum(len(index.splits[s]) for s in opts.splits)
        done = sum(packer.state[s].next_row for s in opts.splits)
        pool = ThreadPoolExecutor(workers, thread_name_prefix="pack")
        try:
            for name in opts.splits:
                for finished in packer.split(name, pool):
                    done += finished
                    if progress:
                        progress(done, total)
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
        splits = packer.finish()
    finally:
        dest.close()
    return {
        "to": dest.url,
        "index": f"{dest.url}/{INDEX}",
        "splits": {name: {"images": info.images, "shards": len(info.shards),
                          "bytes": sum(s.bytes for s in info.shards), "skipped": len(info.skipped)}
                   for name, info in splits.items()},
        "seconds": time.perf_counter() - started,
    }


def rows_digest(split: Split) -> str:
    """The split's rows (paths and labels, in order) as a short digest: a resumed pack must pack the same."""
    digest = hashlib.sha256(np.ascontiguousarray(split.paths.offsets, np.int64).tobytes())
    digest.update(np.ascontiguousarray(split.paths.data).tobytes())
    digest.update(np.ascontiguousarray(split.labels, np.int64).tobytes())
    return f"{len(split)} rows, sha256 {digest.hexdigest()[:16]}"


def pack_order(split: Split, name: str) -> np.ndarray:
    """The rows of a split in the order they go into the shards: train (and the unlabelled images)
    shuffled once, val as it is. A source read by row group (Parquet) is shuffled `PACK_WINDOW` row
    groups at a time (the training order's windows, `sampler.shard_order`), so that each row group is
    read once, not once per row."""
    if name not in ("train", UNLABELED):
        return np.arange(len(split))
    if split.container == PARQUET and split.sharded:
        return shard_order(split.starts, ORDER_SEED, 0, PACK_WINDOW).numpy()
    return np.random.default_rng(ORDER_SEED).permutation(len(split))


@dataclass
class SplitProgress:
    next_row: int = 0  # position in the split's pack order of the first row not in a finished shard
    shards: list[ShardInfo] = field(default_factory=list)
    skipped: list[dict[str, str]] = field(default_factory=list)
    reencoded: int = 0


class Packer:
    """One pack into `dest`: its progress (resumed from the destination), shard by shard."""

    def __init__(self, source: Source, index: IndexTable, dest: Destination, opts: PackOptions) -> None:
        self.source, self.index, self.dest, self.opts = source, index, dest, opts
        self.readers = {name: open_reader(source.fs, source.root, index.splits[name], window=PACK_WINDOW)
                        for name in opts.splits}
        self.root = source.root.rstrip("/")
        self.problems = {name: [{"path": p["path"], "reason": p["reason"]} for p in index.problems
                                if p.get("split") == name] for name in opts.splits}
        if opts.on_bad_image == "error" and any(self.problems.values()):
            bad = next(p for found in self.problems.values() for p in found)
            count = sum(map(len, self.problems.values()))
            raise DataError(f"{self.root}/{bad['path']}: {bad['reason']} ({count} such row(s) in the "
                            f"index of {source.name}); fix its metadata, or pack with --on-bad-image skip to "
                            "leave them out")
        # what decides the shards' bytes (the source's rows too); on_bad_image does not (see `_resume`)
        self.options = {"dataset": source.name, **asdict(opts), "splits": list(opts.splits),
                        "rows": {name: rows_digest(index.splits[name]) for name in opts.splits}}
        del self.options["on_bad_image"]
        self.state = self._resume()

    def _resume(self) -> dict[str, SplitProgress]:
        """The progress of an unfinished pack with the same options at `dest`, or a fresh start.

        A pack stopped by a bad image (`--on-bad-image error`) may go on with `skip`: its shards hold no bad
        image either way. The other way round is refused once images were skipped."""
        dest = self.dest
        if dest.size(INDEX) is not None:
            raise ConfigError(f"{dest.url}/{INDEX}: a finished pack is already there; pack into an empty "
                              "destination (or delete it first)")
        dest.remove_stale()
        raw = dest.read(PROGRESS)
        if raw is None:
            return {name: SplitProgress() for name in self.opts.splits}
        saved = json.loads(raw)
        if saved["options"] != self.options:
            raise ConfigError(f"{dest.url}/{PROGRESS}: an unfinished pack with other options or another "
                              f"source ({saved['options']}) is there; run again with the same options, or "
                              "pack into an empty destination")
        state = {}
        for name in self.opts.splits:
            s = saved["splits"][name]
            shards = [ShardInfo(**x) for x in s["shards"]]
            for shard in shards:  # every shard the progress names is there, whole
                if dest.size(shard.name) != shard.bytes or dest.size(f"{WORK}/{shard.name}.npz") is None:
                    raise DataError(f"{dest.url}/{shard.name}: missing, or not the size the unfinished pack "
                                    "recorded; pack into an empty destination")
            if s["skipped"] and self.opts.on_bad_image == "error":
                raise ConfigError(f"{dest.url}/{PROGRESS}: the unfinished pack there skipped "
                                  f"{len(s['skipped'])} bad image(s) of {name}; go on with --on-bad-image "
                                  "skip, or pack into an empty destination")
            state[name] = SplitProgress(s["next_row"], shards, s["skipped"], s["reencoded"])
        return state

    def save_progress(self) -> None:
        body = {"options": self.options, "splits": {name: asdict(s) for name, s in self.state.items()}}
        self.dest.write(PROGRESS, json.dumps(body).encode())

    def encode_row(self, name: str, split: Split, row: int) -> Encoded:
        try:
            data = read_row(self.readers[name], split, row).data
            jpeg, reencoded = encode(data, self.opts.max_side, self.opts.quality)
            return Encoded(row, jpeg, reencoded)
        except BadImage as e:
            return Encoded(row, bad=str(e))

    def split(self, name: str, pool: ThreadPoolExecutor) -> Iterator[int]:
        """Write the rest of split `name`; yields how many rows each encoded chunk finished."""
        split, progress = self.index.splits[name], self.state[name]
        order = pack_order(split, name)
        limit = self.opts.shard_mib * 2**20
        writer: ShardWriter | None = None
        skipped: list[dict[str, str]] = []  # bad images since the last shard closed
        try:
            for start in range(progress.next_row, len(order), CHUNK):
                chunk = order[start:start + CHUNK].tolist()
                self.readers[name].prefetch([split.paths[r] for r in chunk])  # remote files: concurrent GETs
                for position, item in enumerate(pool.map(lambda r: self.encode_row(name, split, r), chunk),
                                                start):
                    path = split.paths[item.row]
                    if item.bad:
                        if self.opts.on_bad_image == "error":
                            raise DataError(f"bad image {self.root}/{path}: {item.bad} (pack with "
                                            "--on-bad-image skip to leave it out)")
                        skipped.append({"path": path, "reason": item.bad})
                        continue
                    label = int(split.labels[item.row])
                    members = sample_members(f"{name}_{item.row:08d}", item.jpeg, label,
                                             self.index.classes[label] if label >= 0 else "", path)
                    if writer is not None and writer.size_with(members) > limit:
                        self.close_shard(name, writer, skipped, position)
                        writer, skipped = None, []
                    if writer is None:
                        shard = f"{name}-{len(progress.shards):06d}.tar"
                        writer = ShardWriter(self.dest.temp_path(shard), shard, len(progress.shards))
                    writer.add(members, label, path)
                    progress.reencoded += item.reencoded
                yield len(chunk)
        except BaseException:
            if writer is not None:
                writer.discard()
            raise
        if writer is not None:
            self.close_shard(name, writer, skipped, len(order))
        elif skipped:  # bad images after the last shard closed: recorded all the same
            progress.skipped += skipped
            progress.next_row = len(order)

    def close_shard(self, split: str, writer: ShardWriter, skipped: list[dict[str, str]],
                    next_row: int) -> None:
        """Put the shard in place, then its rows' table, then the progress that names both."""
        progress = self.state[split]
        samples, info = writer.close()
        table = io.BytesIO()
        samples.save(table)
        self.dest.put(writer.path, writer.name)
        self.dest.write(f"{WORK}/{writer.name}.npz", table.getvalue())
        progress.shards.append(info)
        progress.skipped += skipped
        progress.next_row = next_row
        self.save_progress()

    def finish(self) -> dict[str, SplitInfo]:
        """The samples tables, then index.json (last: now the destination is a data set), then tidy up."""
        splits = {}
        for name in self.opts.splits:
            progress = self.state[name]
            images = sum(s.images for s in progress.shards)
            splits[name] = SplitInfo(images, progress.shards, self.problems[name] + progress.skipped)
            self.dest.write(samples_name(name), self.joined_samples(progress.shards))
        reencoded = {s: self.state[s].reencoded for s in self.opts.splits}
        source = {"dataset": self.source.name, "layout": self.source.layout, "root": self.source.url,
                  "split_images": {s: len(self.index.splits[s]) for s in self.opts.splits},
                  "train_order_seed": ORDER_SEED, "reencoded": reencoded}
        body = ShardsIndex(self.index.classes, self.index.descriptions, splits, source, self.opts.max_side,
                           self.opts.quality if any(reencoded.values()) else None)
        self.dest.write(INDEX, body.to_json().encode())
        self.dest.clear_work([PROGRESS, *(f"{WORK}/{s.name}.npz" for n in self.opts.splits
                                          for s in self.state[n].shards)])
        return splits

    def joined_samples(self, shards: list[ShardInfo]) -> bytes:
        """A split's samples table: the per-shard tables, in shard order."""
        parts = []
        for s in shards:
            where = f"{WORK}/{s.name}.npz"
            data = self.dest.read(where)
            if data is None:
                raise DataError(f"{self.dest.url}/{where}: missing; pack into an empty destination")
            parts.append(Samples.load(data, f"{self.dest.url}/{where}"))
        numbers = (np.concatenate([getattr(p, f) for p in parts]) if parts else np.zeros(0, np.int64)
                   for f in ("shard", "offset", "size", "label"))
        strings = (PackedStrings.pack(s for p in parts for s in getattr(p, f))
                   for f in ("key", "member", "path"))
        out = io.BytesIO()
        Samples(*numbers, *strings).save(out)
        return out.getvalue()
