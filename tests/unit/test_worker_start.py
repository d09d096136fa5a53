"""How the launcher starts its workers: forked where that is safe, spawned where it is not."""

from __future__ import annotations

import pytest
import torch

from ddp_cli.run import launch


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_a_single_threaded_launcher_without_gpus_forks(one_thread, monkeypatch):
    monkeypatch.setattr(launch, "cuda_devices", lambda: 0)
    monkeypatch.delenv(launch.WORKER_START, raising=False)
    assert launch.worker_start() == "fork"


def test_gpus_mean_spawn_the_driver_is_not_fork_safe(one_thread, monkeypatch):
    monkeypatch.setattr(launch, "cuda_devices", lambda: 8)
    assert launch.worker_start() == "spawn"


def test_a_launcher_with_an_openmp_pool_spawns(monkeypatch):
    """A child forked after a parallel region hangs in its first one: more than one thread, no fork."""
    monkeypatch.setattr(launch, "cuda_devices", lambda: 0)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert launch.worker_start() == "spawn"
    finally:
        torch.set_num_threads(threads)


def test_the_environment_can_ask_for_spawn(one_thread, monkeypatch):
    monkeypatch.setattr(launch, "cuda_devices", lambda: 0)
    monkeypatch.setenv(launch.WORKER_START, "spawn")
    assert launch.worker_start() == "spawn"


def test_the_launcher_raises_its_open_files_soft_limit_to_the_hard_one(monkeypatch):
    """A gloo worker holds a socket per peer: at 512 ranks, near the usual soft limit of 1024."""
    limits = {"now": (1024, 524288)}
    monkeypatch.setattr(launch.resource, "getrlimit", lambda which: limits["now"])
    monkeypatch.setattr(launch.resource, "setrlimit", lambda which, value: limits.update(now=value))
    launch.more_open_files()
    assert limits["now"] == (524288, 524288)
    limits["now"] = (20000, 20000)
    launch.more_open_files()  # nothing to raise
    assert limits["now"] == (20000, 20000)
