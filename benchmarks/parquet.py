"""The Parquet benchmark of BENCHMARKS.md ("Parquet"): the same images as files and as Hugging Face-style
Parquet, read by the training pipeline, in one `ddp bench data` run.

    python benchmarks/parquet.py /tmp/parquet-bench --workers 2 --seconds 120 --rounds 6

It writes the images (benchmarks/make_jpegs.py: 300-500 px, photo-like, ~90 KB) unless they are there,
copies them byte for byte into Parquet as the hub ships a data set (`data/train-0000i-of-0000n.parquet`,
an image struct of bytes and path, an int label, 100-row groups as `datasets` writes image data sets,
class names in README.md), writes a data.toml with both and runs
`ddp bench data files parquet --json`: the Parquet row's ratio is over the files row of the same run.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
import tomli_w

from ddp_cli.data.sources.layouts import build_index

ROWS_PER_FILE, ROW_GROUP = 500, 100


def to_parquet(files: Path, out: Path) -> None:
    """Every train and val image of the `imagenet-loc` root `files`, its bytes as they are, as hub Parquet."""
    index = build_index(fsspec.filesystem("file"), str(files), "imagenet-loc")
    image = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    (out / "data").mkdir(parents=True, exist_ok=True)
    for name, split in (("train", index.splits["train"]), ("validation", index.splits["val"])):
        count = -(-len(split) // ROWS_PER_FILE)
        for f in range(count):
            rows = range(f * ROWS_PER_FILE, min(len(split), (f + 1) * ROWS_PER_FILE))
            images = [{"bytes": (files / split.paths[r]).read_bytes(),
                       "path": split.paths[r].rsplit("/", 1)[1]} for r in rows]
            table = pa.table({"image": pa.array(images, image),
                              "label": pa.array([int(split.labels[r]) for r in rows], pa.int64())})
            pq.write_table(table, out / "data" / f"{name}-{f:05d}-of-{count:05d}.parquet",
                           row_group_size=ROW_GROUP)
    names = "".join(f"          '{i}': {c}\n" for i, c in enumerate(index.classes))
    (out / "README.md").write_text("---\ndataset_info:\n  features:\n  - name: image\n    dtype: image\n"
                                   "  - name: label\n    dtype:\n      class_label:\n        names:\n"
                                   f"{names}---\n")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("root", type=Path)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=120)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--per-class", type=int, default=120)
    args = parser.parse_args()
    root = args.root.resolve()
    files, parquet = root / "jpegs", root / "parquet"
    if not files.exists():
        subprocess.run([sys.executable, str(Path(__file__).with_name("make_jpegs.py")), str(files),
                        "--classes", "10", "--per-class", str(args.per_class), "--val", "20"], check=True)
    if not parquet.exists():
        to_parquet(files, parquet)
    registry = root / "data.toml"
    registry.write_text(tomli_w.dumps({"data_config_version": 1, "datasets": [
        {"name": name, "layout": layout, "storage": {"driver": "FileSystem", "path": str(path)}}
        for name, layout, path in (("files", "imagenet-loc", files), ("parquet", "parquet", parquet))]}))
    out = subprocess.run([sys.executable, "-m", "ddp_cli", "bench", "data", "files", "parquet", "--registry",
                          str(registry), "--workers", str(args.workers), "--seconds", str(args.seconds),
                          "--rounds", str(args.rounds), "--json"], check=True, capture_output=True, text=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    print(json.dumps(result, indent=1))
    row = next(r for r in result["rows"] if r["dataset"] == "parquet")
    print(f"parquet / files: {row['ratio']:.3f} (median of rounds {row['median_ratio']:.3f}; target >= 1.0)")


if __name__ == "__main__":
    main()
