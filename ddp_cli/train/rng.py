"""Every random number generator a rank uses, as plain data a checkpoint can hold.

Resuming exactly means restoring torch (CPU and CUDA), numpy and Python's
`random` on every rank; augmentation is seeded per sample (see data/loaders.py),
so DataLoader worker processes carry no state worth saving.

A rank computes on one GPU, so its CUDA state is that device's alone: saving
every visible GPU's (as checkpoints before issue 26 did) made a resume at the
same world size but another number of GPUs per node (2 nodes x 8 -> 4 x 4) fail
restoring states for devices the node does not have.
"""

from __future__ import annotations

import logging
import random
from typing import Any

import numpy as np
import torch

log = logging.getLogger("ddp")


def capture() -> dict[str, Any]:
    """This process's generator states, as tensors, ints and tuples (weights_only-safe)."""
    kind, key, pos, has_gauss, gauss = np.random.get_state()
    version, mt_state, python_gauss = random.getstate()
    return {
        "torch": torch.get_rng_state(),
        "cuda": capture_cuda(),
        "numpy": {"kind": kind, "key": torch.from_numpy(key.astype(np.int64)), "pos": pos,
                  "has_gauss": has_gauss, "gauss": gauss},
        "python": {"version": version, "state": list(mt_state), "gauss": python_gauss},
    }


def capture_cuda() -> torch.Tensor | None:
    """The rank's own GPU's state; None in a process that never used CUDA (a CPU worker on a GPU
    node must not create a CUDA context to save a state it never drew from)."""
    return torch.cuda.get_rng_state(torch.cuda.current_device()) if torch.cuda.is_initialized() else None


def restore(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    restore_cuda(state.get("cuda"))
    n = state["numpy"]
    np.random.set_state((n["kind"], n["key"].numpy().astype(np.uint32), n["pos"], n["has_gauss"],
                         n["gauss"]))
    p = state["python"]
    random.setstate((p["version"], tuple(p["state"]), p["gauss"]))


def restore_cuda(saved: torch.Tensor | list[torch.Tensor] | None) -> None:
    """The rank's GPU state back on its GPU. An older checkpoint's list of every visible device's
    states gives the entry of this rank's device, where the saving node had that many."""
    if saved is None or not torch.cuda.is_initialized():
        return
    device = torch.cuda.current_device()
    if isinstance(saved, list):
        if device >= len(saved):
            log.debug("rng: the checkpoint holds CUDA states of %d devices, none for cuda:%d; left as seeded",
                      len(saved), device)
            return
        saved = saved[device]
    torch.cuda.set_rng_state(saved, device)
