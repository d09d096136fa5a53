"""The embedded `demo` data set: the handwritten digits scikit-learn bundles, as ImageNet.

1,797 real 8x8 scans (10 classes) are upscaled to 32x32 RGB JPEGs and written in
the Kaggle ImageNet localization layout, so the demo exercises exactly the code
path real ImageNet takes, its traps included: `LOC_train_solution.csv` lists only
the images "with boxes" (every other one), so train labels must come from the
synset folders (or `train_cls.txt`), val labels from `LOC_val_solution.csv`.
Built once, offline, under a file lock; concurrent callers wait and reuse it. The digits ship
inside this package (`digits.csv.gz`, the very file scikit-learn bundles and `load_digits` reads:
the UCI "Optical Recognition of Handwritten Digits" test set, BSD-3 as scikit-learn distributes it),
so the core install builds the demo without scikit-learn.
"""

from __future__ import annotations

import fcntl
import gzip
import os
import shutil
from pathlib import Path

import numpy as np
from PIL import Image

SIDE = 32
VAL_IMAGES = 359  # prime: no world size divides it, so exact sharding is always exercised
NAMES = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
SYNSETS = tuple(f"n{9000000 + d:08d}" for d in range(10))
TRAIN_DIR = "ILSVRC/Data/CLS-LOC/train"
VAL_DIR = "ILSVRC/Data/CLS-LOC/val"
COMPLETE = ".complete"
DIGITS = Path(__file__).with_name("digits.csv.gz")  # 1,797 rows: 64 pixels (0-16), then the digit


def ensure_demo(root: Path) -> Path:
    """Build the demo under `root` unless a complete copy is already there."""
    root = Path(root)
    if (root / COMPLETE).exists():
        return root
    root.parent.mkdir(parents=True, exist_ok=True)
    with open(root.parent / f".{root.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (root / COMPLETE).exists():
            staging = root.parent / f".{root.name}.building-{os.getpid()}"
            shutil.rmtree(staging, ignore_errors=True)
            _write_demo(staging)
            shutil.rmtree(root, ignore_errors=True)
            os.replace(staging, root)
    return root


def load_digits() -> tuple[np.ndarray, np.ndarray]:
    """The 8x8 images (float, 0-16) and their digits, as `sklearn.datasets.load_digits` reads them."""
    with gzip.open(DIGITS, "rt") as f:
        data = np.loadtxt(f, delimiter=",")
    return data[:, :-1].reshape(-1, 8, 8), data[:, -1].astype(int)


def _write_demo(out: Path) -> None:
    images, target = load_digits()
    order = np.random.default_rng(0).permutation(len(target))
    val_ids, train_ids = order[:VAL_IMAGES], order[VAL_IMAGES:]
    (out / "ILSVRC/ImageSets/CLS-LOC").mkdir(parents=True)
    (out / VAL_DIR).mkdir(parents=True)
    for synset in SYNSETS:
        (out / TRAIN_DIR / synset).mkdir(parents=True)
    (out / "LOC_synset_mapping.txt").write_text(
        "".join(f"{s} digit {n}\n" for s, n in zip(SYNSETS, NAMES, strict=True))
    )
    box = f"1 1 {SIDE - 2} {SIDE - 2}"
    train_cls, boxes = [], ["ImageId,PredictionString"]
    for k, i in enumerate(sorted(train_ids)):
        synset = SYNSETS[target[i]]
        image_id = f"{synset}_{i}"
        _save(images[i], out / TRAIN_DIR / synset / f"{image_id}.JPEG")
        train_cls.append(f"{synset}/{image_id} {k + 1}")
        if k % 2 == 0:
            boxes.append(f"{image_id},{synset} {box}")
    val_rows = ["ImageId,PredictionString"]
    for k, i in enumerate(val_ids):
        image_id = f"ILSVRC2012_val_{k + 1:08d}"
        _save(images[i], out / VAL_DIR / f"{image_id}.JPEG")
        val_rows.append(f"{image_id},{SYNSETS[target[i]]} {box}")
    (out / "ILSVRC/ImageSets/CLS-LOC/train_cls.txt").write_text("\n".join(train_cls) + "\n")
    (out / "LOC_train_solution.csv").write_text("\n".join(boxes) + "\n")
    (out / "LOC_val_solution.csv").write_text("\n".join(val_rows) + "\n")
    (out / COMPLETE).write_text("sklearn-digits\n")


def _save(pixels: np.ndarray, path: Path) -> None:
    gray = Image.fromarray((pixels * (255 / 16)).astype(np.uint8), mode="L")
    gray.resize((SIDE, SIDE), Image.Resampling.BICUBIC).convert("RGB").save(path, quality=95)
