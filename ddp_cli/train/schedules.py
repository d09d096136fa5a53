"""LR schedules as a factor of the peak LR, evaluated every optimisation step."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch.optim.lr_scheduler import LambdaLR

from ddp_cli.config import ScheduleConfig

ONECYCLE_START = 1 / 25  # torch's OneCycleLR div_factor
ONECYCLE_END = 1e-4


def warmup_steps(cfg: ScheduleConfig, steps_per_epoch: int) -> int:
    return cfg.warmup_steps or round(cfg.warmup_epochs * steps_per_epoch)


def lr_factor(cfg: ScheduleConfig, steps_per_epoch: int, total_steps: int) -> Callable[[int], float]:
    """factor(step) in [0, 1]: linear warmup, then the named shape over the remaining steps."""
    warmup = warmup_steps(cfg, steps_per_epoch)
    floor = cfg.min_lr_ratio

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        epoch = step / steps_per_epoch
        t = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        if cfg.name == "step":
            return cfg.gamma ** math.floor(epoch / cfg.step_epochs)
        if cfg.name == "multistep":
            return cfg.gamma ** sum(epoch >= m for m in cfg.milestones)
        if cfg.name == "exponential":
            return cfg.gamma ** ((step - warmup) / steps_per_epoch)
        if cfg.name == "cosine":
            return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * t))
        if cfg.name == "poly":
            return floor + (1 - floor) * (1 - t) ** cfg.power
        if cfg.name == "onecycle":
            if t < cfg.pct_start:
                return ONECYCLE_START + (1 - ONECYCLE_START) * t / cfg.pct_start
            down = (t - cfg.pct_start) / (1 - cfg.pct_start)
            return ONECYCLE_END + (1 - ONECYCLE_END) * 0.5 * (1 + math.cos(math.pi * down))
        return 1.0

    return factor


def build_scheduler(
    optimizer: torch.optim.Optimizer, cfg: ScheduleConfig, steps_per_epoch: int, total_steps: int
) -> LambdaLR:
    """One factor per parameter group, the schedule's; LambdaLR multiplies it into the group's initial LR,
    which holds the group's `lr_scale` (`optim.build_optimizer`)."""
    factor = lr_factor(cfg, steps_per_epoch, total_steps)
    return LambdaLR(optimizer, [held_at_zero(factor, group.get("frozen_epochs", 0) * steps_per_epoch)
                                for group in optimizer.param_groups])


def held_at_zero(factor: Callable[[int], float], steps: int) -> Callable[[int], float]:
    """`factor`, but 0 for the first `steps` steps: a group frozen for the first epochs
    (`model.freeze_epochs`) moves neither by its gradient nor by weight decay or momentum, as every
    update of every optimiser here is scaled by the LR."""
    return factor if not steps else lambda step: 0.0 if step < steps else factor(step)


def lr_at(cfg: ScheduleConfig, steps_per_epoch: int, total_steps: int, peak: float, step: int,
          frozen_epochs: int = 0) -> float:
    """The LR `build_scheduler` gives a group of peak LR `peak` at `step`, without an optimiser (a plan)."""
    factor = held_at_zero(lr_factor(cfg, steps_per_epoch, total_steps), frozen_epochs * steps_per_epoch)
    return peak * factor(step)


def resume_schedule(scheduler: LambdaLR, peak_ratio: float, step: int) -> None:
    """Go on at `step` with every group's peak LR times `peak_ratio`: a resume at another world size,
    where the steps per epoch (and with lr_per_256 the peak LR) changed. LambdaLR keeps the peak in
    `base_lrs` and in each group's `initial_lr`, and sets a group's `lr` only when stepped, so all three
    are rewritten."""
    scheduler.base_lrs = [base * peak_ratio for base in scheduler.base_lrs]
    scheduler.last_epoch = step
    for group, base, factor in zip(scheduler.optimizer.param_groups, scheduler.base_lrs,
                                   scheduler.lr_lambdas, strict=True):
        group["initial_lr"], group["lr"] = base, base * factor(step)
