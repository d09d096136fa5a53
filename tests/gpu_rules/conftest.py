"""The fake GPU world (fakegpu.py) as a fixture: each test runs as rank 3 of 8 on cuda:3, on this CPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gpu_rules.fakegpu import FakeGpuWorld


@pytest.fixture
def gpu(monkeypatch):
    """The world; skipped where torch sees a real GPU: fake CUDA tensors rely on the no-op device guard
    torch installs where there is none (with a real one, cuda:3 must exist), and tests/cuda runs there."""
    if torch.cuda.is_available():
        pytest.skip("a real GPU is here: tests/cuda covers these paths on it")
    with FakeGpuWorld(monkeypatch) as world:
        yield world


def pytest_collection_modifyitems(items):
    """torch's deepcopy of a fake tensor (the EMA's copy of the model) warns that it read a data pointer
    (it compares it with 0); nothing is read from it."""
    here = Path(__file__).parent
    for item in items:
        if here in item.path.parents:
            item.add_marker(pytest.mark.filterwarnings("ignore:Accessing the data pointer of FakeTensor"))
