"""ImageNet's oddities train; a bad file stops every rank (error) or is skipped and counted (skip)."""

from __future__ import annotations

import json
from pathlib import Path

import fsspec
import pytest
import torch
from conftest import REPO, last_json, run_ddp
from synthetic import make_imagenet_loc, plant, write_registry
from torch.utils.data import DataLoader

from ddp_cli.config import ModelConfig
from ddp_cli.data.pipeline.loaders import ImageDataset, collate
from ddp_cli.data.pipeline.transforms import ValTransform
from ddp_cli.data.sources.layouts import build_index
from ddp_cli.models import build_model
from ddp_cli.train.inference import evaluate

TRAIN = "ILSVRC/Data/CLS-LOC/train"
VAL = "ILSVRC/Data/CLS-LOC/val"
BAD_TRAIN = f"{TRAIN}/n00001001/n00001001_5.JPEG"
BAD_VAL = f"{VAL}/ILSVRC2012_val_00000003.JPEG"
CONFIG = """name = "bad"
[data]
dataset = "{dataset}"
image_size = 32
val_resize = 36
batch_size = 4
workers = {workers}
on_bad_image = "{policy}"
[model]
name = "resnet_tiny"
[schedule]
name = "constant"
[train]
epochs = {epochs}
[distributed]
nproc_per_node = 2
backend = "gloo"
"""


@pytest.fixture(scope="module")
def roots(tmp_path_factory) -> tuple[Path, Path]:
    """`quirks`: CMYK, grayscale and PNG-named-JPEG files; `truncated`: one cut JPEG in train.

    3 classes x 8 train images = 24 = 2 ranks x 3 steps x 4: every epoch reads every file.
    """
    base = tmp_path_factory.mktemp("bad")
    make_imagenet_loc(base / "quirks", classes=3, train_per_class=8, val=7)
    for path, kind in ((f"{TRAIN}/n00001000/n00001000_1.JPEG", "cmyk"),
                       (f"{TRAIN}/n00001001/n00001001_2.JPEG", "gray"),
                       (f"{TRAIN}/n00001002/n00001002_3.JPEG", "png"),
                       (f"{VAL}/ILSVRC2012_val_00000001.JPEG", "cmyk"),
                       (f"{VAL}/ILSVRC2012_val_00000005.JPEG", "png")):
        plant(base / "quirks", path, kind)
    make_imagenet_loc(base / "truncated", classes=3, train_per_class=8, val=7)
    plant(base / "truncated", BAD_TRAIN, "truncated", label=1)
    registry = write_registry(base, [{"name": n, "layout": "imagenet-loc",
                                      "storage": {"driver": "FileSystem", "path": n}}
                                     for n in ("quirks", "truncated")])
    return registry, base


def train(roots, tmp_path, dataset: str, policy: str, workers: int = 0, epochs: int = 1):
    registry, _ = roots
    config = tmp_path / "bad.toml"
    config.write_text(CONFIG.format(dataset=dataset, policy=policy, workers=workers, epochs=epochs))
    return run_ddp("train", str(config), "--registry", str(registry), "--run-dir", str(tmp_path / "run"),
                   "--json", cwd=REPO, timeout=150)


@pytest.mark.slow
def test_cmyk_grayscale_and_png_named_jpeg_train_without_error(roots, tmp_path):
    out = last_json(train(roots, tmp_path, "quirks", "error", workers=1))
    assert out["skipped_images"] == 0 and out["final"]["images"] == 7


@pytest.mark.slow
def test_truncated_jpeg_under_error_stops_every_rank_naming_the_file(roots, tmp_path):
    """One rank meets the file; the launcher stops the other at once (no collective timeout: 600 s)."""
    result = train(roots, tmp_path, "truncated", "error", workers=1)
    assert result.returncode == 3, result.stderr[-2000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, result.stderr
    assert f"bad image {roots[1] / 'truncated' / BAD_TRAIN}: truncated" in errors[0]
    assert 'on_bad_image = "skip"' in errors[0]
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "run" / "result.json").exists()


@pytest.mark.slow
def test_truncated_jpeg_under_skip_is_counted_once_over_epochs(roots, tmp_path):
    out = last_json(train(roots, tmp_path, "truncated", "skip", epochs=2))
    assert out["skipped_images"] == 1  # one distinct bad file, though met in both epochs
    assert out["final"]["images"] == 7
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["skipped_images"] for r in records if r["split"] == "val"] == [1, 1]  # per epoch


def test_validation_under_skip_excludes_bad_images_and_names_them(tmp_path):
    make_imagenet_loc(tmp_path, classes=3, train_per_class=1, val=7)
    plant(tmp_path, BAD_VAL, "truncated")
    fs = fsspec.filesystem("file")
    table = build_index(fs, str(tmp_path), "imagenet-loc").splits["val"]
    dataset = ImageDataset(fs, str(tmp_path), table, ValTransform(32, 36), "skip", 32)
    bad: set[str] = set()
    torch.manual_seed(0)
    model = build_model(ModelConfig(name="resnet_tiny"), 3, 32)
    loader = DataLoader(dataset, batch_size=3, collate_fn=collate)
    metrics = evaluate(model, loader, torch.device("cpu"), "fp32", False, bad).metrics
    assert metrics["images"] == 6  # 7 rows, the bad one's stand-in not counted
    assert bad == {f"{tmp_path}/{BAD_VAL}"}
