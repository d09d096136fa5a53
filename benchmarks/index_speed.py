"""Time `build_index` on metadata of real ImageNet size (text files only, no images).

    python benchmarks/index_speed.py [--folder DIR] [--repeat 3]

Writes LOC_synset_mapping.txt (1,000 classes), ILSVRC/ImageSets/CLS-LOC/train_cls.txt
(1,281,167 rows, the real count) and LOC_val_solution.csv (50,000 rows, with
several boxes per row as in the archive), then times the index build (all
classes, and a 100-class subset) and the run-dir hand-off (`IndexTable.save`
in the launcher, `IndexTable.load` in every rank).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import fsspec
import numpy as np

from ddp_cli.data.layouts import LOC_TRAIN_LIST, IndexTable, build_index

TRAIN_IMAGES, VAL_IMAGES, CLASSES = 1_281_167, 50_000, 1000


def write_metadata(root: Path) -> None:
    rng = np.random.default_rng(0)
    synsets = [f"n{1440764 + 37 * c:08d}" for c in range(CLASSES)]
    (root / "LOC_synset_mapping.txt").write_text("".join(f"{s} class {c}, thing\n"
                                                         for c, s in enumerate(synsets)))
    per_class = np.full(CLASSES, TRAIN_IMAGES // CLASSES)
    per_class[: TRAIN_IMAGES % CLASSES] += 1
    lines = []
    for synset, count in zip(synsets, per_class, strict=True):
        ids = rng.choice(60000, size=count, replace=False)
        lines.extend(f"{synset}/{synset}_{i}" for i in ids)
    listing = root / LOC_TRAIN_LIST
    listing.parent.mkdir(parents=True, exist_ok=True)
    listing.write_text("".join(f"{line} {k + 1}\n" for k, line in enumerate(lines)))
    labels = rng.integers(0, CLASSES, VAL_IMAGES)
    rows = ["ImageId,PredictionString"]
    for i, label in enumerate(labels):
        box = f"{synsets[label]} 10 20 200 300 "
        rows.append(f"ILSVRC2012_val_{i + 1:08d},{box * int(rng.integers(1, 4))}")
    (root / "LOC_val_solution.csv").write_text("\n".join(rows) + "\n")


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
