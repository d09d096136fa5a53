"""Ctrl-C as a terminal sends it (SIGINT to the launcher's process group), pressed twice or three times
during the first epoch: each press said on stderr, the run ended in seconds, never a traceback."""

from __future__ import annotations

import os
import signal
import time

import pytest
from conftest import LiveRun

from ddp_cli.train.checkpoint import CheckpointStore

pytestmark = pytest.mark.slow

HANG_GUARD_S = 60  # far below distributed.stop_grace_s (120): the hang this guards against waited it out


def press_ctrl_c(run: LiveRun, times: int) -> None:
    for _ in range(times):
        os.killpg(run.proc.pid, signal.SIGINT)
        time.sleep(0.2)


def first_epoch_run(registry, run_dir, *extra: str) -> LiveRun:
    run = LiveRun("train", "configs/demo.toml", "--registry", str(registry), "--run-dir", str(run_dir),
                  "--set", "data.workers=1", "--set", "logging.every_steps=1", *extra)
    run.wait_for("epoch 1/8 step 2/")
    return run


def test_ctrl_c_twice_in_the_first_epoch_finishes_the_stop_checkpoint_and_exits_130(demo_registry,
                                                                                      tmp_path):
    run = first_epoch_run(demo_registry, tmp_path / "run")
    press_ctrl_c(run, 2)
    assert run.wait(timeout=HANG_GUARD_S) == 130, run.stderr
    assert "SIGINT: stopping: the workers finish their step and write a checkpoint" in run.stderr
    assert "SIGINT again: still stopping, waiting for the checkpoint" in run.stderr
    assert "Traceback" not in run.stderr and "forcefully" not in run.stderr, run.stderr
    assert "error: stopped by SIGINT after step" in run.stderr
    saved = CheckpointStore(tmp_path / "run/checkpoints", 1).latest_valid()
    assert saved is not None and "step-" in saved.name, run.stderr


def test_ctrl_c_three_times_aborts_at_once_without_the_stop_checkpoint(demo_registry, tmp_path):
    """The ranks agree on a stop only at the epoch's end here (distributed.stop_check_steps above the
    epoch's 22 steps), so the workers are still training when the third press comes."""
    run = first_epoch_run(demo_registry, tmp_path / "run", "--set", "distributed.stop_check_steps=1000")
    workers = run.workers()
    press_ctrl_c(run, 3)
    assert run.wait(timeout=HANG_GUARD_S) == 130, run.stderr
    assert "SIGINT a third time: aborting" in run.stderr
    assert "error: aborted by a third SIGINT: the workers were killed before their stop checkpoint" \
        in run.stderr
    assert "Traceback" not in run.stderr, run.stderr
    assert not [pid for pid in workers if os.path.exists(f"/proc/{pid}")], "a worker outlived the abort"
