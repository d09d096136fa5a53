"""`ddp bench data NAME NAME... [--latency-ms MS]`: the training input pipeline over several storages.

Each registry entry is one storage of (usually) the same images: local files,
local shards, local Parquet (`layout = "parquet"`, read a window of row groups
at a time like shards), S3 files, S3 shards, S3 Parquet. An S3 entry with files gives two rows: one
GET per image (`io_concurrency` 1, serial) and a batch's GETs together
(`io_concurrency` as configured). Every row runs ddp's own training path
(EpochItems, the training sampler: for shards its shard order and window,
DataLoader processes, normalisation in the consumer), in alternating rounds,
each rate the total images over the total timed seconds; the ratios are each
row over the first row, measured in the same run. Each row also gives its
ratio in every round (over the first row's rate in that round) and their
median: a burst of load on a shared machine that hits one round moves the
totals, not the median. The order turns by one row each round, so whatever
a row leaves behind (its loader processes exiting, its cache being deleted)
falls on every row in turn, not always on the same one.

`--latency-ms` puts the fault proxy (`faultproxy.py`) in front of each S3
endpoint, adding a first-byte latency to every request, so that loopback
behaves like a region. It runs in a process of its own: in the measured
process its copying would take the GIL from the pipeline it measures. It
stands for the network, so when this process may use only some of the CPUs
(`taskset`), the proxy runs on the others: a region's CPUs are not the node's.

The cache must not turn a storage bench into a disk bench: remote shards go
to a fresh cache folder every round, which keeps `2 * shuffle_shards + 4`
shards, and the bench's window is 2 shards, so a data set of more shards than
that is streamed, not cached; the per-file cache is off.
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field

import torch
from torch.utils.data import DataLoader, Sampler

from ddp_cli.bench.data import set_up
from ddp_cli.bench.faultproxy import Faults, ProxyProcess
from ddp_cli.config import AugmentConfig, DataConfig
from ddp_cli.data.fetch.retry import IoPolicy
from ddp_cli.data.fetch.row_groups import group_folder
from ddp_cli.data.pipeline.augment import train_transform
from ddp_cli.data.pipeline.loaders import EpochItems, ImageDataset
from ddp_cli.data.pipeline.sampler import ShardSampler
from ddp_cli.data.pipeline.transforms import to_model_input
from ddp_cli.data.registry import DatasetEntry, load_registry
from ddp_cli.data.sources.layouts import build_index
from ddp_cli.data.sources.packed import PARQUET, Split
from ddp_cli.errors import ConfigError

WINDOW = 2  # shards read at a time: a small window, so that a small bench set is streamed


class Epochs(Sampler):
    """The training sampler's epochs, one after another, forever (rank 0 of 1)."""

    def __init__(self, split: Split, batch_size: int) -> None:
        self.sampler = ShardSampler(len(split), 0, 1, shuffle=True, batch_size=batch_size, with_epoch=True,
                                    shards=split.starts, window=WINDOW)

    def __iter__(self) -> Iterator[tuple[int, int, int]]:
        epoch = 0
        while True:
            self.sampler.set_epoch(epoch)
            yield from self.sampler
            epoch += 1


@dataclass
class Row:
    dataset: str
    storage: str
    entry: DatasetEntry
    split: Split
    concurrency: int
    images: int = 0
    seconds: float = 0.0
    rates: list[float] = field(default_factory=list)  # one per round

    def ratios_to(self, first: Row) -> list[float]:
        return [mine / theirs for mine, theirs in zip(self.rates, first.rates, strict=True)]


def bench_storage(names: list[str], registry: str | None, latency_ms: float, workers: int, seconds: float,
                  batch_size: int, image_size: int, rounds: int = 3) -> dict:
    """Rates of the training pipeline over each named data set's storage; ratios to the first."""
    with ExitStack() as stack:
        rows, proxies = [], []
        for name in names:
            entry = load_registry(registry).get(name)
            remote = entry.storage.driver == "S3"
            if remote and latency_ms:
                endpoint = entry.storage.endpoint_url or os.environ.get("AWS_ENDPOINT_URL")
                if not endpoint:
                    raise ConfigError(f"--latency-ms: data set {name!r} has no storage.endpoint_url (nor is "
                                      "AWS_ENDPOINT_URL set): the proxy needs an endpoint to stand before")
                proxy = stack.enter_context(ProxyProcess(endpoint, Faults(latency_ms=latency_ms)))
                if elsewhere := set(range(os.cpu_count() or 1)) - os.sched_getaffinity(0):
                    os.sched_setaffinity(proxy.proc.pid, elsewhere)
                proxies.append(proxy)
                entry = entry.model_copy(deep=True)
                entry.storage.endpoint_url = proxy.url
            fs, root = entry.open()
            split = build_index(fs, root, entry.layout, splits=("train",),
                                options=entry.layout_options).splits["train"]
            if len(split) < batch_size:
                raise ConfigError(f"bench data: {name!r} has {len(split)} train images, fewer than "
                                  f"--batch-size {batch_size}")
            kind = (" parquet" if split.container == PARQUET else " shards") if split.sharded else " files"
            where = ("s3" if remote else "local") + kind
            if remote and not split.sharded:
                rows += [Row(name, f"{where} serial", entry, split, 1),
                         Row(name, f"{where} batched", entry, split, DataConfig().io_concurrency)]
            else:
                rows.append(Row(name, where, entry, split, DataConfig().io_concurrency))
        for turn in range(rounds):
            for row in rows[turn % len(rows):] + rows[:turn % len(rows)]:  # each row first in some round
                images, elapsed = measure(row, workers, batch_size, image_size, seconds / rounds / len(rows))
                row.images += images
                row.seconds += elapsed
                row.rates.append(images / elapsed)
    first = rows[0].images / rows[0].seconds
    return {
        "bench": "data-storage",
        "datasets": names,
        "latency_ms": latency_ms,
        **set_up(workers, batch_size, image_size, seconds, rounds),
        "rows": [{"dataset": r.dataset, "storage": r.storage, "images": r.images, "seconds": r.seconds,
                  "images_per_second": r.images / r.seconds, "ratio": r.images / r.seconds / first,
                  "round_ratios": r.ratios_to(rows[0]),
                  "median_ratio": statistics.median(r.ratios_to(rows[0]))}
                 for r in rows],
        "ratios": {f"{r.dataset}: {r.storage}": r.images / r.seconds / first for r in rows},
        "proxied_requests": sum(p.requests for p in proxies),  # what went through --latency-ms
    }


def measure(row: Row, workers: int, batch_size: int, image_size: int, seconds: float) -> tuple[int, float]:
    """Images consumed and seconds taken by fresh loader processes (and a fresh shard cache, and no
    decoded Parquet row groups left on the node by an earlier round)."""
    cache = tempfile.mkdtemp(prefix="ddp-bench-shards-")
    try:
        fs, root = row.entry.open()
        shutil.rmtree(group_folder(fs, root), ignore_errors=True)
        transform = train_transform(DataConfig(image_size=image_size), AugmentConfig())
        dataset = ImageDataset(fs, root, row.split, transform, "skip", image_size,
                               cache if row.split.sharded else None,  # no per-file cache: every GET counts
                               2 * WINDOW + 4, IoPolicy(concurrency=row.concurrency), WINDOW)
        loader = DataLoader(EpochItems(dataset, seed=0), batch_size=batch_size,
                            sampler=Epochs(row.split, batch_size), num_workers=workers,
                            prefetch_factor=DataConfig().prefetch_factor if workers else None)
        cpu = torch.device("cpu")
        batches = iter(loader)
        for _ in range(max(2, 2 * workers)):  # start-up, and the batches queued meanwhile
            next(batches)
        images, started = 0, time.perf_counter()
        while time.perf_counter() - started < seconds:
            images += len(to_model_input(next(batches)[0], cpu, channels_last=False))
        elapsed = time.perf_counter() - started
        del batches
        return images, elapsed
    finally:
        shutil.rmtree(cache, ignore_errors=True)
