"""The fake GPU world (fakegpu.py) as a fixture: each test runs as rank 3 of 8 on cuda:3, on this CPU."""

from __future__ import annotations

import pytest
from fakegpu import FakeGpuWorld


@pytest.fixture
def gpu(monkeypatch):
    with FakeGpuWorld(monkeypatch) as world:
        yield world
