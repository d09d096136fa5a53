"""Losing a node, on loopback: two `ddp train` launchers (one worker each) on the demo data.

A node is "lost" when its launcher and worker are killed with SIGKILL (the
machine died) and "hung" when they are stopped with SIGSTOP (the machine froze).
A fixed `--nnodes 2` job then stops with exit 5 naming the lost rank and the
command that resumes it. An elastic job (`--nnodes 1:2`) going on without a lost node is
tests/e2e/test_schedulers.py's elastic PyTorchJob: the same agent, the node count from PET_NNODES.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from conftest import REPO, LiveRun

from ddp_cli.run.loopback import free_port

pytestmark = pytest.mark.slow

TIMEOUT_S = 8  # distributed.timeout_s: how long a collective waits for a hung peer
# 8 px (the digits' native size), in-process loading, a checkpoint every 5 steps, a log line per step
DEMO = ["--set", "data.image_size=8", "--set", "data.val_resize=8", "--set", "data.workers=0",
        "--set", "logging.every_steps=1", "--set", "checkpoint.every_steps=5",
        "--set", f"distributed.timeout_s={TIMEOUT_S}", "--set", "distributed.rdzv_timeout_s=60"]
ONE_THREAD = {"OMP_NUM_THREADS": "1"}  # as 2 workers on this 2-core machine: equal threads, equal sums


def node(rank: int, run_dir: Path, endpoint: str, nnodes: str, *extra: str, faults: str = "") -> LiveRun:
    """One launcher; `faults` (DDP_FAULTS) strike its rank at the step they name, whatever the machine's
    speed (a test polling for the step could see it only once the short run is over)."""
    return LiveRun("train", "configs/demo.toml", "--registry", os.environ["DDP_TEST_REGISTRY"],
                   "--run-dir", str(run_dir), "--nnodes", nnodes, "--node-rank", str(rank),
                   "--rdzv-endpoint", endpoint, "--rdzv-id", "loss", "--nproc-per-node", "1",
                   *DEMO, *extra, env={**ONE_THREAD, "DDP_FAULTS": faults})


@pytest.fixture(autouse=True)
def registry_env(demo_registry, monkeypatch):
    monkeypatch.setenv("DDP_TEST_REGISTRY", str(demo_registry))


def wait_for_step(run_dir: Path, step: int, timeout: float = 120) -> None:
    """Until metrics.jsonl has a train record at `step` or later."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with_steps = [json.loads(line) for line in _lines(run_dir / "metrics.jsonl")]
        if any(r.get("split") == "train" and r.get("step", 0) >= step for r in with_steps):
            return
        time.sleep(0.2)
    pytest.fail(f"no train step {step} in {run_dir} within {timeout}s")


def _lines(path: Path) -> list[str]:
    try:
        return [line for line in path.read_text().splitlines() if line.endswith("}")]
    except FileNotFoundError:
        return []


def state(pid: int) -> str:
    """The process's state letter (R, S, T stopped, Z zombie), "" once it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return ""


def alive(pid: int) -> bool:
    return state(pid) not in ("", "Z")


def until(condition: Callable[[], bool], timeout: float = 120) -> float:
    """Polls `condition` until it holds; when it did (time.monotonic)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"waited {timeout} s in vain")
        time.sleep(0.02)
    return time.monotonic()


def freeze(run: LiveRun, sig: signal.Signals) -> None:
    for pid in [run.proc.pid, *run.workers()]:
        os.kill(pid, sig)


def error_line(run: LiveRun) -> str:
    lines = [line for line in run.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, run.stderr
    assert "Traceback" not in run.stderr and "a bug" not in run.stderr, run.stderr
    return lines[0]


def run_nodes(commands: list[list[str]], timeout: float = 200) -> None:
    """Both nodes at once, to the end; both must succeed."""
    procs = [subprocess.Popen(cmd, cwd=REPO, env={**os.environ, **ONE_THREAD}, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, start_new_session=True) for cmd in commands]
    try:
        errors = [proc.communicate(timeout=timeout)[1] for proc in procs]
        assert [proc.returncode for proc in procs] == [0, 0], "\n".join(e[-2000:] for e in errors)
    finally:
        for proc in procs:
            proc.kill()


def ddp(*args: str) -> list[str]:
    return [sys.executable, "-m", "ddp_cli", *args]


def weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(run_dir / "checkpoints/last.pt", weights_only=True)["model"]


def test_a_lost_rank_stops_a_fixed_job_with_code_5_and_its_command_resumes_it_exactly(tmp_path):
    """Node 1's worker killed with SIGKILL: both launchers exit 5 in time, leaving no process."""
    run_dir, endpoint = tmp_path / "run", f"127.0.0.1:{free_port()}"
    short = ["--set", "train.epochs=1", "--set", "deterministic=true"]  # 22 steps
    nodes = [node(0, run_dir, endpoint, "2", *short),
             node(1, run_dir, endpoint, "2", *short, "--json", faults="sigkill@12:1")]  # 5, 10 saved
    try:
        wait_for_step(run_dir, 1)
        workers = [pid for run in nodes for pid in run.workers()]
        assert len(workers) == 2
        lost = until(lambda: not alive(workers[1]))
        assert [run.wait(timeout=TIMEOUT_S + 60) for run in nodes] == [5, 5], nodes[0].stderr
        assert time.monotonic() - lost <= TIMEOUT_S + 15
        assert not [pid for pid in workers if alive(pid)]
    finally:
        for run in nodes:
            run.kill()
    assert "worker rank 1 was killed by SIGKILL" in error_line(nodes[1])
    assert json.loads(nodes[1].stdout.strip().splitlines()[-1]) == {  # --json: the error object last
        "error": error_line(nodes[1]).removeprefix("error: "), "exit_code": 5}
    line = error_line(nodes[0])
    assert "rank 1 (node 1) was lost" in line and "newest valid checkpoint" in line, line
    command = shlex.split(line.split("(each with its own --node-rank): ", 1)[1])
    assert command[0] == "ddp" and command[-4:] == ["--run-dir", str(run_dir), "--resume", "auto"]
    on_node_1 = command[1:]
    on_node_1[on_node_1.index("--node-rank") + 1] = "1"
    run_nodes([ddp(*command[1:]), ddp(*on_node_1)])  # the node is back: the same command on both
    reference_dir = tmp_path / "reference"
    endpoint = f"127.0.0.1:{free_port()}"
    run_nodes([ddp("train", "configs/demo.toml", "--registry", os.environ["DDP_TEST_REGISTRY"],
                   "--run-dir", str(reference_dir), "--nnodes", "2", "--node-rank", str(rank),
                   "--rdzv-endpoint", endpoint, "--rdzv-id", "ref", "--nproc-per-node", "1", *DEMO, *short)
               for rank in (0, 1)])
    resumed, reference = weights(run_dir), weights(reference_dir)
    assert all(torch.equal(resumed[k], reference[k]) for k in reference), "resumed run differs"
    # one run dir for both nodes: rank 0 alone wrote it, nothing half-written or left behind
    assert "keeps its own copy" not in (reference_dir / "logs" / "rank1.stderr.log").read_text()
    assert not [p.name for p in reference_dir.rglob(".*")]


def test_a_hung_node_stops_a_fixed_job_with_code_5_within_the_timeout(tmp_path):
    run_dir, endpoint = tmp_path / "run", f"127.0.0.1:{free_port()}"
    nodes = [node(rank, run_dir, endpoint, "2", "--set", "train.epochs=2", faults="sigstop@6:1")
             for rank in (0, 1)]
    try:
        frozen = until(lambda: state(nodes[1].proc.pid) == "T")  # node 1 froze after step 6
        assert nodes[0].wait(timeout=TIMEOUT_S + 60) == 5, nodes[0].stderr
        assert time.monotonic() - frozen <= TIMEOUT_S + 15
    finally:
        freeze(nodes[1], signal.SIGCONT)
        for run in nodes:
            run.kill()
    line = error_line(nodes[0])
    assert f"rank 1 (node 1) stopped answering (a collective timed out after distributed.timeout_s = " \
           f"{TIMEOUT_S} s)" in line, line
    assert "--resume auto" in line
