"""What people and scripts see: JSON on stdout, plain logs without a TTY, sinks, report, exit codes."""

from __future__ import annotations

import json
import os
import signal

import pytest
from conftest import LiveRun, last_json, run_ddp
from typer.testing import CliRunner

from ddp_cli.cli import app
from ddp_cli.observe.report import figure
from ddp_cli.observe.sinks import read_metrics

FAST = ["--set", "train.epochs=2", "--set", "train.max_steps_per_epoch=4", "--set", "data.workers=0",
        "--set", "logging.every_steps=2"]


@pytest.fixture(scope="module")
def run(demo_registry, tmp_path_factory):
    """One short demo run with every sink on, its stdout and stderr (no TTY here)."""
    run_dir = tmp_path_factory.mktemp("obs") / "run"
    result = run_ddp("train", "configs/demo.toml", "--registry", str(demo_registry), "--run-dir",
                     str(run_dir), "--json", *FAST, "--set", "logging.tensorboard=true",
                     "--set", 'logging.wandb={project="ddp-test", mode="offline"}',
                     env={"WANDB_SILENT": "true"})
    return result, last_json(result), run_dir


def test_json_is_the_only_line_on_stdout(run):
    result, out, _ = run
    assert result.stdout.count("\n") == 1 and out["final"]["images"] == 359


def test_json_mode_has_no_progress_and_no_colour(run):
    result, _, _ = run
    assert "\x1b[" not in result.stderr
    assert "step 2/4" not in result.stderr  # --json implies quiet


def test_plain_log_lines_when_not_a_terminal(demo_registry, tmp_path):
    result = run_ddp("train", "configs/demo.toml", "--registry", str(demo_registry), "--run-dir",
                     str(tmp_path / "run"), *FAST, "--set", "train.epochs=1")
    assert result.returncode == 0, result.stderr
    assert "\x1b[" not in result.stderr
    assert "epoch 1/1 step 2/4" in result.stderr and "epoch 1 done:" in result.stderr
    assert "run:" in result.stdout and "checkpoint:" in result.stdout


def test_metrics_jsonl_and_csv_agree(run):
    _, _, run_dir = run
    records = read_metrics(run_dir / "metrics.jsonl")
    rows = (run_dir / "metrics.csv").read_text().splitlines()
    assert rows[0].startswith("time,epoch,step,split,loss")
    assert [r["split"] for r in records].count("startup") == 1  # once, at the first step
    # and per epoch two train records, one val and one val_ema (the default EMA's)
    assert len(rows) - 1 == len(records) == 1 + 2 * 2 + 2 + 2


def test_tensorboard_event_files_hold_the_curves(run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _, out, run_dir = run
    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    scalars = events.Tags()["scalars"]
    assert {"train/loss", "train/lr", "val/top1", "val/top5", "val/loss"} <= set(scalars)
    top1 = [e.value for e in events.Scalars("val/top1")]
    assert len(top1) == 2 and top1[-1] == pytest.approx(out["final"]["top1"])


def test_wandb_offline_run_is_written(run):
    _, _, run_dir = run
    runs = list((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1 and runs[0].stat().st_size > 0


def test_report_writes_png_with_the_expected_curves(run, tmp_path):
    _, out, run_dir = run
    png = tmp_path / "curves.png"
    result = CliRunner().invoke(app, ["report", str(run_dir), "--out", str(png), "--json"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["finished"] and summary["epochs_done"] == 2
    assert summary["top1"] == pytest.approx(out["final"]["top1"])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    axes = {ax.get_title(): ax for ax in figure(run_dir).axes}
    assert set(axes) == {"loss", "validation accuracy", "learning rate", "training images/s (all ranks)"}
    val = [r for r in read_metrics(run_dir / "metrics.jsonl") if r["split"] == "val"]
    top1_line = axes["validation accuracy"].get_lines()[0]
    assert list(top1_line.get_ydata()) == [r["top1"] for r in val]
    assert len(axes["learning rate"].get_lines()[0].get_xdata()) == 4


def test_report_works_while_a_run_is_still_writing(run, tmp_path):
    _, _, run_dir = run
    live = tmp_path / "live"
    live.mkdir()
    text = (run_dir / "metrics.jsonl").read_text()
    (live / "metrics.jsonl").write_text(text[: text.index('"split": "val"') + 5])  # cut mid-line
    result = CliRunner().invoke(app, ["report", str(live), "--json"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["finished"] is False and summary["epochs_done"] == 0 and summary["steps"] == 4
    assert (live / "report.png").is_file()


def test_diverged_training_exits_4(demo_registry, tmp_path):
    """A worker's failure, reported once; with --json also as the last stdout line."""
    result = run_ddp("train", "configs/demo.toml", "--registry", str(demo_registry), "--run-dir",
                     str(tmp_path / "run"), "--set", "optim.lr=1e6", "--set", "data.workers=0", "--json")
    assert result.returncode == 4, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "diverged" in errors[0]
    last = json.loads(result.stdout.strip().splitlines()[-1])
    assert last == {"error": errors[0].removeprefix("error: "), "exit_code": 4}


@pytest.mark.parametrize(("sig", "code"), [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_signals_to_the_launcher_exit_143_and_130(demo_registry, tmp_path, sig, code):
    run = LiveRun.demo_at_step_2(demo_registry, tmp_path / "run")
    run.proc.send_signal(sig)
    assert run.wait(timeout=90) == code, run.stderr


def test_a_worker_killed_by_a_signal_is_a_lost_rank_exit_5_naming_it(demo_registry, tmp_path):
    run = LiveRun.demo_at_step_2(demo_registry, tmp_path / "run")
    workers = run.workers()
    assert len(workers) == 2
    os.kill(workers[1], signal.SIGKILL)
    assert run.wait(timeout=90) == 5
    error = [line for line in run.stderr.splitlines() if line.startswith("error:")]
    assert len(error) == 1 and "rank 1" in error[0] and "--resume auto" in error[0], run.stderr
