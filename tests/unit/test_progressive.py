"""Progressive resizing: FFCV's size rule, and the size reaching persistent loader processes."""

from __future__ import annotations

import fsspec
import pytest
from synthetic import make_imagenet_loc

from ddp_cli.config import DataConfig
from ddp_cli.data.pipeline.loaders import build_loaders
from ddp_cli.data.sources.layouts import build_index


def test_ffcv_rule_for_resnet50_fast():
    """min 160 until the ramp starts, 192 from its end, the interpolation rounded to 32 between."""
    cfg = DataConfig(image_size=192, min_image_size=160, ramp_epochs=[29, 34])
    sizes = [cfg.train_size(e) for e in range(40)]
    # interpolation at epoch 31 is 172.8 -> 160; at 32 it is 179.2 -> 192 (nearest multiple of 32)
    assert sizes == [160] * 32 + [192] * 8
    assert cfg.sizes(40) == {160, 192}


def test_off_and_edge_cases():
    assert {DataConfig(image_size=64).train_size(e) for e in range(5)} == {64}
    cfg = DataConfig(image_size=256, min_image_size=128, ramp_epochs=[2, 6], val_image_size=288)
    assert [cfg.train_size(e) for e in range(8)] == [128, 128, 128, 160, 192, 224, 256, 256]
    assert cfg.sizes(8) == {128, 160, 192, 224, 256, 288}
    step = DataConfig(image_size=96, min_image_size=48, ramp_epochs=[3, 3])
    assert [step.train_size(e) for e in range(5)] == [48, 48, 48, 96, 96]


@pytest.mark.parametrize("bad", [{"min_image_size": 300}, {"ramp_epochs": [5, 2]}, {"ramp_epochs": [1]}])
def test_bad_ramps_are_refused(bad):
    with pytest.raises(ValueError):
        DataConfig(**bad)


@pytest.mark.processes
def test_persistent_loader_processes_crop_at_each_epochs_size(tmp_path):
    """The sampler sends the size with each index, so the loader process (alive across epochs) obeys."""
    root = tmp_path / "data"
    make_imagenet_loc(root, classes=2, train_per_class=6, val=3, size=40)
    fs = fsspec.filesystem("file")
    index = build_index(fs, str(root), "imagenet-loc")
    cfg = DataConfig(image_size=32, min_image_size=16, ramp_epochs=[1, 2], val_image_size=24,
                     val_resize=28, batch_size=4, workers=1, hflip=False)
    loaders = build_loaders(cfg, fs, str(root), index, rank=0, world_size=1, seed=0, pin_memory=False)
    seen = []
    for epoch in range(4):
        loaders.train_sampler.set_epoch(epoch)
        seen.append({tuple(batch.images.shape[1:3]) for batch in loaders.train})
    assert seen == [{(16, 16)}, {(16, 16)}, {(32, 32)}, {(32, 32)}]
    assert {tuple(batch.images.shape[1:3]) for batch in loaders.val} == {(24, 24)}
