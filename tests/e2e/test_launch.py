"""Launching: rendezvous failures, two nodes on loopback (SLURM parsing: tests/unit/test_slurm.py)."""

from __future__ import annotations

import os
import socket

import pytest
from conftest import last_json, run_ddp

from ddp_cli.run.loopback import free_port

SMALL = ["--set", "train.epochs=1", "--set", "train.max_steps_per_epoch=5", "--set", "data.workers=0",
         "--set", "data.image_size=8", "--set", "data.val_resize=8", "--set", "distributed.rdzv_timeout_s=8"]


def test_a_busy_rendezvous_port_is_a_usage_error(demo_registry, tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = run_ddp("train", "configs/demo.toml", "--registry", str(demo_registry), "--run-dir",
                         str(tmp_path / "run"), "--rdzv-endpoint", f"127.0.0.1:{port}", *SMALL,
                         timeout=120)
    assert result.returncode == 2, result.stderr
    assert f"127.0.0.1:{port}: cannot host the rendezvous there (port in use)" in result.stderr
    assert "frame #" not in result.stderr


def test_an_unreachable_rendezvous_is_a_data_error_not_a_hang(demo_registry, tmp_path):
    result = run_ddp("train", "configs/demo.toml", "--registry", str(demo_registry), "--run-dir",
                     str(tmp_path / "run"), "--nnodes", "2", "--node-rank", "1",
                     "--rdzv-endpoint", f"127.0.0.1:{free_port()}", *SMALL,
                     "--set", "distributed.rdzv_timeout_s=3", timeout=120)
    assert result.returncode == 3, result.stderr
    assert "rendezvous failed" in result.stderr and "frame #" not in result.stderr


def test_two_launchers_on_loopback_form_one_world(demo_registry, tmp_path):
    """`--nnodes 2`, one worker each, c10d on 127.0.0.1: the same run as one node with 2 workers.
    Node 0 forks its worker from the launcher, node 1 spawns it (as GPU nodes do): one world.

    Every worker gets one thread (as 2 workers on one 2-core node do): kernels
    reduce in a thread-count-dependent order, so equal results need equal threads."""
    import subprocess
    import sys

    from conftest import REPO

    endpoint = f"127.0.0.1:{free_port()}"
    one_thread = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_CPP_LOG_LEVEL": "INFO"}  # [rankN]: lines
    nodes = []
    for rank in (0, 1):
        cmd = [sys.executable, "-m", "ddp_cli", "train", "configs/demo.toml", "--registry",
               str(demo_registry), "--run-dir", str(tmp_path / f"node{rank}"), "--nnodes", "2",
               "--node-rank", str(rank), "--rdzv-endpoint", endpoint, "--rdzv-id", "loopback",
               "--nproc-per-node", "1", "--json", *SMALL]
        nodes.append(subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True, start_new_session=True,
                                      env={**one_thread, "DDP_WORKER_START": ("", "spawn")[rank]}))
    results = []
    try:
        for node in nodes:
            stdout, stderr = node.communicate(timeout=200)
            results.append(last_json(subprocess.CompletedProcess(node.args, node.returncode, stdout,
                                                                 stderr)))
    finally:
        for node in nodes:
            node.kill()
    single = last_json(run_ddp("train", "configs/demo.toml", "--registry", str(demo_registry),
                               "--run-dir", str(tmp_path / "single"), "--nproc-per-node", "2",
                               "--json", *SMALL, env={"OMP_NUM_THREADS": "1"}))
    assert [node["worker_start"] for node in results] == ["fork", "spawn"]
    for rank in (0, 1):  # each node keeps its own worker's logs, named by global rank, forked or spawned
        logs = tmp_path / f"node{rank}" / "logs"
        assert sorted(p.name for p in logs.iterdir()) == [f"rank{rank}.stderr.log", f"rank{rank}.stdout.log"]
        assert f"[rank{rank}]:" in (logs / f"rank{rank}.stderr.log").read_text()
    own = tmp_path / "node1"  # a run dir of node 1's own (not shared): it keeps its own copy to resume from
    assert "keeps its own copy of the checkpoints" in (own / "logs" / "rank1.stderr.log").read_text()
    assert (own / "checkpoints" / "last.pt").is_file() and (own / "result.json").is_file()
    for node in results:
        assert node["world_size"] == 2
        assert node["final"]["images"] == 359
        assert node["final"]["top1"] == single["final"]["top1"]
        assert node["final"]["loss"] == pytest.approx(single["final"]["loss"], rel=1e-3)
