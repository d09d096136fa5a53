"""Reading packed shards: ddp's reader against wids (webdataset's indexed dataset) and webdataset's stream.

    python benchmarks/shard_readers.py /tmp/storage-bench/shards --rounds 3

Local shards written by `ddp datasets pack`; every image's bytes read once per round, in the
training order of one epoch (ddp, wids: random access in shard windows) or in the tar's order
(webdataset: a sequential stream, the only order it has). Bytes only, no decode: the readers are
what differs. Prints images/s per reader, best of the rounds.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import fsspec
import webdataset as wds
import wids

from ddp_cli.data.pipeline.loaders import open_reader, read_row
from ddp_cli.data.pipeline.sampler import shard_order
from ddp_cli.data.sources.layouts import build_index
from ddp_cli.data.sources.shards import read_index


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("root", type=Path)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    fs, root = fsspec.filesystem("file"), str(args.root.resolve())
    split = build_index(fs, root, "shards", splits=("train",)).splits["train"]
    order = shard_order(split.starts, seed=0, epoch=0, window=8).tolist()
    shards = read_index(fs, root).splits["train"].shards
    tars = [f"{root}/{s.name}" for s in shards]

    def ddp_reader() -> int:
        reader = open_reader(fs, root, split)
        return sum(len(read_row(reader, split, row).data) for row in order)

    def wids_reader() -> int:
        dataset = wids.ShardListDataset([{"url": t, "nsamples": s.images} for t, s in zip(tars, shards,
                                                                                             strict=True)],
                                        keep=True, transformations=[])
        return sum(len(dataset[row][".jpg"].getvalue() if hasattr(dataset[row][".jpg"], "getvalue")
                       else dataset[row][".jpg"]) for row in order)

    def webdataset_stream() -> int:
        return sum(len(sample["jpg"]) for sample in wds.WebDataset(tars, shardshuffle=False))

    readers = (("ddp (pread at the index's offsets)", ddp_reader), ("wids.ShardListDataset", wids_reader),
               ("webdataset.WebDataset (stream)", webdataset_stream))
    for name, run in readers:
        best = 0.0
        for _ in range(args.rounds):
            started = time.perf_counter()
            total = run()
            best = max(best, len(split) / (time.perf_counter() - started))
        print(f"{name:40s} {best:10.0f} img/s  ({total / len(split) / 1024:.0f} KiB/img)")


if __name__ == "__main__":
    main()
