"""The node and rank the fake GPU world plays (fakegpu.py), and what it raises when a rule is broken."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

RANK, WORLD, GPUS = 3, 8, 8
DEVICE = torch.device("cuda", RANK)


class GpuRuleError(AssertionError):
    """A call a GPU run with NCCL would refuse (or that would go wrong there)."""


def tensors_in(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor inside `obj`'s dicts, lists, tuples and sets."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from tensors_in(value)
    elif isinstance(obj, list | tuple | set):
        for value in obj:
            yield from tensors_in(value)
