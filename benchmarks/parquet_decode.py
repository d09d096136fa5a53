"""Where a Parquet image costs CPU against a file (BENCHMARKS.md, "Parquet"): the bytes of every train image
of `benchmarks/parquet.py`'s data, in one process, page cache warm, CPU time (`time.process_time`) per 100
images, rounds alternated, medians over rounds.

    python benchmarks/parquet_decode.py /tmp/parquet-bench --rounds 7

Rows (all through ddp's readers, only the last two rewrite the files):
- files: `FileReader.read` of each JPEG (an open, a read, a close): the baseline;
- parquet, lone reader: `ParquetReader.read` of each row as the hub's files are (100-row groups, snappy,
  the image bytes dictionary-encoded as `datasets`/pyarrow write them): one `read_row_group` per group;
- parquet, node copies: the same with 2 readers on the node (LOCAL_WORLD_SIZE=2), so each group is also
  written to the node's folder and every image read back with a `pread` (what 2 loader processes pay);
- the same bytes rewritten PLAIN-encoded (no dictionary), then also uncompressed: what the encoding
  costs, which ddp cannot choose for files it reads as they are.
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
from ddp_cli.data.fetch.storage import FileReader
from ddp_cli.data.sources.layouts import build_index


def rewritten(parquet: Path, out: Path, **options: object) -> Path:
    """`parquet`'s files written again with pyarrow `options`, the same 100-row groups."""
    for file in sorted(parquet.rglob("*.parquet")):
        target = out / file.relative_to(parquet)
        target.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(pq.read_table(file), target, row_group_size=100, **options)
    shutil.copy(parquet / "README.md", out / "README.md")
    return out


def parquet_rows(root: Path, node: Path | None) -> Callable[[], int]:
    """A pass over the train rows of the Parquet root, group by group (as a window reads them)."""
    fs = fsspec.filesystem("file")
    split = build_index(fs, str(root), "parquet").splits["train"]

    def run() -> int:
        shutil.rmtree(node, ignore_errors=True) if node else None
        shared = NodeGroups(node, 8) if node else None
        reader = ParquetReader(fs, str(root), 10, shared=shared)
        return sum(len(reader.read(p, m)) for p, m in zip(split.paths, split.members, strict=True))
    return run


def file_rows(root: Path) -> Callable[[], int]:
    fs = fsspec.filesystem("file")
    split = build_index(fs, str(root), "imagenet-loc").splits["train"]
    reader = FileReader(fs, str(root))
    return lambda: sum(len(reader.read(p)) for p in split.paths)


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
        rows = {"files": file_rows(root / "jpegs"),
                "parquet, lone reader": parquet_rows(root / "parquet", None),
                "parquet, node copies": parquet_rows(root / "parquet", work / "node"),
                "parquet PLAIN, lone reader": parquet_rows(plain, None),
                "parquet PLAIN uncompressed, lone reader": parquet_rows(bare, None)}
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
