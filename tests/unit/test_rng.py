"""A rank's generator states: its own GPU's CUDA state only, so a resume at the same world size on
another number of GPUs per node (2 x 8 -> 4 x 4) restores; older checkpoints (every visible GPU's
state) still load. No GPU here: torch.cuda is mocked, 4 GPUs on this node."""

from __future__ import annotations

import logging
import random

import numpy as np
import pytest
import torch

from ddp_cli.train import rng


@pytest.fixture()
def gpu_rank(monkeypatch):
    """A rank on cuda:3 of a 4-GPU node; what was set on which device."""
    states = {d: torch.full((16,), d, dtype=torch.uint8) for d in range(4)}

    def set_state(state, device="cuda"):
        if device >= 4:
            raise RuntimeError(f"invalid device ordinal {device}")
        states[device] = state

    def set_all(all_states):  # what restore called before: one state per saved device
        for device, state in enumerate(all_states):
            set_state(state, device)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device="cuda": states[device].clone())
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: [states[d] for d in range(4)])
    monkeypatch.setattr(torch.cuda, "set_rng_state", set_state)
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", set_all)
    return states


def test_a_rank_saves_its_own_gpus_state(gpu_rank):
    assert torch.equal(rng.capture()["cuda"], torch.full((16,), 3, dtype=torch.uint8))


def test_it_restores_on_a_node_with_fewer_gpus(gpu_rank):
    saved = rng.capture()
    saved["cuda"] = torch.full((16,), 42, dtype=torch.uint8)
    rng.restore(saved)
    assert torch.equal(gpu_rank[3], saved["cuda"]) and gpu_rank[0][0] == 0


def test_an_older_checkpoints_states_of_8_gpus_give_this_ranks_device(gpu_rank):
    """Saved on a node of 8 GPUs; restored on cuda:3 of a node of 4 (raised IndexError before)."""
    saved = rng.capture()
    saved["cuda"] = [torch.full((16,), 100 + d, dtype=torch.uint8) for d in range(8)]
    rng.restore(saved)
    assert [int(gpu_rank[d][0]) for d in range(4)] == [0, 1, 2, 103]


def test_an_older_checkpoint_without_this_device_is_skipped_with_a_debug_line(gpu_rank, caplog):
    saved = rng.capture()
    saved["cuda"] = [torch.full((16,), 100 + d, dtype=torch.uint8) for d in range(2)]
    with caplog.at_level(logging.DEBUG, logger="ddp"):
        rng.restore(saved)
    assert [int(gpu_rank[d][0]) for d in range(4)] == [0, 1, 2, 3]
    assert "none for cuda:3" in caplog.text


def test_a_cpu_worker_neither_saves_nor_restores_cuda_state(monkeypatch):
    def initialised(*args, **kwargs):
        raise AssertionError("a CPU worker initialised CUDA")

    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    for name in ("_lazy_init", "current_device", "get_rng_state", "set_rng_state"):
        monkeypatch.setattr(torch.cuda, name, initialised)
    saved = rng.capture()
    assert saved["cuda"] is None
    saved["cuda"] = [torch.zeros(16, dtype=torch.uint8)]  # a GPU run resumed on CPU
    rng.restore(saved)


def test_cpu_numpy_and_python_states_round_trip():
    saved = rng.capture()
    drawn = (torch.rand(3), np.random.rand(3), random.random())
    rng.restore(saved)
    again = (torch.rand(3), np.random.rand(3), random.random())
    assert torch.equal(drawn[0], again[0]) and np.array_equal(drawn[1], again[1]) and drawn[2] == again[2]
