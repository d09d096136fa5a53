"""A short CLI run's checkpoints/: keep_last step files, last.pt the end, best.pt the best val top-1.

The run (8 px demo, 4 epochs of 4 steps, a constant LR far too high) peaks early and
never beats it, so best.pt must be an early epoch, not the last.
"""

from __future__ import annotations

import json

import pytest
from conftest import last_json, run_ddp

from ddp_cli.train.checkpoint import CheckpointStore, load_checkpoint, read_manifest

pytestmark = pytest.mark.slow

SETS = ['train.precision="fp32"', "data.image_size=8", "data.val_resize=8", "train.epochs=4",
        "train.max_steps_per_epoch=4", "data.workers=0", "schedule.name=constant",
        "schedule.warmup_epochs=0", "optim.lr_per_256=2", "checkpoint.keep_last=2"]


def test_best_pt_is_the_best_epoch_and_keep_last_prunes(demo_registry, tmp_path):
    out = last_json(run_ddp("train", "configs/demo.toml", "--registry", str(demo_registry), "--run-dir",
                            str(tmp_path), "--json", *[a for s in SETS for a in ("--set", s)], timeout=240))
    vals = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    vals = [r for r in vals if r["split"] == "val"]
    assert [r["epoch"] for r in vals] == [1, 2, 3, 4]
    best = max(vals, key=lambda r: r["top1"])  # the first of equals: a tie is not an improvement
    assert best["step"] != vals[-1]["step"], "the run peaked at its end: best.pt would be last.pt anyway"
    folder = tmp_path / "checkpoints"
    assert read_manifest(folder / "best.pt")["step"] == best["step"]
    assert load_checkpoint(folder / "best.pt")["step"] == best["step"]
    assert out["best_top1"] == pytest.approx(best["top1"])
    assert load_checkpoint(folder / "last.pt")["step"] == vals[-1]["step"] == 16
    assert [p.name for p in CheckpointStore(folder, 2).steps()] == ["step-000000012.pt", "step-000000016.pt"]
