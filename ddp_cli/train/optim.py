"""Optimisers with the usual ImageNet parameter groups and the linear LR scaling rule."""

from __future__ import annotations

import torch
from torch import nn

from ddp_cli.config import OptimConfig


def param_groups(model: nn.Module, weight_decay: float, decay_all: bool) -> list[dict]:
    """Norm weights and biases (1-d tensors) get no weight decay unless asked."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if decay_all or p.ndim > 1 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


def build_optimizer(cfg: OptimConfig, model: nn.Module, lr: float) -> torch.optim.Optimizer:
    groups = param_groups(model, cfg.weight_decay, cfg.decay_norm_and_bias)
    if cfg.name == "adamw":
        return torch.optim.AdamW(groups, lr=lr)
    return torch.optim.SGD(groups, lr=lr, momentum=cfg.momentum, nesterov=cfg.nesterov)
