"""Optimisers with the usual ImageNet parameter groups and the linear LR scaling rule."""

from __future__ import annotations

import torch
from torch import nn

from ddp_cli.config import OptimConfig
from ddp_cli.errors import ConfigError
from ddp_cli.train.large_batch import Lamb, Lars


def param_groups(model: nn.Module, weight_decay: float, decay_all: bool) -> list[dict]:
    """Matrices and kernels, then norm weights and biases (1-d tensors).

    The 1-d group gets no weight decay unless `decay_all`, and never a LARS/LAMB
    trust ratio (its norm says nothing about a good step size).
    """
    tensors, vectors = [], []
    for p in model.parameters():
        if p.requires_grad:
            (tensors if p.ndim > 1 else vectors).append(p)
    groups = [{"params": tensors, "weight_decay": weight_decay, "trust_ratio": True}]
    if vectors:
        groups.append({"params": vectors, "weight_decay": weight_decay if decay_all else 0.0,
                       "trust_ratio": False})
    return groups


def check_optimizer(cfg: OptimConfig) -> None:
    """What torch would refuse only when the optimiser is built in a worker (preflight calls it)."""
    if cfg.name == "sgd" and cfg.nesterov and not cfg.momentum:
        raise ConfigError("optim.nesterov: needs optim.momentum > 0")


def build_optimizer(cfg: OptimConfig, model: nn.Module, lr: float) -> torch.optim.Optimizer:
    check_optimizer(cfg)
    groups = param_groups(model, cfg.weight_decay, cfg.decay_norm_and_bias)
    if cfg.name == "adamw":
        return torch.optim.AdamW(groups, lr=lr, betas=tuple(cfg.betas))
    if cfg.name == "lamb":
        return Lamb(groups, lr=lr, betas=tuple(cfg.betas))
    if cfg.name == "lars":
        return Lars(groups, lr=lr, momentum=cfg.momentum, trust_coefficient=cfg.trust_coefficient)
    return torch.optim.SGD(groups, lr=lr, momentum=cfg.momentum, nesterov=cfg.nesterov)
