"""A short CLI run's checkpoints/: keep_last step files, last.pt the end, best.pt the best val top-1
(of the trained weights, or with `checkpoint.best_metric = "ema_top1"` of their EMA).

The run (8 px demo, 4 epochs of 4 steps, a constant LR far too high) peaks early and
never beats it, so best.pt must be an early epoch, not the last; its EMA peaks elsewhere.
"""

from __future__ import annotations

import json
import os
import stat

import pytest
from conftest import last_json, run_ddp

from ddp_cli.train.checkpoint import CheckpointStore, load_checkpoint, read_manifest

pytestmark = pytest.mark.slow

SHORT = ['train.precision="fp32"', "data.image_size=8", "data.val_resize=8", "train.epochs=4",
         "train.max_steps_per_epoch=4", "data.workers=0", "checkpoint.keep_last=2"]
TOO_HIGH = ["schedule.name=constant", "schedule.warmup_epochs=0", "optim.lr_per_256=2"]


def test_best_pt_is_the_best_epoch_and_keep_last_prunes(demo_registry, tmp_path):
    out, vals, _ = train(demo_registry, tmp_path, *TOO_HIGH, 'checkpoint.best_metric="top1"')  # not the EMA's
    best = max(vals, key=lambda r: r["top1"])  # the first of equals: a tie is not an improvement
    assert best["step"] != vals[-1]["step"], "the run peaked at its end: best.pt would be last.pt anyway"
    folder = tmp_path / "checkpoints"
    assert read_manifest(folder / "best.pt")["step"] == best["step"]
    assert load_checkpoint(folder / "best.pt")["step"] == best["step"]
    assert out["best_top1"] == pytest.approx(best["top1"])
    assert load_checkpoint(folder / "last.pt")["step"] == vals[-1]["step"] == 16
    assert [p.name for p in CheckpointStore(folder, 2).steps()] == ["step-000000012.pt", "step-000000016.pt"]


def test_best_pt_can_track_the_ema(demo_registry, tmp_path):
    """The demo's own schedule: the live weights peak in the last epoch, their EMA (0.8) in the second."""
    out, vals, emas = train(demo_registry, tmp_path, "train.ema_decay=0.8", "checkpoint.best_metric=ema_top1")
    best = max(emas, key=lambda r: r["top1"])
    live_best = max(vals, key=lambda r: r["top1"])
    assert best["step"] != live_best["step"], "EMA and live weights peak together: the test cannot tell"
    manifest = read_manifest(tmp_path / "checkpoints" / "best.pt")
    assert manifest["step"] == best["step"] and manifest["top1"] == pytest.approx(best["top1"])
    assert out["best_top1"] == pytest.approx(best["top1"])


def train(registry, run_dir, *more: str) -> tuple[dict, list[dict], list[dict]]:
    """`train --json` and the run's val and val_ema records."""
    out = last_json(run_ddp("train", "configs/demo.toml", "--registry", str(registry), "--run-dir",
                            str(run_dir), "--json", *[a for s in (*SHORT, *more) for a in ("--set", s)],
                            timeout=240))
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    vals = [r for r in records if r["split"] == "val"]
    assert [r["epoch"] for r in vals] == [1, 2, 3, 4]
    return out, vals, [r for r in records if r["split"] == "val_ema"]


def test_a_runs_files_have_the_mode_the_umask_gives(demo_registry, tmp_path):
    """Under umask 0027 every file of the run dir (config.toml, result.json, the checkpoints and their
    manifests, the metrics) is 0640: the group (a team, a serving process) reads them, others do not."""
    old = os.umask(0o027)  # the run inherits it
    try:
        result = run_ddp("train", "configs/demo.toml", "--registry", str(demo_registry), "--run-dir",
                         str(tmp_path / "run"), "--json", "--set", "train.epochs=1",
                         "--set", "train.max_steps_per_epoch=2", "--set", "data.workers=0")
    finally:
        os.umask(old)
    assert result.returncode == 0, result.stderr[-3000:]
    files = [p for p in (tmp_path / "run").rglob("*") if p.is_file()]
    assert {"config.toml", "result.json", "last.pt", "best.pt"} <= {p.name for p in files}
    modes = {str(p.relative_to(tmp_path)): f"{stat.S_IMODE(p.stat().st_mode):04o}" for p in files}
    assert set(modes.values()) == {"0640"}, modes
