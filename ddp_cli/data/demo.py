"""The embedded `demo` data set: scikit-learn's bundled handwritten digits as ImageNet.

1,797 real 8x8 scans (10 classes) are upscaled to 32x32 RGB JPEGs and written in
the Kaggle ImageNet localization layout, so the demo exercises exactly the code
path real ImageNet takes, its traps included: `LOC_train_solution.csv` lists only
the images "with boxes" (every other one), so train labels must come from the
synset folders (or `train_cls.txt`), val labels from `LOC_val_solution.csv`.
Built once, offline, under a file lock; concurrent callers wait and reuse it.
"""

from __future__ import annotations

import fcntl
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


def _write_demo(out: Path) -> None:
    from sklearn.datasets import load_digits

    digits = load_digits()
    order = np.random.default_rng(0).permutation(len(digits.target))
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
        synset = SYNSETS[digits.target[i]]
        image_id = f"{synset}_{i}"
        _save(digits.images[i], out / TRAIN_DIR / synset / f"{image_id}.JPEG")
        train_cls.append(f"{synset}/{image_id} {k + 1}")
        if k % 2 == 0:
            boxes.append(f"{image_id},{synset} {box}")
    val_rows = ["ImageId,PredictionString"]
    for k, i in enumerate(val_ids):
        image_id = f"ILSVRC2012_val_{k + 1:08d}"
        _save(digits.images[i], out / VAL_DIR / f"{image_id}.JPEG")
        val_rows.append(f"{image_id},{SYNSETS[digits.target[i]]} {box}")
    (out / "ILSVRC/ImageSets/CLS-LOC/train_cls.txt").write_text("\n".join(train_cls) + "\n")
    (out / "LOC_train_solution.csv").write_text("\n".join(boxes) + "\n")
    (out / "LOC_val_solution.csv").write_text("\n".join(val_rows) + "\n")
    (out / COMPLETE).write_text("sklearn-digits\n")


def _save(pixels: np.ndarray, path: Path) -> None:
    gray = Image.fromarray((pixels * (255 / 16)).astype(np.uint8), mode="L")
    gray.resize((SIDE, SIDE), Image.Resampling.BICUBIC).convert("RGB").save(path, quality=95)
