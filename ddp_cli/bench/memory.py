"""`ddp bench memory`: the private memory the index costs a rank and each of its loader processes.

The index of ImageNet-sized metadata (`bench.metadata`) is built by the real
`build_index`, handed off through the real `IndexTable.save`/`load`, and its
train split walked for one full pass by `make_loader`'s DataLoader processes
through the real `ImageDataset`, with file reads stubbed (every path reads one
8x8 JPEG), so the pass costs no I/O. Two forms of the index, each in a fresh
spawned rank process:

- "lists": the first wave's, the dataset holding paths and labels as Python
  lists of str and int (the baseline);
- "packed": this code's, `Split` (flat buffers, memory-mapped);
- "parquet": the same number of rows as Hugging Face-style Parquet (`layout =
  "parquet"`: 100-row groups as `datasets` writes image data sets, every image
  the same 8x8 JPEG), indexed by the real `build_index` and walked in the
  training order (row groups a window at a time), each image read from its
  row group by the real reader: the index and the row-group cache together.

Figures are USS (pages only that process maps, psutil): of the rank before and
after it loads the index and builds the dataset, and of each loader process
after its first batch (a warm-up epoch of one batch each) and after the full
pass. A Python object read by a forked process is written (its reference
count), so its page is copied out of the rank: that copy is what grows with
the pass. (Both forms run with the loader processes' `gc.freeze()`, so the
cyclic GC's own writes to the rank's objects are not in either figure.)
"""

from __future__ import annotations

import gc
import io
import tempfile
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import fsspec
import psutil
import torch
import torch.multiprocessing as mp
from PIL import Image

from ddp_cli.bench.data import machine
from ddp_cli.bench.metadata import CLASSES, TRAIN_IMAGES, write_metadata
from ddp_cli.config import DataConfig
from ddp_cli.data.fetch.storage import FileReader
from ddp_cli.data.pipeline.loaders import ImageDataset, make_loader
from ddp_cli.data.pipeline.sampler import ShardSampler
from ddp_cli.data.pipeline.transforms import ValTransform
from ddp_cli.data.sources.layouts import build_index
from ddp_cli.data.sources.table import IndexTable
from ddp_cli.errors import DdpError

SIDE = 8  # decoded and cropped per item: the pass is about the index, not the pixels
BATCH = 256
MB = 2**20


class ListedImages(ImageDataset):
    """`ImageDataset` as the first wave built it: the index as Python lists of str and int."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.paths, self.labels = list(self.paths), self.labels.tolist()


PARQUET_FORM, PARQUET_ROWS_PER_FILE, PARQUET_GROUP = "parquet", 10_000, 100
FORMS: dict[str, type[ImageDataset]] = {"lists": ListedImages, "packed": ImageDataset,
                                        PARQUET_FORM: ImageDataset}


class OneFile(FileReader):
    """A reader whose every file is the same small JPEG."""

    def __init__(self, fs: fsspec.AbstractFileSystem, root: str, data: bytes) -> None:
        super().__init__(fs, root)
        self.data = data

    def read(self, path: str) -> bytes:
        return self.data


def uss_mb(process: psutil.Process | None = None) -> float:
    return (process or psutil.Process()).memory_full_info().uss / MB


def small_jpeg() -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (SIDE, SIDE), (120, 60, 200)).save(out, "JPEG")
    return out.getvalue()


def walk(folder: Path, form: str, workers: int) -> dict[str, Any]:
    """In a fresh rank process: load the index, build the dataset, one pass; the USS figures."""
    torch.set_num_threads(1)
    mp.set_start_method(None, force=True)  # loader processes start as in a rank torchrun starts (not spawned)
    fs, root = fsspec.filesystem("file"), str(folder / form if form == PARQUET_FORM else folder)
    before = uss_mb()
    index = IndexTable.load(folder / f"index-{form}" if form == PARQUET_FORM else folder / "index")
    split = index.splits["train"]
    dataset = FORMS[form](fs, root, split, ValTransform(SIDE, SIDE), "error", SIDE)
    del index  # what stays is what the dataset holds
    gc.collect()
    rank_index = max(0.0, uss_mb() - before)
    if form != PARQUET_FORM:  # Parquet's images are read, from their row groups
        dataset.reader = OneFile(fs, root, small_jpeg())
    sampler = ShardSampler(len(dataset), 0, 1, shuffle=True, shards=split.starts,
                           window=DataConfig().shuffle_shards)
    loader = make_loader(dataset, sampler, BATCH, workers, DataConfig().prefetch_factor, pin_memory=False,
                         drop_last=False, seed=0)
    sampler.set_epoch(0, skip=max(0, len(dataset) - workers * BATCH))
    list(loader)  # a warm-up epoch: one batch per loader process
    start = [uss_mb(p) for p in psutil.Process().children()]  # persistent: the same processes go on
    sampler.set_epoch(0)
    images = sum(len(batch.labels) for batch in loader)
    end = [uss_mb(p) for p in psutil.Process().children()]
    return {"index": form, "paths_held_as": type(dataset.paths).__name__, "rank_index_mb": rank_index,
            "worker_start_mb": max(start), "worker_end_mb": max(end), "end_vs_start": max(end) / max(start),
            "images": images}


def _send(conn: Connection, folder: Path, form: str, workers: int) -> None:
    conn.send(walk(folder, form, workers))


def in_fresh_rank(folder: Path, form: str, workers: int) -> dict[str, Any]:
    """`walk` in a spawned process: its memory holds imports and the index, nothing of this one."""
    receive, send = mp.get_context("spawn").Pipe(duplex=False)
    process = mp.get_context("spawn").Process(target=_send, args=(send, folder, form, workers))
    process.start()
    send.close()
    try:
        return receive.recv()
    except EOFError:
        raise DdpError(f"bench memory: the rank process for the {form!r} index failed "
                       "(its traceback is above)") from None
    finally:
        process.join()


def bench_memory(rows: int = TRAIN_IMAGES, workers: int = 4) -> dict[str, Any]:
    """Rank and loader-process private memory for both forms of a `rows`-row train index."""
    with tempfile.TemporaryDirectory(prefix="ddp-bench-memory-") as tmp:
        folder = Path(tmp)
        write_metadata(folder, rows)
        build_index(fsspec.filesystem("file"), tmp, "imagenet-loc").save(folder / "index")
        files = sum(p.stat().st_size for p in (folder / "index").glob("train-*.npy")) / MB
        write_parquet(folder / PARQUET_FORM, rows)
        build_index(fsspec.filesystem("file"), str(folder / PARQUET_FORM), PARQUET_FORM).save(
            folder / f"index-{PARQUET_FORM}")
        measured = {form: in_fresh_rank(folder, form, workers) for form in FORMS}
    packed, lists, parquet = measured["packed"], measured["lists"], measured[PARQUET_FORM]
    return {
        "bench": "memory",
        "rows": rows,
        "workers": workers,
        "rank_index_mb": packed["rank_index_mb"],
        "worker_start_mb": packed["worker_start_mb"],
        "worker_end_mb": packed["worker_end_mb"],
        "worker_end_vs_baseline": packed["worker_end_mb"] / lists["worker_end_mb"],
        "index_files_mb": files,
        "parquet_rank_index_mb": parquet["rank_index_mb"],
        "parquet_worker_end_vs_start": parquet["end_vs_start"],
        "machine": machine(),
        "forms": list(measured.values()),
    }


def write_parquet(root: Path, rows: int) -> None:
    """`rows` train rows (and a few val rows) as Hugging Face-style Parquet: files of 10,000 rows in
    100-row groups, 1,000 classes, every image the same 8x8 JPEG (dictionary-encoded: small files)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    image = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    jpeg = small_jpeg()
    (root / "data").mkdir(parents=True, exist_ok=True)
    for split, count in (("train", rows), ("validation", PARQUET_GROUP)):
        files = -(-count // PARQUET_ROWS_PER_FILE)
        for f in range(files):
            ids = range(f * PARQUET_ROWS_PER_FILE, min(count, (f + 1) * PARQUET_ROWS_PER_FILE))
            table = pa.table({"image": pa.array([{"bytes": jpeg, "path": f"{i}.JPEG"} for i in ids], image),
                              "label": pa.array([i % CLASSES for i in ids], pa.int64())})
            pq.write_table(table, root / "data" / f"{split}-{f:05d}-of-{files:05d}.parquet",
                           row_group_size=PARQUET_GROUP)
