"""An exponential moving average (EMA) of the weights, validated beside the live model.

Every `every` optimisation steps (`train.ema_every_steps`), each floating
tensor of the model's state (weights and BatchNorm running statistics alike, as
torchvision's reference does with `use_buffers=True`) moves toward the live
one: `ema = d * ema + (1 - d) * live`. Averaging the statistics with the
weights keeps them roughly matched without an extra pass over the data; integer
buffers (`num_batches_tracked`) are copied. Updating every `every` steps uses
`d = decay ** every`, which keeps the averaging horizon the same in steps (a
weight's influence after n steps is `decay ** n` either way) for 1/`every` of
the cost; torchvision's recipes do the same (every 32 steps). The decay ramps up
per update as `d_t = min(d, (1 + t) / (10 + t))` (TensorFlow's `num_updates`
rule, t = updates so far), so a short run's average is not stuck near the
random initial weights.

Early in a run that average lags: the statistics were gathered by weights
that have moved since, and at crops smaller than validation's under
progressive resizing. `recalibrate` recomputes them from a sample of train
images at the val crop (PreciseBN, Wu and Johnson 2021), before validating the
first `train.ema_bn_epochs` epochs; from then on the average over every batch
measured better than a sample's (docs/recipes.md).

The update is a handful of foreach kernels over tensor lists built once (the
EMA module's and the live model's state, in state_dict order), not one kernel
per tensor over freshly built state dicts; `restart` and `load_state_dict` copy
in place, so the lists stay valid.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn


def split_state(module: nn.Module) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The module's state tensors in state_dict order: (floating, the rest)."""
    tensors = list(module.state_dict().values())
    return [t for t in tensors if t.is_floating_point()], [t for t in tensors if not t.is_floating_point()]


class EmaModel:
    """Every rank keeps one (same updates, same weights); rank 0's BatchNorm statistics win."""

    def __init__(self, model: nn.Module, decay: float, every: int = 1) -> None:
        self.module = copy.deepcopy(model).eval().requires_grad_(False)
        self.decay, self.every, self.updates = decay, every, 0
        self.floats, self.others = split_state(self.module)  # the average's tensors, updated in place
        self.live: nn.Module | None = None  # the model whose tensors `live_floats`/`live_others` are
        self.live_floats: list[torch.Tensor] = []
        self.live_others: list[torch.Tensor] = []

    def current_decay(self) -> float:
        return min(self.decay ** self.every, (1 + self.updates) / (10 + self.updates))

    def step(self, model: nn.Module, step: int) -> None:
        """After optimisation step `step` (counted from 1 over the run): update on every `every`-th."""
        if step % self.every == 0:
            self.update(model)

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        if model is not self.live:
            self.live = model
            self.live_floats, self.live_others = split_state(model)
        d = self.current_decay()
        self.updates += 1
        if self.floats:
            torch._foreach_lerp_(self.floats, self.live_floats, 1 - d)
        if self.others:
            torch._foreach_copy_(self.others, self.live_others)

    def recalibrate(self, inputs: Iterable[torch.Tensor]) -> None:
        """Each BatchNorm's statistics made the plain average over the batches of `inputs` (every rank its
        own share; then the mean over the ranks). Only the BatchNorm layers run in train mode, so dropout
        and stochastic depth draw nothing, and the statistics are those of the network validation runs.
        No BatchNorm, no pass. (`no_grad` inside, not as a decorator: mutmut skips decorated functions.)"""
        with torch.no_grad():
            norms = [m for m in self.module.modules()
                     if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats]
            if not norms:
                return
            momenta = [norm.momentum for norm in norms]
            for norm in norms:
                norm.train()
            for seen, x in enumerate(inputs):
                for norm in norms:  # the k-th batch weighs 1/k: the plain average, with no host read of the
                    norm.momentum = 1 / (seen + 1)  # batch count (momentum None divides by it on the host)
                self.module(x)
            for norm, momentum in zip(norms, momenta, strict=True):
                norm.momentum = momentum
                norm.eval()
            stats = [t for norm in norms for t in (norm.running_mean, norm.running_var)]
            if dist.is_initialized() and dist.get_world_size() > 1:
                for tensor in stats:
                    dist.all_reduce(tensor)
                torch._foreach_div_(stats, dist.get_world_size())

    @torch.no_grad()
    def restart(self, model: nn.Module) -> None:
        """Start averaging afresh from `model`'s weights (resuming a run that had no EMA)."""
        self.module.load_state_dict(model.state_dict())  # in place: `floats` and `others` stay valid
        self.updates = 0

    def state_dict(self) -> dict[str, Any]:
        return {"module": self.module.state_dict(), "updates": self.updates}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.module.load_state_dict(state["module"])  # in place, as in `restart`
        self.updates = state["updates"]
