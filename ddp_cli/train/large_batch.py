"""LARS and LAMB: a per-layer trust ratio scales each step, for very large global batches.

At a batch of 8k-32k images one global learning rate is too large for some
layers and too small for others; both optimisers rescale each tensor's step by
how large the tensor is relative to its update.

- LARS, You, Gitman and Ginsburg 2017, "Large Batch Training of Convolutional
  Networks" (arXiv:1708.03888), Algorithm 1: with weight decay beta and trust
  coefficient eta, local_lr = eta * ||w|| / (||g|| + beta * ||w||) and the step
  is local_lr * (g + beta * w) through momentum. As torch's SGD (and NVIDIA's
  LARC), the global lr multiplies the momentum buffer on the way out rather than
  entering it, which is the paper's update whenever the lr is constant.
- LAMB, You et al. 2019, "Large Batch Optimization for Deep Learning: Training
  BERT in 76 minutes" (arXiv:1904.00962), Algorithm 2: the bias-corrected Adam
  direction r = m_hat / (sqrt(v_hat) + eps) plus decoupled decay, u = r + beta * w,
  scaled by ||w|| / ||u|| (phi = identity, as in the reference implementations).

A ratio is 1 when either norm is 0 (a zero-initialised layer must still move).
Groups with `trust_ratio = False` (ddp puts BatchNorm/LayerNorm weights and
biases there, as Jia et al. 2018 did for LARS and the LAMB reference does) take
the plain step: LARS becomes SGD with momentum, LAMB becomes AdamW.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch.optim import Optimizer


def trust_ratio(weights: torch.Tensor, update_norm: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """scale * ||w|| / update_norm, or 1 when either is 0; stays on the device (no sync)."""
    w_norm = weights.norm()
    ratio = scale * w_norm / update_norm
    return torch.where((w_norm > 0) & (update_norm > 0), ratio, torch.ones_like(ratio))


class LayerwiseOptimizer(Optimizer):
    """One step = each parameter with a gradient updated by `update`, group by group."""

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self.update(p, group)
        return loss

    def update(self, p: torch.Tensor, group: dict) -> None:
        raise NotImplementedError


class Lars(LayerwiseOptimizer):
    def __init__(self, params: Iterable, lr: float, momentum: float = 0.9, weight_decay: float = 0.0,
                 trust_coefficient: float = 0.001) -> None:
        defaults = {"lr": lr, "momentum": momentum, "weight_decay": weight_decay,
                    "trust_coefficient": trust_coefficient, "trust_ratio": True}
        super().__init__(params, defaults)

    def update(self, p: torch.Tensor, group: dict) -> None:
        decay = group["weight_decay"]
        step = p.grad.add(p, alpha=decay)
        if group["trust_ratio"]:
            g_norm = p.grad.norm()
            step.mul_(trust_ratio(p, g_norm + decay * p.norm(), group["trust_coefficient"]))
        if group["momentum"]:
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = step.clone()
            else:
                state["momentum_buffer"].mul_(group["momentum"]).add_(step)
            step = state["momentum_buffer"]
        p.add_(step, alpha=-group["lr"])


class Lamb(LayerwiseOptimizer):
    def __init__(self, params: Iterable, lr: float, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-6, weight_decay: float = 0.0) -> None:
        defaults = {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay,
                    "trust_ratio": True}
        super().__init__(params, defaults)

    def update(self, p: torch.Tensor, group: dict) -> None:
        beta1, beta2 = group["betas"]
        state = self.state[p]
        if not state:
            state["step"] = 0
            state["exp_avg"] = torch.zeros_like(p)
            state["exp_avg_sq"] = torch.zeros_like(p)
        state["step"] += 1
        m, v, t = state["exp_avg"], state["exp_avg_sq"], state["step"]
        m.lerp_(p.grad, 1 - beta1)
        v.mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
        update = (m / (1 - beta1**t)) / ((v / (1 - beta2**t)).sqrt() + group["eps"])
        update.add_(p, alpha=group["weight_decay"])
        if group["trust_ratio"]:
            update.mul_(trust_ratio(p, update.norm()))
        p.add_(update, alpha=-group["lr"])
