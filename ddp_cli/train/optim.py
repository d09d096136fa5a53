"""Optimisers with the usual ImageNet parameter groups and the linear LR scaling rule.

Each group carries an `lr_scale` (its LR is the schedule's times that: the
classifier head's `optim.head_lr_mult`, a ViT layer's `optim.layer_decay`
power) and a `frozen_epochs` (the schedule holds its LR at 0 that long:
`model.freeze` with `model.freeze_epochs`); `schedules.build_scheduler`
reads both.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ddp_cli.config import ModelConfig, OptimConfig
from ddp_cli.errors import ConfigError
from ddp_cli.models.finetune import classifier_head, frozen_parameters, vit_depth, vit_layer
from ddp_cli.train.large_batch import Lamb, Lars


def param_groups(model: nn.Module, cfg: OptimConfig, model_cfg: ModelConfig | None = None) -> list[dict]:
    """The trainable parameters, grouped by LR scale, weight decay, kind and freezing.

    Matrices and kernels get a LARS/LAMB trust ratio, 1-d tensors (norm weights,
    biases) never do (their norm says nothing about a good step size) and get no
    weight decay unless `decay_norm_and_bias`; names containing an `optim.no_decay`
    substring get none either. The first group is the body's (scale 1, not frozen)
    where there is one: its LR is the one metrics report.
    """
    frozen = set(frozen_parameters(model, model_cfg)) if model_cfg and model_cfg.freeze_epochs else set()
    scale = lr_scales(model, cfg)
    groups: dict[tuple, dict] = {}
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        matrix = param.ndim > 1
        decay = cfg.weight_decay if (matrix or cfg.decay_norm_and_bias) and not any(
            part in name for part in cfg.no_decay) else 0.0
        until = model_cfg.freeze_epochs if name in frozen else 0
        key = (scale(name), decay, matrix, until)
        groups.setdefault(key, {"params": [], "weight_decay": decay, "trust_ratio": matrix,
                                "lr_scale": key[0], "frozen_epochs": until})["params"].append(param)
    return sorted(groups.values(), key=lambda g: (g["frozen_epochs"] > 0, g["lr_scale"] != 1,
                                                  not g["trust_ratio"]))


def lr_scales(model: nn.Module, cfg: OptimConfig) -> Callable[[str], float]:
    """Each parameter's LR as a multiple of the schedule's: `head_lr_mult` for the classifier head, times
    `layer_decay` ** (L + 1 - its layer) in a ViT of L blocks (BEiT's layer-wise decay: the head at 1)."""
    head = classifier_head(model) + "." if cfg.head_lr_mult != 1 else None
    depth = vit_depth(model, type(model).__name__) if cfg.layer_decay != 1 else 0

    def scale(name: str) -> float:
        mult = cfg.head_lr_mult if head and name.startswith(head) else 1.0
        return mult * cfg.layer_decay ** (depth + 1 - vit_layer(name, depth)) if depth else mult

    return scale


def check_optimizer(cfg: OptimConfig) -> None:
    """What torch would refuse only when the optimiser is built in a worker (preflight calls it)."""
    if cfg.name == "sgd" and cfg.nesterov and not cfg.momentum:
        raise ConfigError("optim.nesterov: needs optim.momentum > 0")


def state_copies(cfg: OptimConfig) -> int:
    """How many tensors the size of each parameter the optimiser keeps (what it adds to a checkpoint)."""
    if cfg.name in ("adamw", "lamb"):
        return 2  # the two moments
    if cfg.name == "rmsprop":
        return 1 + bool(cfg.momentum)  # the square average, and a momentum buffer if any
    return 1 if cfg.name == "lars" or cfg.momentum else 0  # a momentum buffer


def build_optimizer(cfg: OptimConfig, model: nn.Module, lr: float,
                    model_cfg: ModelConfig | None = None) -> torch.optim.Optimizer:
    """The optimiser over `param_groups`, each group starting at `lr` x its `lr_scale` (the LR the
    scheduler's factors multiply)."""
    check_optimizer(cfg)
    groups = param_groups(model, cfg, model_cfg)
    for group in groups:
        group["lr"] = lr * group["lr_scale"]
    if cfg.name == "adamw":
        return torch.optim.AdamW(groups, lr=lr, betas=tuple(cfg.betas), eps=cfg.eps)
    if cfg.name == "lamb":
        return Lamb(groups, lr=lr, betas=tuple(cfg.betas))
    if cfg.name == "lars":
        return Lars(groups, lr=lr, momentum=cfg.momentum, trust_coefficient=cfg.trust_coefficient)
    if cfg.name == "rmsprop":
        return torch.optim.RMSprop(groups, lr=lr, alpha=cfg.alpha, eps=cfg.eps, momentum=cfg.momentum)
    return torch.optim.SGD(groups, lr=lr, momentum=cfg.momentum, nesterov=cfg.nesterov)
