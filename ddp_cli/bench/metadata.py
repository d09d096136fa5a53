"""ImageNet-sized `imagenet-loc` metadata (text files only, no images), for the index benchmarks.

LOC_synset_mapping.txt (1,000 classes), ILSVRC/ImageSets/CLS-LOC/train_cls.txt
(1,281,167 rows by default, the real count, names drawn as in the archive) and
LOC_val_solution.csv (50,000 rows, with 1-3 boxes each as in the archive).
`benchmarks/index_speed.py` and `ddp bench memory` both build their index from it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ddp_cli.data.sources.imagenet_loc import LOC_TRAIN_LIST

TRAIN_IMAGES, VAL_IMAGES, CLASSES = 1_281_167, 50_000, 1000


def write_metadata(root: Path, train_images: int = TRAIN_IMAGES) -> None:
    """Write the three files under `root`; the train rows are spread evenly over the classes."""
    rng = np.random.default_rng(0)
    synsets = [f"n{1440764 + 37 * c:08d}" for c in range(CLASSES)]
    root.mkdir(parents=True, exist_ok=True)
    (root / "LOC_synset_mapping.txt").write_text("".join(f"{s} class {c}, thing\n"
                                                         for c, s in enumerate(synsets)))
    per_class = np.full(CLASSES, train_images // CLASSES)
    per_class[: train_images % CLASSES] += 1
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
