"""Progressive resizing: FFCV's size rule, and the size reaching persistent loader processes."""

from __future__ import annotations

import tomllib

import fsspec
import pytest
from synthetic import make_imagenet_loc

from ddp_cli.config import DataConfig, RunConfig, config_from_dict
from ddp_cli.config.resolve import Facts, fixres_size, resolve
from ddp_cli.data.pipeline.loaders import build_loaders
from ddp_cli.data.sources.layouts import build_index
from ddp_cli.errors import ConfigError
from ddp_cli.models.families import takes_any_size


def test_ffcv_rule_for_resnet50_fast():
    """min 160 until the ramp starts, 192 from its end, the interpolation rounded to the step (FFCV's 32)."""
    cfg = DataConfig(image_size=192, min_image_size=160, ramp_epochs=[29, 34], ramp_step=32)
    sizes = [cfg.train_size(e) for e in range(40)]
    # interpolation at epoch 31 is 172.8 -> 160; at 32 it is 179.2 -> 192 (nearest multiple of 32)
    assert sizes == [160] * 32 + [192] * 8
    assert cfg.sizes(40) == {160, 192}


def test_off_and_edge_cases():
    assert {DataConfig(image_size=64).train_size(e) for e in range(5)} == {64}
    cfg = DataConfig(image_size=256, min_image_size=128, ramp_epochs=[2, 6], val_image_size=288, ramp_step=32)
    assert [cfg.train_size(e) for e in range(8)] == [128, 128, 128, 160, 192, 224, 256, 256]
    assert cfg.sizes(8) == {128, 160, 192, 224, 256, 288}
    step = DataConfig(image_size=96, min_image_size=48, ramp_epochs=[3, 3])
    assert [step.train_size(e) for e in range(5)] == [48, 48, 48, 96, 96]
    fine = DataConfig(image_size=64, min_image_size=32, ramp_epochs=[0, 4], ramp_step=8)
    assert [fine.train_size(e) for e in range(5)] == [32, 40, 48, 56, 64]
    with pytest.raises(ValueError, match=r"^data\.ramp_step is unset: train sizes need a resolved config "
                       r"\(config\.resolve\)$"):
        DataConfig(image_size=64, min_image_size=32, ramp_epochs=[0, 4]).train_size(1)


@pytest.mark.parametrize(("step", "error"), [(12, "expected a multiple of 8 px .* e.g. 16"), (4, "greater")])
def test_a_ramp_step_off_the_8_px_grid_is_refused(step, error):
    with pytest.raises(ValueError, match=error):
        DataConfig(ramp_step=step)


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
                     val_resize=28, batch_size=4, workers=1, hflip=False, ramp_step=16)
    loaders = build_loaders(cfg, fs, str(root), index, rank=0, world_size=1, seed=0, pin_memory=False)
    seen = []
    for epoch in range(4):
        loaders.train_sampler.set_epoch(epoch)
        seen.append({tuple(batch.images.shape[1:3]) for batch in loaders.train})
    assert seen == [{(16, 16)}, {(16, 16)}, {(32, 32)}, {(32, 32)}]
    assert {tuple(batch.images.shape[1:3]) for batch in loaders.val} == {(24, 24)}


def res(raw: dict) -> RunConfig:
    """`raw` validated and resolved as preflight resolves it (the model family from its name)."""
    cfg = config_from_dict(raw)
    return resolve(cfg, Facts(takes_any_size=takes_any_size(cfg.model.name)))


def sizes_of(raw: dict) -> list[int]:
    cfg = res(raw)
    return [cfg.data.train_size(e) for e in range(cfg.train.epochs)]


def test_on_by_default_from_half_the_size_over_10_to_60_percent_of_the_epochs_in_eighths_of_it():
    """The default recipe (issue 57's rule): from half the side to a multiple of 8 px, ramped in steps of
    an eighth of the side (to 8 px) from 10% of the run to 60% up to FixRes' size, the last 40% there,
    whatever the run's length: 64 px over 30 epochs reaches 56 at epoch 17 (it trained at 32 px for 21
    epochs in 32 px steps)."""
    cfg = res({"data": {"image_size": 112}, "train": {"epochs": 8}})
    data = cfg.data
    assert (data.progressive, data.min_image_size, data.ramp_epochs, data.ramp_step, data.end_image_size) == (
        True, 56, [0.8, 4.8], 16, 96)
    assert sizes_of({"data": {"image_size": 112}, "train": {"epochs": 8}}) == [56, 64, 64, 80] + [96] * 4
    at_64 = sizes_of({"data": {"image_size": 64}, "train": {"epochs": 30}})
    assert at_64.index(56) == 16 and at_64.count(32) == 6 and set(at_64) == {32, 40, 48, 56}
    assert at_64[18:] == [56] * 12  # the last 40% at the final size
    at_224 = sizes_of({"data": {"image_size": 224}, "train": {"epochs": 16}})
    assert at_224[::3] == [112, 128, 160, 192] + [200] * 2
    firsts = [res({"data": {"image_size": s}}).data.min_image_size for s in (64, 80, 96, 144)]
    assert firsts == [32, 40, 48, 72]
    assert [res({"data": {"image_size": s}}).data.ramp_step for s in (32, 64, 96, 112, 224, 384)] == [
        8, 8, 16, 16, 32, 48]  # 96 / 8 = 12: 1.5 eighths of 8 px round to even, 16
    assert sizes_of({"data": {"image_size": 112, "progressive": False}, "train": {"epochs": 8}}) == [112] * 8


@pytest.mark.parametrize(("scale", "val_resize", "start", "end"), [
    (0.25, 128, 56, 96),   # E[sqrt(s)] over [0.25, 1] = 2 (1 - 0.125) / (3 x 0.75) = 0.778; x 128 = 99.6
    (0.25, 73, 32, 56),    # 64 px's val resize: 56.8
    (0.08, 256, 112, 184),  # 2 (1 - 0.0226) / (3 x 0.92) = 0.708; x 256 = 181.3
    (1.0, 96, 56, 96),     # no random crop: validation's own resize (under image_size here)
    (0.25, 128, 104, 104),  # never under the first crop
])
def test_the_ramp_ends_where_objects_look_as_large_as_validation_shows_them(scale, val_resize, start, end):
    """FixRes' apparent object size, by hand: a crop of area scale s shows the side at sqrt(s), the val
    resize at val_resize / side; equal at E[sqrt(s)] x val_resize, to a multiple of 8."""
    data = DataConfig(image_size=112 if end != 184 else 224, min_crop_scale=scale)
    assert fixres_size(data, start, val_resize) == end


def test_an_end_given_turns_the_ramp_on_and_stays_and_a_bad_one_is_refused():
    """data.end_image_size named asks for the ramp (below 32 px too) and is kept; under the derived first
    crop it lowers that crop; outside [min_image_size, image_size], with progressive = false or under a
    semi-supervised method it is refused, naming the key."""
    assert sizes_of({"data": {"image_size": 112, "end_image_size": 104}, "train": {"epochs": 8}}) == (
        [56, 64, 64, 80, 96] + [104] * 3)
    assert sizes_of({"data": {"image_size": 28, "end_image_size": 24}, "train": {"epochs": 4}}) == [24] * 4
    low = res({"data": {"image_size": 112, "end_image_size": 48}, "train": {"epochs": 8}}).data
    assert (low.min_image_size, low.end_image_size) == (48, 48)
    for bad, error in [({"image_size": 64, "end_image_size": 72}, "end_image_size 72 is outside"),
                       ({"min_image_size": 64, "end_image_size": 56}, "end_image_size 56 is outside"),
                       ({"progressive": False, "end_image_size": 96}, "end_image_size is set while")]:
        with pytest.raises(ConfigError, match=error):
            config_from_dict({"data": bad})
    with pytest.raises(ConfigError, match="data.end_image_size: progressive resizing changes the labelled"):
        config_from_dict({"data": {"end_image_size": 96}, "semi": {"method": "fixmatch"}})


def test_a_small_image_starts_at_24_px_not_half_its_side():
    """The demo's 32 px digits from 24 px, not 16: from 16 they reached 0.8 at epoch 5 (validated at 32,
    twice what they trained on); from 24 as soon as at 32 px or sooner, on epochs ~0.7x as costly
    (recipes.md). 48 px, which 32 px steps never took past 32, ramps in 8 px steps now."""
    assert sizes_of({"data": {"image_size": 32}, "train": {"epochs": 8}}) == [24] * 3 + [32] * 5
    assert sizes_of({"data": {"image_size": 40}, "train": {"epochs": 8}}) == [24] * 3 + [32] * 5
    assert sizes_of({"data": {"image_size": 48}, "train": {"epochs": 8}}) == [24, 24, 32, 32] + [40] * 4


@pytest.mark.parametrize("raw", [
    {"data": {"image_size": 28}},                            # under 32 px: not measured
    {"model": {"name": "vit_b_16"}},                         # built for one size
    {"model": {"name": "timm/resnet18"}},                    # timm's and your own may be too
    {"model": {"name": "mine.py:build"}},
    {"semi": {"method": "fixmatch"}},                        # its unlabelled views keep one size
    {"data": {"image_size": 112, "ramp_epochs": [0.0, 0.0]}},  # a ramp over before it starts
])
def test_off_by_default_where_it_cannot_pay_or_cannot_run(raw):
    cfg = res({**raw, "train": {"epochs": 8}})
    assert not cfg.data.progressive and cfg.data.min_image_size is None
    assert set(sizes_of({**raw, "train": {"epochs": 8}})) == {cfg.data.image_size}


def test_a_first_crop_given_alone_ramps_over_the_default_epochs():
    """data.min_image_size without ramp_epochs asks for progressive resizing over the default ramp (it
    once left ramp_epochs at [0, 0], so the run trained at image_size throughout, silently); a ramp given
    with it stays, [0, 0] included."""
    assert sizes_of({"data": {"image_size": 112, "min_image_size": 64}, "train": {"epochs": 8}}) == (
        [64, 64, 80, 80] + [96] * 4)
    cfg = res({"data": {"image_size": 112, "min_image_size": 64}, "train": {"epochs": 8}})
    assert (cfg.data.progressive, cfg.data.ramp_epochs) == (True, [0.8, 4.8])
    longer = {"data": {"image_size": 112, "min_image_size": 64}, "train": {"epochs": 20}}
    assert res(longer).data.ramp_epochs == [2.0, 12.0]
    assert sizes_of({"data": {"image_size": 112, "min_image_size": 64, "ramp_epochs": [0, 0]}}) == [96] * 90


def test_asked_for_it_runs_below_32_px_too_and_off_it_refuses_a_first_size():
    asked = {"data": {"image_size": 28, "progressive": True}, "train": {"epochs": 4}}
    assert sizes_of(asked) == [24] * 4  # FixRes' end: 0.778 x 32 = 24.9
    named = {"data": {"image_size": 28, "progressive": True, "end_image_size": 28}, "train": {"epochs": 4}}
    assert sizes_of(named) == [24, 24, 24, 28]
    with pytest.raises(ConfigError, match="data: min_image_size is set while progressive = false"):
        config_from_dict({"data": {"progressive": False, "min_image_size": 160}})


def test_the_run_dirs_config_toml_holds_the_sizes_and_an_old_one_resumes_without_them():
    """config.toml says what the run does (the sizes written out, not left to a default that may change);
    one written before progressive resizing was a default (no data.progressive, its ramp_epochs [0, 0]
    written in full) resumes as it trained: every epoch at image_size."""
    cfg = res({"data": {"image_size": 112}, "train": {"epochs": 8}})
    written = tomllib.loads(cfg.to_toml())["data"]
    keys = ("progressive", "min_image_size", "ramp_epochs", "ramp_step", "end_image_size")
    assert [written[key] for key in keys] == [True, 56, [0.8, 4.8], 16, 96]
    assert config_from_dict(tomllib.loads(cfg.to_toml())) == cfg == res(tomllib.loads(cfg.to_toml()))
    old = tomllib.loads(cfg.to_toml())
    del old["data"]["progressive"], old["data"]["min_image_size"], old["data"]["end_image_size"]
    old["data"]["ramp_epochs"] = [0.0, 0.0]
    assert set(sizes_of(old)) == {112}
    # off by default is written out too: a 32 px run from before it was on there resumes at 32 px
    off = tomllib.loads(res({"data": {"image_size": 28}, "train": {"epochs": 8}}).to_toml())
    assert off["data"]["progressive"] is False
    off["data"]["image_size"] = 32
    assert set(sizes_of(off)) == {32}


def test_a_change_before_the_pass_derives_the_sizes_again_but_keeps_those_given():
    """A `--set` or a sweep's trial changes the validated config, and the resolve pass derives from what it
    says: the sizes follow a changed image_size or epochs (not the stale 160 px of a 224 px default, above
    a 112 px crop); given ones stay."""
    def changed(raw: dict, changes: dict):
        cfg = config_from_dict(raw).resolved(changes)
        return resolve(cfg, Facts(takes_any_size=takes_any_size(cfg.model.name)))

    cfg = changed({"train": {"epochs": 8}}, {"data.image_size": 112})
    assert (cfg.data.min_image_size, cfg.data.ramp_epochs, cfg.data.val_resize) == (56, [0.8, 4.8], 128)
    given = {"data": {"image_size": 112, "min_image_size": 64, "ramp_epochs": [1, 2], "val_resize": 112}}
    again = changed(given, {"train.epochs": 20})
    assert (again.data.min_image_size, again.data.ramp_epochs, again.data.val_resize) == (64, [1, 2], 112)
    small = changed({}, {"data.image_size": 32})
    assert (small.data.progressive, small.data.min_image_size) == (True, 24)
    tiny = changed({}, {"data.image_size": 24})
    assert not tiny.data.progressive and tiny.data.min_image_size is None
