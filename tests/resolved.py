"""A run config resolved as preflight resolves it, for tests that build a Trainer or loaders without one."""

from __future__ import annotations

import torch

from ddp_cli.config import RunConfig
from ddp_cli.config.resolve import Facts, resolve
from ddp_cli.train.precision import native_precision


def resolved(cfg: RunConfig, steps_per_epoch: int = 1, world_size: int = 1, device: str = "cpu",
             loader_workers: int = 0) -> RunConfig:
    """`cfg` with its "auto" and derived keys made concrete for a run of `steps_per_epoch` steps an epoch
    on `world_size` workers of `device` (its native precision: bf16 where a CPU has AVX-512 BF16)."""
    facts = Facts(device, native_precision(torch.device(device)), world_size, steps_per_epoch,
                  loader_workers=loader_workers)
    return resolve(cfg, facts)
