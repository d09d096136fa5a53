"""`ddp train --dry-run`: what a run would do, as preflight computed it (no checks of its own)."""

from __future__ import annotations

from typing import Any

from ddp_cli.config import RunConfig
from ddp_cli.distributed.reduce import powersgd_warmup
from ddp_cli.models import count_parameters
from ddp_cli.preflight import Preflight
from ddp_cli.train.schedules import lr_factor, warmup_steps


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


def describe(run: Preflight) -> dict[str, Any]:
    """The plan of a run that passed preflight."""
    cfg, workers, steps = run.cfg, run.workers, run.steps_per_epoch
    reduce: dict[str, Any] = {"reduce": cfg.distributed.reduce}
    if cfg.distributed.reduce == "powersgd":
        reduce["powersgd_warmup_steps"] = powersgd_warmup(cfg.distributed, steps * cfg.train.epochs)
    return {
        "name": cfg.name,
        "dataset": run.entry.name,
        "classes": len(run.index.classes),
        "splits": {split: len(frame) for split, frame in run.index.splits.items()},
        "model": cfg.model.name,
        "parameters": count_parameters(run.model),
        "weights": cfg.model.weights,
        "world_size": workers.world_size,
        "nproc_per_node": workers.nproc,
        "backend": workers.backend,
        "global_batch": run.global_batch,
        "steps_per_epoch": steps,
        "epochs": cfg.train.epochs,
        "total_steps": steps * cfg.train.epochs,
        "optimizer": cfg.optim.name,
        "lr": run.lr,
        "lr_rule": ("absolute (optim.lr)" if cfg.optim.lr is not None else
                    f"lr_per_256 {cfg.optim.lr_per_256:g} x {run.global_batch} / 256"),
        "schedule": cfg.schedule.name,
        "warmup_steps": warmup_steps(cfg.schedule, steps),
        "lr_schedule": lr_preview(cfg, run.lr, steps),
        "image_size": image_sizes(cfg),
        "data_workers": run.loaders.as_dict(),  # loader processes and prefetch per worker, and why
        "precision": workers.precision,  # "auto" resolved for this node's devices
        "channels_last": cfg.model.channels_last,
        "compile": cfg.train.compile,
        "ema_decay": cfg.train.ema_decay,
        "resume": run.resume,
        **reduce,
    }
