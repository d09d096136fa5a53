"""End to end: `ddp train` and `ddp validate` as a user runs them, in subprocesses."""

from __future__ import annotations

import json
import shutil
import sys
import tomllib

import pytest
import torch
from conftest import REPO, last_json, run_ddp

from ddp_cli.config import config_from_dict, load_config
from ddp_cli.config.resolve import Facts, resolve
from ddp_cli.train.precision import native_precision

FAST = ["--set", "train.epochs=2", "--set", "train.max_steps_per_epoch=6", "--set", "data.workers=0"]


# c10d's C++ log lines name their rank (`[rank1]:...`) and are written below Python, on the fd
RANK_MARKED = {"TORCH_CPP_LOG_LEVEL": "INFO"}


@pytest.fixture(scope="module")
def trained(demo_registry, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("run") / "demo"
    result = run_ddp("train", "configs/demo.toml", "--registry", str(demo_registry),
                     "--run-dir", str(run_dir), "--json", *FAST, env=RANK_MARKED)
    return last_json(result), run_dir, result.stderr


def test_train_json_and_run_directory(trained):
    out, run_dir, _ = trained
    for key in ("run_dir", "world_size", "epochs", "final", "best_top1", "checkpoint",
                "images_per_second", "skipped_images", "restarts", "startup_seconds", "data_workers"):
        assert key in out, key
    assert out["world_size"] == 2 and out["epochs"] == 2 and out["restarts"] == 0
    assert out["final"]["images"] == 359
    assert 0 <= out["final"]["top1"] <= out["final"]["top5"] <= 1
    assert out["images_per_second"] > 0
    resolved = config_from_dict(tomllib.loads((run_dir / "config.toml").read_text()))
    given = load_config(REPO / "configs/demo.toml", ["train.epochs=2", "train.max_steps_per_epoch=6",
                                                     "data.workers=0"])
    # the resolve pass's facts on these CPU workers: 2 of them, 6 steps an epoch
    expected = resolve(given, Facts("cpu", native_precision(torch.device("cpu")), 2, 6))
    assert resolved == expected
    assert (resolved.train.ema_decay, resolved.train.ema_bn_epochs, resolved.data.decode) == (0.99, 2, "cpu")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    val = [r for r in records if r["split"] == "val"]
    assert [r["epoch"] for r in val] == [1, 2]
    assert all({"epoch", "step", "split", "loss", "lr", "images_per_second", "time"} <= r.keys()
               for r in records if r["split"] != "startup")
    startup = [r for r in records if r["split"] == "startup"]
    assert len(startup) == 1 and startup[0]["step"] == 1 and startup[0]["startup_seconds"] == \
        out["startup_seconds"]
    phases = out["startup_seconds"]
    assert {"imports", "index", "hand_off", "launch", "worker_imports", "process_group", "model", "loaders",
            "ddp", "first_batch", "first_step", "total"} <= phases.keys()
    assert all(seconds >= 0 for seconds in phases.values())
    assert phases["total"] == pytest.approx(sum(v for k, v in phases.items() if k != "total"), abs=0.02)
    assert out["data_workers"] == {"workers": 0, "prefetch_factor": 2, "rule": "data.workers as set"}
    assert {"top1", "top5"} <= val[-1].keys()
    assert (run_dir / "checkpoints/last.pt").is_file() and (run_dir / "checkpoints/best.pt").is_file()
    assert not list((run_dir / "checkpoints").glob("*.tmp"))


def test_each_rank_logs_to_a_file_of_its_own_and_the_console_still_shows_it(trained):
    """Forked workers' stdout/stderr teed to logs/rank<N>.*: each file holds its rank's lines only."""
    _, run_dir, console = trained
    logs = run_dir / "logs"
    assert sorted(p.name for p in logs.iterdir()) == ["rank0.stderr.log", "rank0.stdout.log",
                                                      "rank1.stderr.log", "rank1.stdout.log"]
    for rank in (0, 1):
        lines = (logs / f"rank{rank}.stderr.log").read_text().splitlines()
        assert any(line.startswith(f"[rank{rank}]:") for line in lines)
        assert not any(line.startswith(f"[rank{1 - rank}]:") for line in lines)
        assert all(line in console.splitlines() for line in lines)  # teed, not redirected: unprefixed


@pytest.mark.parametrize("workers", [1, 2, 3])
def test_validate_matches_training_with_any_world_size(trained, workers):
    out, run_dir, _ = trained
    result = last_json(run_ddp("validate", "--checkpoint", str(run_dir / "checkpoints/last.pt"),
                               "--nproc-per-node", str(workers), "--json"))
    assert result["images"] == 359
    # --weights auto on a run with the default EMA: the weights best.pt is judged by, the EMA's
    assert result["weights"] == "ema"
    assert result["top1"] == out["final_ema"]["top1"]
    assert result["top5"] == out["final_ema"]["top5"]
    assert result["loss"] == pytest.approx(out["final_ema"]["loss"], rel=1e-4)
    assert {"checkpoint", "dataset", "split"} <= result.keys() and result["dataset"] == "demo"


def test_external_torchrun_does_not_launch_twice(demo_registry, tmp_path):
    import subprocess

    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "ddp_cli",
           "train", "configs/demo.toml", "--registry", str(demo_registry), "--run-dir", str(run_dir),
           "--json", "--set", "train.epochs=1", "--set", "train.max_steps_per_epoch=3",
           "--set", "data.workers=0"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=240)
    out = last_json(proc)
    assert out["world_size"] == 2 and out["run_dir"] == str(run_dir.resolve())
    assert {"process_group", "index", "hand_off", "first_step"} <= out["startup_seconds"].keys()
    assert sum(line.startswith("{") for line in proc.stdout.splitlines()) == 1  # rank 0 alone prints



def test_a_finished_run_trains_nothing_keeps_its_result_and_its_dry_run_names_the_resume(
        trained, demo_registry, tmp_path):
    """Re-run as it was, or given fewer epochs than it trained: exit 0, a line saying so, result.json
    left byte for byte; `--dry-run` of an extension names the checkpoint, the changed keys and the LR
    from the step it goes on at, not step 0."""
    _, original, _ = trained
    run_dir = tmp_path / "demo"
    shutil.copytree(original, run_dir)
    before = (run_dir / "result.json").read_bytes()
    common = ["configs/demo.toml", "--registry", str(demo_registry), "--run-dir", str(run_dir), "--json",
              *FAST[2:]]
    for epochs in (2, 1):
        again = run_ddp("train", *common, "--set", f"train.epochs={epochs}")
        assert again.returncode == 0, again.stderr
        assert "has trained 2 epochs" in again.stderr and "nothing to train" in again.stderr
        assert (run_dir / "result.json").read_bytes() == before
        assert last_json(again)["images_per_second"] == json.loads(before)["images_per_second"] > 0
    plan = last_json(run_ddp("train", *common, "--set", "train.epochs=3", "--dry-run"))
    resumes = plan["resumes"]
    assert resumes["checkpoint"].endswith("step-000000012.pt") and resumes["step"] == 12
    assert resumes["changes"]["train.epochs"] == [2, 3] and not resumes["finished"]
    assert next(iter(plan["lr_schedule"])) == "step 12 (next, resumed)"
    assert plan["lr_schedule"]["step 12 (next, resumed)"] == pytest.approx(resumes["lr_next_step"][1])
