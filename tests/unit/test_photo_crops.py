"""benchmarks/make_photo_crops.py: the natural-photo data set issue 41's recipe is measured on, and the grey
textures issue 57's is. ddp reads them as they are written, train and val crops come from disjoint parts of
each image, a seed makes them again byte for byte, and a texture is grey at its source's own scale."""

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
    train = [np.asarray(photos.crop(rng, img, 0, 280, 16, (30, 100))) for _ in range(50)]
    val = [np.asarray(photos.crop(rng, img, 280, 400, 16, (30, 100))) for _ in range(50)]
    assert max(int(c.max()) for c in train) < 128 < min(int(c.min()) for c in val)


def test_textures_are_grey_crops_of_the_sources_own_scale(tmp_path):
    """The textures set: its own name and classes, every crop grey (all three channels equal, up to
    JPEG's chroma noise) and cut from TEXTURE_SPAN source pixels, so a smaller training crop than the
    side loses detail the classes differ in."""
    from PIL import Image

    registry = photos.make_dataset(tmp_path / "t", side=64, train_per_class=2, val_per_class=1, seed=0,
                                   kind="textures")
    entry = load_registry(registry).get("textures")
    assert "grey texture crops" in entry.description
    names = (tmp_path / "t/LOC_synset_mapping.txt").read_text().split()[1::2]
    assert names == [name for name, _, _ in photos.TEXTURES]
    for path in sorted((tmp_path / "t").rglob("*.JPEG")):
        pixels = np.asarray(Image.open(path).convert("RGB"), dtype=np.int16)
        assert pixels.shape == (64, 64, 3)
        assert np.abs(pixels - pixels.mean(axis=2, keepdims=True)).max() <= 6
    # the span is in source pixels: across 32 px diagonal stripes, a 12 px crop meets one edge or none,
    # a 300 px one dozens
    stripes = np.indices((512, 512)).sum(axis=0) // 32 % 2 * 255
    board = Image.fromarray(stripes.astype(np.uint8)).convert("RGB")
    rng = np.random.default_rng(0)

    def edges(span: tuple[float, float]) -> int:
        grey = np.asarray(photos.crop(rng, board, 0, 512, 64, span).convert("L"), dtype=np.int16)
        return int((np.abs(np.diff(grey, axis=1)) > 60).sum())

    assert max(edges((12, 12)) for _ in range(5)) < 200 < min(edges((300, 300)) for _ in range(5))
