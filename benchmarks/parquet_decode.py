"""Where a Parquet image costs CPU against a file (BENCHMARKS.md, "Parquet"): the bytes of every train image
of `benchmarks/parquet.py`'s data, in one process, page cache warm, CPU time (`time.process_time`) per 100
images, rounds alternated, medians over rounds.

    python benchmarks/parquet_decode.py /tmp/parquet-bench --rounds 7

Every image is read as training reads it (`loaders.read_row`: its bytes and its header). Rows:
- files: each JPEG through the file reader (an open, a read, a close): the baseline;
- parquet, lone reader: each row of the hub's files as they are (100-row groups, snappy,
  the image bytes dictionary-encoded as `datasets`/pyarrow write them): one `read_row_group` per group;
- parquet, node copies: the same with 2 readers on the node (LOCAL_WORLD_SIZE=2), so each group is also
  written to the node's folder and every image read back with a `pread` (what 2 loader processes pay);
- the same bytes rewritten PLAIN-encoded (no dictionary), then also uncompressed: what the encoding
  costs, which ddp cannot choose for files it reads as they are;
- the same bytes packed into shards (`layout = "shards"`, one `pread` per image), when `ROOT/shards` holds
  them: `ddp datasets pack files --to ROOT/shards --split train --registry ROOT/data.toml`.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import fsspec
import pyarrow.parquet as pq

from ddp_cli.data.fetch.parquet_reader import ParquetReader
from ddp_cli.data.fetch.row_groups import NodeGroups
from ddp_cli.data.pipeline.loaders import open_reader, read_row
from ddp_cli.data.sources.layouts import build_index


def rewritten(parquet: Path, out: Path, **options: object) -> Path:
    """`parquet`'s files written again with pyarrow `options`, the same 100-row groups."""
    for file in sorted(parquet.rglob("*.parquet")):
        target = out / file.relative_to(parquet)
        target.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(pq.read_table(file), target, row_group_size=100, **options)
    shutil.copy(parquet / "README.md", out / "README.md")
    return out


def rows_of(root: Path, layout: str, node: Path | None = None) -> Callable[[], int]:
    """A pass over the train images of `root` in index order (a Parquet root's row group by row group, a
    shards root's shard by shard), each read as training reads it (`read_row`: the bytes and the image
    header); `node`: a Parquet root's node copies there, written and read back."""
    fs = fsspec.filesystem("file")
    split = build_index(fs, str(root), layout, splits=("train",)).splits["train"]

    def run() -> int:
        if node is not None:
            shutil.rmtree(node, ignore_errors=True)
        reader = (ParquetReader(fs, str(root), 10, shared=NodeGroups(node, 8)) if node is not None
                  else open_reader(fs, str(root), split))
        return sum(len(read_row(reader, split, row).data) for row in range(len(split)))
    return run


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("root", type=Path, help="benchmarks/parquet.py's folder (jpegs/ and parquet/)")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    root = args.root.resolve()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        plain = rewritten(root / "parquet", work / "plain", use_dictionary=False)
        bare = rewritten(root / "parquet", work / "bare", use_dictionary=False, compression="none")
        rows = {"files": rows_of(root / "jpegs", "imagenet-loc"),
                "parquet, lone reader": rows_of(root / "parquet", "parquet"),
                "parquet, node copies": rows_of(root / "parquet", "parquet", work / "node"),
                "parquet PLAIN, lone reader": rows_of(plain, "parquet"),
                "parquet PLAIN uncompressed, lone reader": rows_of(bare, "parquet")}
        if (root / "shards" / "index.json").is_file():
            rows["shards (the files packed)"] = rows_of(root / "shards", "shards")
        os.environ["LOCAL_WORLD_SIZE"] = "2"  # `readers_on_node`: the node copies are written and read
        times: dict[str, list[float]] = {name: [] for name in rows}
        images = len(build_index(fsspec.filesystem("file"), str(root / "jpegs"), "imagenet-loc")
                     .splits["train"])
        for _ in range(args.rounds):
            for name, run in rows.items():
                start = time.process_time()
                run()
                times[name].append((time.process_time() - start) / images * 100 * 1000)
    base = statistics.median(times["files"])
    print(f"{images} images, {args.rounds} rounds; CPU ms per 100 images (median), ratio to files")
    for name, ms in times.items():
        print(f"{name:42s} {statistics.median(ms):7.2f} ms  {statistics.median(ms) / base:5.2f}x")


if __name__ == "__main__":
    main()
