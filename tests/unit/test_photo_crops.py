"""benchmarks/make_photo_crops.py: the natural-photo data set issue 41's recipe is measured on. ddp reads it
as it is written, its train and val crops come from disjoint parts of each photo, and a seed makes it again
byte for byte."""

from __future__ import annotations

import hashlib
import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

from ddp_cli.data.registry import load_registry

pytest.importorskip("skimage")
BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))  # as when run: it imports make_jpegs beside it
spec = importlib.util.spec_from_file_location("make_photo_crops", BENCHMARKS / "make_photo_crops.py")
photos = importlib.util.module_from_spec(spec)
spec.loader.exec_module(photos)


def digest(root: Path) -> str:
    return hashlib.sha256(b"".join(p.read_bytes() for p in sorted(root.rglob("*.JPEG")))).hexdigest()


def test_ten_photos_become_a_data_set_ddp_indexes_with_every_class_in_both_splits(tmp_path):
    from ddp_cli.data.sources.layouts import build_index

    registry = photos.make_dataset(tmp_path / "a", side=32, train_per_class=3, val_per_class=2, seed=1)
    entry = load_registry(registry).get("photos")
    fs, root = entry.open()
    index = build_index(fs, root, entry.layout)
    assert len(index.classes) == 10
    assert np.bincount(index.splits["train"].labels).tolist() == [3] * 10
    assert np.bincount(index.splits["val"].labels).tolist() == [2] * 10
    again = photos.make_dataset(tmp_path / "b", side=32, train_per_class=3, val_per_class=2, seed=1)
    assert digest(registry.parent) == digest(again.parent)
    other = photos.make_dataset(tmp_path / "c", side=32, train_per_class=3, val_per_class=2, seed=2)
    assert digest(registry.parent) != digest(other.parent)


def test_train_and_val_crops_come_from_disjoint_parts_of_the_photo():
    """A crop's whole footprint, rotation included, stays on its side of the split (the jitter dims white
    to at most 0.75 of itself, and keeps black black)."""
    from PIL import Image

    rng = np.random.default_rng(0)
    marked = np.zeros((300, 400, 3), np.uint8)
    marked[:, 280:] = 255  # the val side (x >= 0.7 of the width) white, the train side black
    img = Image.fromarray(marked)
    train = [np.asarray(photos.crop(rng, img, 0, 280, 16)) for _ in range(50)]
    val = [np.asarray(photos.crop(rng, img, 280, 400, 16)) for _ in range(50)]
    assert max(int(c.max()) for c in train) < 128 < min(int(c.min()) for c in val)
