"""An exponential moving average (EMA) of the weights, validated beside the live model.

After every optimisation step, each floating tensor of the model's state
(weights and BatchNorm running statistics alike, as torchvision's reference
does with `use_buffers=True`) moves toward the live one:
`ema = d * ema + (1 - d) * live`. Averaging the statistics with the weights
keeps them roughly matched without an extra pass over the data; integer
buffers (`num_batches_tracked`) are copied. The decay ramps up as
`d_t = min(decay, (1 + t) / (10 + t))` (TensorFlow's `num_updates` rule), so
a short run's average is not stuck near the random initial weights.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn


class EmaModel:
    """Every rank keeps one (same updates, same weights); rank 0's BatchNorm statistics win."""

    def __init__(self, model: nn.Module, decay: float) -> None:
        self.module = copy.deepcopy(model).eval().requires_grad_(False)
        self.decay, self.updates = decay, 0

    def current_decay(self) -> float:
        return min(self.decay, (1 + self.updates) / (10 + self.updates))

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        d = self.current_decay()
        self.updates += 1
        for average, live in zip(self.module.state_dict().values(), model.state_dict().values(),
                                 strict=True):
            if average.is_floating_point():
                average.lerp_(live, 1 - d)
            else:
                average.copy_(live)

    @torch.no_grad()
    def restart(self, model: nn.Module) -> None:
        """Start averaging afresh from `model`'s weights (resuming a run that had no EMA)."""
        self.module.load_state_dict(model.state_dict())
        self.updates = 0

    def state_dict(self) -> dict[str, Any]:
        return {"module": self.module.state_dict(), "updates": self.updates}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.module.load_state_dict(state["module"])
        self.updates = state["updates"]
