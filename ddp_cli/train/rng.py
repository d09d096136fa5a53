"""Every random number generator a rank uses, as plain data a checkpoint can hold.

Resuming exactly means restoring torch (CPU and CUDA), numpy and Python's
`random` on every rank; augmentation is seeded per sample (see data/loaders.py),
so DataLoader worker processes carry no state worth saving.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def capture() -> dict[str, Any]:
    """This process's generator states, as tensors, ints and tuples (weights_only-safe)."""
    kind, key, pos, has_gauss, gauss = np.random.get_state()
    version, mt_state, python_gauss = random.getstate()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "numpy": {"kind": kind, "key": torch.from_numpy(key.astype(np.int64)), "pos": pos,
                  "has_gauss": has_gauss, "gauss": gauss},
        "python": {"version": version, "state": list(mt_state), "gauss": python_gauss},
    }


def restore(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    n = state["numpy"]
    np.random.set_state((n["kind"], n["key"].numpy().astype(np.uint32), n["pos"], n["has_gauss"],
                         n["gauss"]))
    p = state["python"]
    random.setstate((p["version"], tuple(p["state"]), p["gauss"]))
