"""Gradient reduction, the seeds' `sync_buffer`: how DDP combines gradients across replicas.

DDP all-reduces gradients in buckets (`bucket_cap_mb`) while backward is still
running; a communication hook decides what travels and how it is combined.

- mean (default): all-reduce and divide by the world size. The only choice that
  makes k replicas with batch b equal one process with batch k*b.
- sum: all-reduce without dividing; every step is world-size times larger (as
  if the LR were multiplied by the world size).
- fp16 / bf16: cast each bucket to 16 bits for the wire, then mean; half the
  traffic, at the cost of gradient precision (fp16: 11-bit mantissa but a small
  range, tiny gradients flush to zero; bf16: fp32's range, 8-bit mantissa).
- powersgd (Vogels et al. 2019): after `powersgd_warmup_steps` exact steps,
  each gradient matrix travels as a rank-`powersgd_rank` factorisation with
  error feedback (what was left out is added to the next step); 1-d tensors
  stay exact. Far less traffic, approximate steps, extra memory for the errors.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel

from ddp_cli.config import DistributedConfig

POWERSGD_MAX_WARMUP = 1000


def _sum_hook(state, bucket):  # no annotations: DDP rejects the strings `from __future__` makes
    """All-reduce a dist.GradBucket without dividing; returns a Future of the summed buffer."""
    work = dist.all_reduce(bucket.buffer(), async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


def powersgd_warmup(cfg: DistributedConfig, total_steps: int) -> int:
    """Exact steps before PowerSGD compresses: as configured, else 10% of the run (2 to 1000).

    A fixed 1000 would outlast a short run, which would then never compress.
    """
    if cfg.powersgd_warmup_steps is not None:
        return cfg.powersgd_warmup_steps
    return max(2, min(POWERSGD_MAX_WARMUP, total_steps // 10))


def register_reduction(model: DistributedDataParallel, cfg: DistributedConfig, total_steps: int) -> None:
    """Install the communication hook named by `distributed.reduce` (mean needs none)."""
    if cfg.reduce == "sum":
        model.register_comm_hook(None, _sum_hook)
    elif cfg.reduce == "fp16":
        model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif cfg.reduce == "bf16":
        model.register_comm_hook(None, default_hooks.bf16_compress_hook)
    elif cfg.reduce == "powersgd":
        state = powerSGD_hook.PowerSGDState(
            process_group=None, matrix_approximation_rank=cfg.powersgd_rank,
            start_powerSGD_iter=powersgd_warmup(cfg, total_steps),
        )
        model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)


def replicate(model: nn.Module, cfg: DistributedConfig, device: torch.device,
              total_steps: int) -> DistributedDataParallel:
    """DDP around `model` (rank 0's weights broadcast to all) with the configured reduction."""
    ddp = DistributedDataParallel(
        model,
        device_ids=[device] if device.type == "cuda" else None,
        bucket_cap_mb=cfg.bucket_cap_mb,
        gradient_as_bucket_view=cfg.gradient_as_bucket_view,
        static_graph=cfg.static_graph,
    )
    register_reduction(ddp, cfg, total_steps)
    return ddp
