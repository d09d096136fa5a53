"""`ddp datasets pack`: a registry data set rewritten as tar shards, read sequentially at full speed.

Per image, three members in the WebDataset convention: `<key>.jpg` (always an
RGB JPEG: CMYK, grayscale, PNG-as-JPEG and the rest are re-encoded; a plain RGB
JPEG that needs no shrinking is copied byte for byte after a check that it
decodes), `<key>.cls` (the label, decimal text) and `<key>.json` (synset and
source path), so `webdataset.WebDataset` reads the shards as they are. Train rows
go into the shards in a fixed shuffled order, so every shard mixes the classes
and reading a few shards at a time (the training order, `sampler.py`) still
gives well-mixed batches; val keeps its source order.

Nothing half-done is ever visible, and a killed pack resumes:
- a shard is written to a temporary file and then renamed (local) or uploaded
  in one request (S3: an object appears whole or not at all);
- after each shard, its rows' table goes to `.pack/<shard>.npz` and the
  progress (options, shards done, next row) to `.pack/progress.json`; a rerun
  with the same options continues after the last shard done, and since a shard
  closes at the same image whatever the number of workers, the shards are
  identical to those of an uninterrupted pack;
- `index.json` is written last (and `.pack/` removed): a destination without
  it is not a data set yet.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import fsspec
import numpy as np
import simplejpeg
from PIL import Image

from ddp_cli.data.images import JPEG_MAGIC, BadImage, decode, open_image
from ddp_cli.data.layouts import IndexTable
from ddp_cli.data.loaders import fetch
from ddp_cli.data.packed import PackedStrings, Split
from ddp_cli.data.shards import INDEX, Samples, ShardInfo, ShardsIndex, SplitInfo, samples_name
from ddp_cli.data.storage import FileReader
from ddp_cli.errors import ConfigError, DataError
from ddp_cli.io import sha256_of

ORDER_SEED = 0  # the train rows' order in the shards (recorded in the index)
CHUNK = 256  # images encoded at once
WORK = ".pack"  # progress and per-shard tables of an unfinished pack
PROGRESS = f"{WORK}/progress.json"


@dataclass(frozen=True)
class PackOptions:
    """What decides the shards' bytes: a resumed pack must be given the same."""

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


class Destination:
    """A local folder or an S3 prefix, written file by file, each whole or not at all."""

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")
        self.remote = url.startswith("s3://")
        if self.remote:
            from ddp_cli.data.storage import S3Location, s3_filesystem

            bucket, _, prefix = self.url.removeprefix("s3://").partition("/")
            location = S3Location(f"s3://{bucket}", os.environ.get("AWS_ENDPOINT_URL"))
            self.fs, root = s3_filesystem(location, "create the bucket, or check the URL and "
                                                    "AWS_ENDPOINT_URL")
            self.root = f"{root}/{prefix}".rstrip("/")
        else:
            self.fs = fsspec.filesystem("file")
            self.root = str(Path(url).expanduser().resolve())
        self._scratch: Path | None = None

    @property
    def scratch(self) -> Path:
        """Where files are written before they are put in place: for a local destination a folder in it
        (the same filesystem: a rename puts a file in place), else a temporary folder."""
        if self._scratch is None:
            if self.remote:
                self._scratch = Path(tempfile.mkdtemp(prefix="ddp-pack-"))
            else:
                self._scratch = Path(self.root, WORK)
                self._scratch.mkdir(parents=True, exist_ok=True)
        return self._scratch

    def put(self, local: Path, name: str) -> None:
        """Move the finished file `local` to `name`."""
        if self.remote:
            self.fs.put_file(str(local), f"{self.root}/{name}")
            local.unlink()
        else:
            os.replace(local, Path(self.root, name))

    def write(self, name: str, data: bytes) -> None:
        local = self.scratch / f".{Path(name).name}.{os.getpid()}.tmp"
        local.write_bytes(data)
        self.put(local, name)

    def read(self, name: str) -> bytes | None:
        try:
            return self.fs.cat_file(f"{self.root}/{name}")
        except FileNotFoundError:
            return None

    def size(self, name: str) -> int | None:
        try:
            return self.fs.size(f"{self.root}/{name}")
        except FileNotFoundError:
            return None

    def clear_work(self, names: list[str]) -> None:
        """Remove the unfinished pack's files (`names` under .pack/) and the scratch folder."""
        if self.remote:
            for name in names:
                self.fs.rm_file(f"{self.root}/{name}")
        if self._scratch is not None:
            shutil.rmtree(self._scratch, ignore_errors=True)


@dataclass
class SplitProgress:
    next_row: int = 0  # position in the split's pack order of the first row not in a finished shard
    shards: list[ShardInfo] = field(default_factory=list)
    skipped: list[dict[str, str]] = field(default_factory=list)
    reencoded: int = 0


class ShardWriter:
    """One shard being written: members of fixed metadata (same bytes on every run), offsets recorded."""

    def __init__(self, folder: Path, name: str, index: int) -> None:
        self.name, self.index = name, index
        self.path = folder / f".{name}.{os.getpid()}.tmp"
        self.tar = tarfile.open(self.path, "w", format=tarfile.USTAR_FORMAT)  # noqa: SIM115 - closed by close()
        self.rows: list[tuple[int, int, int, str, str]] = []  # label, offset, size, key, source path

    @property
    def bytes(self) -> int:
        return self.tar.offset

    def add(self, key: str, jpeg: bytes, label: int, synset: str, path: str) -> None:
        offset = self._member(f"{key}.jpg", jpeg)
        self._member(f"{key}.cls", str(label).encode())
        self._member(f"{key}.json", json.dumps({"synset": synset, "path": path}).encode())
        self.rows.append((label, offset, len(jpeg), key, path))

    def _member(self, name: str, data: bytes) -> int:
        """Append a member; the offset of its data (one 512-byte ustar header after its start)."""
        info = tarfile.TarInfo(name)
        info.size, info.mode, info.mtime = len(data), 0o444, 0
        start = self.tar.offset
        self.tar.addfile(info, io.BytesIO(data))
        return start + tarfile.BLOCKSIZE

    def close(self) -> Samples:
        self.tar.close()
        labels, offsets, sizes, keys, paths = zip(*self.rows, strict=True) if self.rows else ([],) * 5
        return Samples(np.full(len(labels), self.index, np.int32), np.array(offsets, np.int64),
                       np.array(sizes, np.int64), np.array(labels, np.int64), PackedStrings.pack(keys),
                       PackedStrings.pack(f"{k}.jpg" for k in keys), PackedStrings.pack(paths))


@dataclass(frozen=True)
class Source:
    """The data set being packed: its files, and what the index records of it."""

    fs: fsspec.AbstractFileSystem
    root: str
    name: str
    layout: str
    url: str  # the registry's storage.path


def pack(source: Source, index: IndexTable, to: str, opts: PackOptions, workers: int,
         progress: Callable[[int, int], None] | None = None) -> dict[str, Any]:
    """Write `index`'s splits of `source` as shards under `to`; resume an unfinished pack there."""
    started = time.perf_counter()
    packer = Packer(source, index, Destination(to), opts)
    total = sum(len(index.splits[s]) for s in opts.splits)
    done = sum(packer.state[s].next_row for s in opts.splits)
    with ThreadPoolExecutor(workers, thread_name_prefix="pack") as pool:
        for name in opts.splits:
            for finished in packer.split(name, pool):
                done += finished
                if progress:
                    progress(done, total)
    splits = packer.finish()
    return {
        "to": packer.dest.url,
        "index": f"{packer.dest.url}/{INDEX}",
        "splits": {name: {"images": info.images, "shards": len(info.shards),
                          "bytes": sum(s.bytes for s in info.shards), "skipped": len(info.skipped)}
                   for name, info in splits.items()},
        "seconds": time.perf_counter() - started,
    }


def pack_order(n: int, split: str) -> np.ndarray:
    """The rows of a split in the order they go into the shards: train shuffled once, val as it is."""
    return np.random.default_rng(ORDER_SEED).permutation(n) if split == "train" else np.arange(n)


class Packer:
    """One pack into `dest`: its progress (resumed from the destination), shard by shard."""

    def __init__(self, source: Source, index: IndexTable, dest: Destination, opts: PackOptions) -> None:
        self.source, self.index, self.dest, self.opts = source, index, dest, opts
        self.reader = FileReader(source.fs, source.root)
        self.options = {"dataset": source.name, **asdict(opts), "splits": list(opts.splits)}
        self.state = self._resume()

    def _resume(self) -> dict[str, SplitProgress]:
        """The progress of an unfinished pack with the same options at `dest`, or a fresh start."""
        dest = self.dest
        if dest.size(INDEX) is not None:
            raise ConfigError(f"{dest.url}/{INDEX}: a finished pack is already there; pack into an empty "
                              "destination (or delete it first)")
        raw = dest.read(PROGRESS)
        if raw is None:
            return {name: SplitProgress() for name in self.opts.splits}
        saved = json.loads(raw)
        if saved["options"] != self.options:
            raise ConfigError(f"{dest.url}/{PROGRESS}: an unfinished pack with other options "
                              f"({saved['options']}) is there; run again with the same options, or pack "
                              "into an empty destination")
        state = {}
        for name in self.opts.splits:
            s = saved["splits"][name]
            shards = [ShardInfo(**x) for x in s["shards"]]
            for shard in shards:  # every shard the progress names is there, whole
                if dest.size(shard.name) != shard.bytes or dest.size(f"{WORK}/{shard.name}.npz") is None:
                    raise DataError(f"{dest.url}/{shard.name}: missing, or not the size the unfinished pack "
                                    "recorded; pack into an empty destination")
            state[name] = SplitProgress(s["next_row"], shards, s["skipped"], s["reencoded"])
        return state

    def save_progress(self) -> None:
        body = {"options": self.options, "splits": {name: asdict(s) for name, s in self.state.items()}}
        self.dest.write(PROGRESS, json.dumps(body).encode())

    def encode_row(self, split: Split, row: int) -> Encoded:
        try:
            data = fetch(self.reader, split.paths[row]).data
            jpeg, reencoded = encode(data, self.opts.max_side, self.opts.quality)
            return Encoded(row, jpeg, reencoded)
        except BadImage as e:
            return Encoded(row, bad=str(e))

    def split(self, name: str, pool: ThreadPoolExecutor) -> Iterator[int]:
        """Write the rest of split `name`; yields how many rows each encoded chunk finished."""
        split, progress = self.index.splits[name], self.state[name]
        order = pack_order(len(split), name)
        limit = self.opts.shard_mib * 2**20
        writer: ShardWriter | None = None
        skipped: list[dict[str, str]] = []
        for start in range(progress.next_row, len(order), CHUNK):
            chunk = order[start:start + CHUNK].tolist()
            for position, item in enumerate(pool.map(lambda r: self.encode_row(split, r), chunk), start):
                path = split.paths[item.row]
                if item.bad:
                    if self.opts.on_bad_image == "error":
                        raise DataError(f"bad image {self.reader.root}/{path}: {item.bad} (pack with "
                                        "--on-bad-image skip to leave it out)")
                    skipped.append({"path": path, "reason": item.bad})
                    continue
                if writer is not None and writer.bytes + len(item.jpeg) + 3 * 1024 > limit:
                    self.close_shard(writer, skipped, position)
                    writer, skipped = None, []
                if writer is None:
                    shard = len(progress.shards)
                    writer = ShardWriter(self.dest.scratch, f"{name}-{shard:06d}.tar", shard)
                label = int(split.labels[item.row])
                writer.add(f"{name}_{item.row:08d}", item.jpeg, label, self.index.classes[label], path)
                progress.reencoded += item.reencoded
            yield len(chunk)
        if writer is not None:
            self.close_shard(writer, skipped, len(order))
        elif skipped:  # bad files after the last shard closed: recorded all the same
            progress.skipped += skipped
            progress.next_row = len(order)

    def close_shard(self, writer: ShardWriter, skipped: list[dict[str, str]], next_row: int) -> None:
        """Put the shard in place, then its rows' table, then the progress that names both."""
        progress = self.state[writer.name.rsplit("-", 1)[0]]
        samples = writer.close()
        table = io.BytesIO()
        samples.save(table)
        info = ShardInfo(writer.name, len(samples), writer.path.stat().st_size, sha256_of(writer.path))
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
            splits[name] = SplitInfo(images, progress.shards, progress.skipped)
            self.dest.write(samples_name(name), self.joined_samples(progress.shards))
        source = {"dataset": self.source.name, "layout": self.source.layout, "root": self.source.url,
                  "split_images": {s: len(self.index.splits[s]) for s in self.opts.splits},
                  "train_order_seed": ORDER_SEED,
                  "reencoded": {s: self.state[s].reencoded for s in self.opts.splits}}
        body = ShardsIndex(self.index.classes, self.index.descriptions, splits, source, self.opts.max_side,
                           self.opts.quality)
        self.dest.write(INDEX, body.to_json().encode())
        self.dest.clear_work([PROGRESS, *(f"{WORK}/{s.name}.npz" for n in self.opts.splits
                                          for s in self.state[n].shards)])
        return splits

    def joined_samples(self, shards: list[ShardInfo]) -> bytes:
        """A split's samples table: the per-shard tables, in shard order."""
        parts = [Samples.load(self.dest.read(f"{WORK}/{s.name}.npz"), f"{self.dest.url}/{WORK}/{s.name}.npz")
                 for s in shards]
        numbers = (np.concatenate([getattr(p, f) for p in parts]) if parts else np.zeros(0, np.int64)
                   for f in ("shard", "offset", "size", "label"))
        strings = (PackedStrings.pack(s for p in parts for s in getattr(p, f))
                   for f in ("key", "member", "path"))
        out = io.BytesIO()
        Samples(*numbers, *strings).save(out)
        return out.getvalue()
