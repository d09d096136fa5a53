"""Demo runs (2 gloo workers): the accuracy the issues promise.

Four runs cover the requirements without stacking the deck: (1) the demo in
fp32 NCHW at the digits' native 8 px (its 8 epochs and schedule) with the modern
recipe's augmentation (TrivialAugment, MixUp, CutMix, random erasing),
with an EMA beside it (the EMA reads the weights, it never changes them),
reaches 0.95 and logs the LR of every step; (2) precision "bf16" (what
"auto" picks on a CPU with AVX-512 BF16), channels_last and the bf16 gradient
reduction together reach 0.95, so each of them does. Where bf16 is emulated
(~10x slower than fp32, e.g. AVX2-only CPUs) that run is the demo at its
native 8 px (the digits are 8x8 scans) for 4 epochs: the same data, model and
code path, 0.98 top-1 in ~30 s; (2b) where bf16 is native, the full demo as
shipped instead; (3) PowerSGD, compressing from step 17 of 176, reaches 0.93 (at 8 px,
where the gradient matrices it compresses are the same).
"""

from __future__ import annotations

import json
import tomllib

import pytest
from conftest import last_json, run_ddp

from ddp_cli.config import config_from_dict
from ddp_cli.train.checkpoint import load_checkpoint
from ddp_cli.train.precision import cpu_has_bf16
from ddp_cli.train.schedules import lr_factor

pytestmark = pytest.mark.slow

NATIVE_BF16 = cpu_has_bf16()  # the hardware's (what a forced bf16 run costs), not DDP_CPU_BF16's
BF16 = ('train.precision="bf16"', 'distributed.reduce="bf16"', "model.channels_last=true")
# The demo at the digits' native resolution, in-process loading: what bf16 costs where it is emulated.
SMALL = ("data.image_size=8", "data.val_resize=8", "train.epochs=4", "data.workers=0")


def train_demo(demo_registry, run_dir, *sets: str) -> dict:
    args = [a for s in sets for a in ("--set", s)]
    return last_json(run_ddp("train", "configs/demo.toml", "--registry", str(demo_registry),
                             "--run-dir", str(run_dir), "--json", *args, timeout=400))


def run_config(run_dir):
    return config_from_dict(tomllib.loads((run_dir / "config.toml").read_text()))


RECIPE = ('augment.policy="trivialaugment"', "augment.mixup_alpha=0.2", "augment.cutmix_alpha=1.0",
          "augment.random_erase=0.25")


def test_fp32_demo_with_a_modern_recipe_reaches_095_with_an_ema_and_every_steps_lr_logged(demo_registry,
                                                                                        tmp_path):
    """The demo's 8 epochs and schedule at 8 px with TrivialAugment, MixUp, CutMix and random erasing
    (~35 s; 0.97 top-1 measured; the shipped 32 px takes ~90 s without them on an AVX2 CPU)."""
    out = train_demo(demo_registry, tmp_path, "train.ema_decay=0.98", 'train.precision="fp32"',
                     "model.channels_last=false", *SMALL[:2], *RECIPE)
    assert out["precision"] == "fp32"
    assert out["final"]["images"] == 359
    assert out["final"]["top1"] >= 0.95
    assert out["final_ema"]["images"] == 359 and out["final_ema"]["top1"] >= 0.9
    assert load_checkpoint(tmp_path / "checkpoints/last.pt")["ema"]["updates"] > 0

    cfg = run_config(tmp_path)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert sum(r["split"] == "val_ema" for r in records) == cfg.train.epochs
    lrs = [lr for r in records if r["split"] == "train" for lr in r["lrs"]]
    total = max(r["step"] for r in records)
    steps_per_epoch = total // cfg.train.epochs
    assert len(lrs) == total == steps_per_epoch * cfg.train.epochs
    peak = cfg.optim.effective_lr(out["world_size"] * cfg.data.batch_size)
    factor = lr_factor(cfg.schedule, steps_per_epoch, total)
    assert lrs == pytest.approx([peak * factor(step) for step in range(total)], rel=1e-9, abs=1e-15)


def test_fp32_demo_decoded_and_augmented_by_the_ranks_learns_as_with_the_cpu_decode(demo_registry, tmp_path):
    """data.decode = "gpu" on the CPU stand-in (the rank decodes its batches with torchvision and replays
    TrivialAugment and erasing with v2's tensor kernels): the recipe of the fp32 test above, to its bar
    (0.95; one run each, same seed: 0.969 with the CPU decode, 0.967 with this, one val image apart)."""
    out = train_demo(demo_registry, tmp_path, 'data.decode="gpu"', 'train.precision="fp32"',
                     "model.channels_last=false", *SMALL[:2], *RECIPE)
    assert run_config(tmp_path).data.decode == "gpu"
    assert out["final"]["images"] == 359 and out["final"]["top1"] >= 0.95


def assert_bf16_run_learned(out: dict, run_dir) -> None:
    assert out["precision"] == "bf16" and out["world_size"] == 2
    cfg = run_config(run_dir)  # what the workers ran with, not what was asked
    assert (cfg.train.precision, cfg.distributed.reduce, cfg.model.channels_last) == ("bf16", "bf16", True)
    assert out["final"]["images"] == 359
    assert out["final"]["top1"] >= 0.95


@pytest.mark.skipif(NATIVE_BF16, reason="bf16 is native on this CPU: the full demo below runs the same path")
def test_bf16_autocast_channels_last_and_bf16_reduction_reach_095(demo_registry, tmp_path):
    """Where bf16 is emulated: the demo at 8 px, 4 epochs (0.98; ~30 s even with bf16 emulated)."""
    out = train_demo(demo_registry, tmp_path, *BF16, *SMALL)
    assert_bf16_run_learned(out, tmp_path)
    assert run_config(tmp_path).data.image_size == 8


@pytest.mark.skipif(not NATIVE_BF16, reason="bf16 is emulated on this CPU (no AVX-512 BF16/AMX): the full "
                    "8-epoch demo would take ~10 min; the 8 px bf16 test above covers the bf16 path here")
def test_bf16_full_demo_reaches_095_where_bf16_is_native(demo_registry, tmp_path):
    out = train_demo(demo_registry, tmp_path, *BF16)
    assert_bf16_run_learned(out, tmp_path)


def test_powersgd_reduction_reaches_093(demo_registry, tmp_path):
    """At 8 px for the demo's 8 epochs: the same 176 steps and gradient matrices (0.97 here, ~30 s)."""
    out = train_demo(demo_registry, tmp_path, 'distributed.reduce="powersgd"', *SMALL[:2], SMALL[3])
    assert out["final"]["images"] == 359
    assert out["final"]["top1"] >= 0.93
