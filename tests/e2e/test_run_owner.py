"""Two `ddp train` into one run dir, local and in a bucket: the second stops at once (exit 2) naming the
first's host and pid, and touches none of its files; once the first is gone (killed), the next run takes
its run dir over with one warning."""

from __future__ import annotations

import json
import os
import signal
import socket
from pathlib import Path

import pytest
import s3fs
from conftest import ENV, KEY, SECRET, LiveRun, last_json, run_ddp

pytestmark = pytest.mark.slow

QUICK = [a for s in ("data.workers=0", "logging.every_steps=1", "data.image_size=8", "data.val_resize=8",
                     "train.epochs=2", "train.max_steps_per_epoch=4", "train.precision=fp32")
         for a in ("--set", s)]


def train(registry: Path, run_dir: str, env: dict | None = None):
    return run_ddp("train", "configs/demo.toml", "--registry", str(registry), "--run-dir", run_dir, "--json",
                   *QUICK, env=env)


def frozen(run: LiveRun) -> None:
    """The first run held still (SIGSTOP, launcher and workers): alive, writing nothing meanwhile."""
    for pid in [run.proc.pid, *run.workers()]:
        os.kill(pid, signal.SIGSTOP)


def files(folder: Path) -> dict[str, tuple[int, int]]:
    return {p.relative_to(folder).as_posix(): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in folder.rglob("*") if p.is_file()}


def refused_naming(result, first: LiveRun) -> None:
    assert result.returncode == 2, result.stderr[-3000:]
    error = json.loads(result.stdout.strip().splitlines()[-1])["error"]
    assert f"owned by a live run, host {socket.gethostname()} pid {first.proc.pid} " in error, error


def test_a_second_train_into_a_live_run_dir_is_refused_then_a_dead_owner_is_taken_over(demo_registry,
                                                                                       tmp_path):
    run_dir = tmp_path / "run"
    first = LiveRun("train", "configs/demo.toml", "--registry", str(demo_registry), "--run-dir", str(run_dir),
                    *QUICK, "--set", "train.epochs=50")
    try:
        first.wait_for("step 2/")
        frozen(first)
        before = files(run_dir)
        refused_naming(train(demo_registry, str(run_dir)), first)
        assert files(run_dir) == before  # not one file of the first's written, moved or removed
    finally:
        first.kill()
    taken = train(demo_registry, str(run_dir))
    last_json(taken)
    warnings = [line for line in taken.stderr.splitlines() if "taken over" in line]
    assert len(warnings) == 1 and f"pid {first.proc.pid} " in warnings[0] and "process is gone" in warnings[0]
    assert not (run_dir / "owner.lock").exists()  # let go at the end


def test_the_same_in_a_bucket_through_conditional_writes(demo_registry, s3_endpoint, tmp_path):
    fs = s3fs.S3FileSystem(key=KEY, secret=SECRET, client_kwargs={"endpoint_url": s3_endpoint},
                           skip_instance_cache=True)
    fs.mkdir("ddp-owned-runs")
    url = "s3://ddp-owned-runs/runs/demo"
    env = {**ENV, "AWS_ENDPOINT_URL": s3_endpoint}
    first = LiveRun("train", "configs/demo.toml", "--registry", str(demo_registry), "--run-dir", url, *QUICK,
                    "--set", "train.epochs=50", env={**env, "DDP_STAGING_DIR": str(tmp_path / "node-a")})
    try:
        first.wait_for("step 2/")
        frozen(first)
        fs.invalidate_cache()
        before = {key: fs.info(key)["ETag"] for key in fs.find("ddp-owned-runs")}
        assert "ddp-owned-runs/runs/demo/owner.lock" in before
        # another node's staging folder: only the bucket's lock can tell it the run dir is taken
        second = train(demo_registry, url, env={**env, "DDP_STAGING_DIR": str(tmp_path / "node-b")})
        refused_naming(second, first)
        fs.invalidate_cache()
        assert {key: fs.info(key)["ETag"] for key in fs.find("ddp-owned-runs")} == before
        assert not (tmp_path / "node-b").exists()
    finally:
        first.kill()
    taken = train(demo_registry, url, env={**env, "DDP_STAGING_DIR": str(tmp_path / "node-b")})
    assert last_json(taken)["run_dir"] == url
    assert sum("taken over" in line for line in taken.stderr.splitlines()) == 1

