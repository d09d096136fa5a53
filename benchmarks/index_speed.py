"""Time `build_index` on metadata of real ImageNet size (text files only, no images).

    python benchmarks/index_speed.py [--folder DIR] [--repeat 3]

Writes LOC_synset_mapping.txt (1,000 classes), ILSVRC/ImageSets/CLS-LOC/train_cls.txt
(1,281,167 rows, the real count) and LOC_val_solution.csv (50,000 rows, with
several boxes per row as in the archive) with `ddp_cli.bench.metadata`, then
times the index build (all classes, and a 100-class subset) and the run-dir hand-off (`IndexTable.save`
in the launcher, `IndexTable.load` in every rank).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import fsspec

from ddp_cli.bench.metadata import write_metadata
from ddp_cli.data.sources.layouts import build_index
from ddp_cli.data.sources.table import IndexTable


def timed(fn) -> tuple[float, object]:
    started = time.perf_counter()
    out = fn()
    return time.perf_counter() - started, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--folder", type=Path, help="where to write the metadata (default: a temp dir)")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = args.folder or Path(tmp)
        seconds, _ = timed(lambda: write_metadata(root))
        print(f"wrote metadata in {seconds:.1f} s under {root}")
        fs = fsspec.filesystem("file")
        for label, classes in (("all 1000 classes", None), ("first 100 classes", 100)):
            runs = [timed(lambda c=classes: build_index(fs, str(root), "imagenet-loc", c))
                    for _ in range(args.repeat)]
            index = runs[-1][1]
            sizes = {s: len(f) for s, f in index.splits.items()}
            print(f"build_index, {label}: {', '.join(f'{t:.2f}' for t, _ in runs)} s  {sizes}")
        save = [timed(lambda: index.save(root / "index"))[0] for _ in range(args.repeat)]
        load = [timed(lambda: IndexTable.load(root / "index"))[0] for _ in range(args.repeat)]
        print(f"IndexTable.save (100 classes): {', '.join(f'{t:.2f}' for t in save)} s")
        print(f"IndexTable.load (100 classes): {', '.join(f'{t:.2f}' for t in load)} s")
        full = build_index(fs, str(root), "imagenet-loc")
        save = [timed(lambda: full.save(root / "index-full"))[0] for _ in range(args.repeat)]
        load = [timed(lambda: IndexTable.load(root / "index-full"))[0] for _ in range(args.repeat)]
        print(f"IndexTable.save (all): {', '.join(f'{t:.2f}' for t in save)} s")
        print(f"IndexTable.load (all): {', '.join(f'{t:.2f}' for t in load)} s")


if __name__ == "__main__":
    main()
