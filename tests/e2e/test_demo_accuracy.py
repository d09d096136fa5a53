"""Full demo runs (2 gloo workers, 8 epochs, 25-45 s each): the accuracy the issues promise.

Three runs cover the requirements without stacking the deck: (1) the demo in
fp32 NCHW, with an EMA beside it (the EMA reads the weights, it never changes
them), reaches 0.95 and logs the LR of every step; (2) the demo as shipped
with precision "bf16" (what "auto" picks on a CPU with AVX-512 BF16),
channels_last and the bf16 gradient reduction together reach 0.95, so each of
them does; (3) PowerSGD, compressing from step 17 of 176, reaches 0.93.
"""

from __future__ import annotations

import json
import tomllib

import pytest
from conftest import last_json, run_ddp

from ddp_cli.config import config_from_dict
from ddp_cli.train.checkpoint import load_checkpoint
from ddp_cli.train.schedules import lr_factor

pytestmark = pytest.mark.slow


def train_demo(demo_registry, run_dir, *sets: str) -> dict:
    args = [a for s in sets for a in ("--set", s)]
    return last_json(run_ddp("train", "configs/demo.toml", "--registry", str(demo_registry),
                             "--run-dir", str(run_dir), "--json", *args, timeout=400))


def test_fp32_demo_reaches_095_with_an_ema_and_every_steps_lr_logged(demo_registry, tmp_path):
    out = train_demo(demo_registry, tmp_path, "train.ema_decay=0.98", 'train.precision="fp32"',
                     "model.channels_last=false")
    assert out["precision"] == "fp32"
    assert out["final"]["images"] == 359
    assert out["final"]["top1"] >= 0.95
    assert out["final_ema"]["images"] == 359 and out["final_ema"]["top1"] >= 0.9
    assert load_checkpoint(tmp_path / "checkpoints/last.pt")["ema"]["updates"] > 0

    cfg = config_from_dict(tomllib.loads((tmp_path / "config.toml").read_text()))
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert sum(r["split"] == "val_ema" for r in records) == cfg.train.epochs
    lrs = [lr for r in records if r["split"] == "train" for lr in r["lrs"]]
    total = max(r["step"] for r in records)
    steps_per_epoch = total // cfg.train.epochs
    assert len(lrs) == total == steps_per_epoch * cfg.train.epochs
    peak = cfg.optim.effective_lr(out["world_size"] * cfg.data.batch_size)
    factor = lr_factor(cfg.schedule, steps_per_epoch, total)
    assert lrs == pytest.approx([peak * factor(step) for step in range(total)], rel=1e-9, abs=1e-15)


def test_bf16_autocast_channels_last_and_bf16_reduction_reach_095(demo_registry, tmp_path):
    out = train_demo(demo_registry, tmp_path, 'train.precision="bf16"', 'distributed.reduce="bf16"')
    assert out["precision"] == "bf16"
    assert out["final"]["images"] == 359
    assert out["final"]["top1"] >= 0.95


def test_powersgd_reduction_reaches_093(demo_registry, tmp_path):
    out = train_demo(demo_registry, tmp_path, 'distributed.reduce="powersgd"')
    assert out["final"]["images"] == 359
    assert out["final"]["top1"] >= 0.93
