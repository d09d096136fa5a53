"""A resumed run's config reconciled with the one its checkpoint trained with, before anything is built
from it: the loaders read the decode path and the ramp's steps, so a resume must hand them the
checkpoint's (`config.resolve.resume` says which keys a resume keeps)."""

from __future__ import annotations

import logging
from pathlib import Path

import torch.distributed as dist

from ddp_cli.config import RunConfig, config_from_dict
from ddp_cli.config.resolve import decode_pending, resume
from ddp_cli.distributed.setup import DistContext
from ddp_cli.train.checkpoint import load_checkpoint

log = logging.getLogger("ddp")


def as_trained(cfg: RunConfig, ctx: DistContext, checkpoint: Path) -> RunConfig:
    """`cfg` reconciled with the config its checkpoint trained with (`config.resolve.resume`), before
    the loaders are built from it (the decode path, the ramp's steps): read by rank 0, the same on
    every rank. Says what it kept."""
    kept: list[dict | None] = [None]
    if ctx.is_main:
        saved = load_checkpoint(checkpoint).get("config")
        if saved is not None:
            kept[0] = resume(cfg, config_from_dict(saved, str(checkpoint))).model_dump(mode="json")
    dist.broadcast_object_list(kept, src=0)
    if kept[0] is None:
        return cfg
    trained = config_from_dict(kept[0], str(checkpoint))
    if ctx.is_main:
        for line in kept_lines(cfg, trained):
            log.info(line)
    return trained


def kept_lines(cfg: RunConfig, kept: RunConfig) -> list[str]:
    """What a resume keeps of the run it goes on from, where this run's config would do otherwise."""
    lines = []
    if decode_pending(cfg) and not decode_pending(kept):
        lines.append(f'data.decode "auto": "{kept.data.decode}", as the checkpoint trained (not measured '
                     "again)")
    for key in ("ramp_step", "end_image_size"):
        if getattr(kept.data, key) != getattr(cfg.data, key):
            lines.append(f"data.{key}: {getattr(kept.data, key)} px, as the checkpoint trained (this config "
                         f"derives {getattr(cfg.data, key)})")
    if kept.train.ema_bn_epochs != cfg.train.ema_bn_epochs:
        lines.append("resuming a run that trained without train.ema_bn_epochs: its EMA's BatchNorm "
                     "statistics are not recomputed, as it trained")
    return lines
