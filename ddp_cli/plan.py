"""`ddp train --dry-run`: what a run would do, computed as the trainer will compute it."""

from __future__ import annotations

from typing import Any

import torch

from ddp_cli.config import RunConfig
from ddp_cli.distributed.reduce import powersgd_warmup
from ddp_cli.distributed.setup import choose_backend
from ddp_cli.models import count_parameters
from ddp_cli.train.precision import resolve_precision
from ddp_cli.train.schedules import lr_factor, warmup_steps
from ddp_cli.train.trainer import count_steps


def lr_preview(cfg: RunConfig, lr: float, steps: int) -> dict[str, float]:
    """The LR at the first step, the end of warmup, a few epoch starts and the last step."""
    epochs = cfg.train.epochs
    total, warmup = steps * epochs, warmup_steps(cfg.schedule, steps)
    factor = lr_factor(cfg.schedule, steps, total)
    points = {0: "step 0 (first)", total - 1: f"step {total - 1} (last)"}
    for e in sorted({1, epochs // 4, epochs // 2, 3 * epochs // 4} - {0}):
        points.setdefault(e * steps, f"epoch {e + 1} (step {e * steps})")
    if 0 < warmup < total:
        points[warmup] = f"step {warmup} (warmup done)"
    return {label: lr * factor(step) for step, label in sorted(points.items())}


def image_sizes(cfg: RunConfig) -> dict[str, int]:
    """The train crop where it changes, and the val crop."""
    sizes, last = {}, None
    for epoch in range(cfg.train.epochs):
        size = cfg.data.train_size(epoch)
        if size != last:
            sizes[f"train from epoch {epoch + 1}"], last = size, size
    return {**sizes, "val": cfg.data.val_image_size or cfg.data.image_size}


def describe(cfg: RunConfig, model: torch.nn.Module, splits: dict[str, int], classes: int,
             nproc: int, nnodes: int) -> dict[str, Any]:
    world = nproc * nnodes
    cuda = torch.cuda.device_count() if torch.cuda.is_available() else 0
    backend = choose_backend(cfg.distributed.backend, cuda, nproc)
    precision = resolve_precision(cfg.train.precision, torch.device("cuda" if backend == "nccl" else "cpu"))
    global_batch = world * cfg.data.batch_size * cfg.train.grad_accum
    steps = count_steps(splits["train"] // world // cfg.data.batch_size, cfg.train)  # as a rank will
    lr = cfg.optim.effective_lr(global_batch)
    reduce: dict[str, Any] = {"reduce": cfg.distributed.reduce}
    if cfg.distributed.reduce == "powersgd":
        reduce["powersgd_warmup_steps"] = powersgd_warmup(cfg.distributed, steps * cfg.train.epochs)
    return {
        "name": cfg.name,
        "dataset": cfg.data.dataset,
        "classes": classes,
        "splits": splits,
        "model": cfg.model.name,
        "parameters": count_parameters(model),
        "weights": cfg.model.weights,
        "world_size": world,
        "nproc_per_node": nproc,
        "backend": backend,
        "global_batch": global_batch,
        "steps_per_epoch": steps,
        "epochs": cfg.train.epochs,
        "total_steps": steps * cfg.train.epochs,
        "optimizer": cfg.optim.name,
        "lr": lr,
        "lr_rule": ("absolute (optim.lr)" if cfg.optim.lr is not None else
                    f"lr_per_256 {cfg.optim.lr_per_256:g} x {global_batch} / 256"),
        "schedule": cfg.schedule.name,
        "warmup_steps": warmup_steps(cfg.schedule, steps),
        "lr_schedule": lr_preview(cfg, lr, steps),
        "image_size": image_sizes(cfg),
        "precision": precision,  # "auto" resolved for this node's devices
        "channels_last": cfg.model.channels_last,
        "compile": cfg.train.compile,
        "ema_decay": cfg.train.ema_decay,
        **reduce,
    }
