"""`ddp datasets check`: read and decode every file of a split; report every bad one and why.

Reasons: "missing file" (named in the listing or CSV, absent from the root),
"unreadable (...)", "not an image", "truncated", "corrupt (...)", "unknown
synset" (a CSV row whose class is not in the synset mapping), and "unsafe path
(...)" (a listed name that is absolute or climbs out of its folder: never read), and for
Parquet "no label" / "label N is not a class" (a row left out of its split). Files
are read through the same reader and decoded by the same decoder as in
training, so what check passes, training reads; JPEGs are decoded at 1/8 scale,
which still runs the whole entropy-coded stream (where truncation and
corruption show) for a fraction of the cost. Threads do the work: reads wait on
the disk or the network, and libjpeg-turbo and PIL decode without the GIL.
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import fsspec
import numpy as np

from ddp_cli.data.fetch.parquet_reader import ParquetReader
from ddp_cli.data.pipeline.images import BadImage, decode
from ddp_cli.data.pipeline.loaders import Reader, open_reader, read_row
from ddp_cli.data.sources.layouts import SHARDS, LayoutOptions, build_index
from ddp_cli.data.sources.packed import Split
from ddp_cli.data.sources.shards import read_index
from ddp_cli.data.sources.table import SPLITS, IndexTable

CHUNK = 4096  # files in flight at once: a million futures would not fit in memory


def default_workers() -> int:
    return min(32, 4 * (os.cpu_count() or 1))


def check_dataset(
    fs: fsspec.AbstractFileSystem,
    root: str,
    layout: str,
    splits: tuple[str, ...] = SPLITS,
    workers: int | None = None,
    progress: Callable[[int, int], None] | None = None,
    options: LayoutOptions | None = None,
) -> dict[str, Any]:
    """Scan `splits` of the data set at `root` (`options`: its layout's, as `build_index`'s);
    `progress(done, total)` is called as files are checked."""
    started = time.perf_counter()
    index = build_index(fs, root, layout, splits=splits, options=options)
    bad = list(index.problems) + nothing_to_learn(index, splits)
    if layout == SHARDS:
        bad += check_shards(fs, root, splits)
    rows = [(split, row) for split in splits for row in range(len(index.splits[split]))]
    mine = threading.local()  # a reader per thread: a shard reader's open files are its own
    shared = {name: reader for name in splits  # but one for Parquet: each row group is read once
              if isinstance(reader := open_reader(fs, root, index.splits[name]), ParquetReader)}

    def check(item: tuple[str, int]) -> str | None:
        split = index.splits[item[0]]
        if not hasattr(mine, "readers"):
            mine.readers = {name: shared.get(name) or open_reader(fs, root, index.splits[name])
                            for name in splits}
        return check_file(mine.readers[item[0]], split, item[1])

    with ThreadPoolExecutor(workers or default_workers(), thread_name_prefix="check") as pool:
        for start in range(0, len(rows), CHUNK):
            chunk = rows[start:start + CHUNK]
            for done, ((split, row), reason) in enumerate(zip(chunk, pool.map(check, chunk), strict=True),
                                                          start + 1):
                if reason:
                    bad.append({"path": index.splits[split].paths[row], "reason": reason})
                if progress:
                    progress(done, len(rows))
    return {
        "splits": index.counts(),
        "bad_files": sorted(bad, key=lambda b: b["path"]),
        "seconds": time.perf_counter() - started,
    }


def nothing_to_learn(index: IndexTable, splits: tuple[str, ...]) -> list[dict[str, str]]:
    """A split without an image, and a class without a train image: a data set that cannot train or
    validate fails the check (as a bad file would) instead of failing training later."""
    empty = [{"path": f"{split}/", "reason": "empty split: no image to train or validate on"}
             for split in splits if not len(index.splits[split])]
    if "train" not in splits or not len(index.splits["train"]):
        return empty
    seen = set(np.unique(index.splits["train"].labels).tolist())
    return empty + [{"path": f"train/{name}/", "reason": "class without a train image"}
                    for label, name in enumerate(index.classes) if label not in seen]


def check_file(reader: Reader, split: Split, row: int) -> str | None:
    """Why row `row` of `split` cannot be trained on, or None if it can."""
    try:
        decode(read_row(reader, split, row), 1, 1)
    except BadImage as e:
        return str(e)
    return None


def check_shards(fs: fsspec.AbstractFileSystem, root: str, splits: tuple[str, ...]) -> list[dict[str, str]]:
    """Every shard of `splits` against the size and sha256 the index records (read as a stream)."""
    meta = read_index(fs, root)
    bad = []
    for info in (shard for split in splits for shard in meta.splits[split].shards):
        digest, size = hashlib.sha256(), 0
        try:
            with fs.open(f"{root.rstrip('/')}/{info.name}", "rb") as f:
                for block in iter(lambda f=f: f.read(1 << 20), b""):
                    digest.update(block)
                    size += len(block)
        except FileNotFoundError:
            bad.append({"path": info.name, "reason": "missing shard"})
            continue
        if (size, digest.hexdigest()) != (info.bytes, info.sha256):
            bad.append({"path": info.name, "reason": f"shard differs from the index ({size} bytes, sha256 "
                                                     f"{digest.hexdigest()[:12]}...; the index says "
                                                     f"{info.bytes} bytes, {info.sha256[:12]}...)"})
    return bad
