"""Gradient reduction, the seeds' `sync_buffer`: how DDP averages gradients across replicas.

- mean (default): all-reduce and divide by the world size. The only choice that
  makes k replicas with batch b equal one process with batch k*b.
- sum: all-reduce without dividing; the effective LR is world-size times larger.
- fp16 / bf16: compress each bucket to 16 bits for the wire, then mean; halves
  traffic, costs gradient precision (bf16 keeps fp32's range, fp16 its precision).
- powersgd: rank-1 low-rank approximation after 1,000 exact steps (with error
  feedback); far less traffic, approximate gradients.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel

POWERSGD_WARM_STEPS = 1000


def _sum_hook(state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    work = dist.all_reduce(bucket.buffer(), async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


def register_reduction(model: DistributedDataParallel, reduce: str) -> None:
    """Install the communication hook named by `distributed.reduce` (mean needs none)."""
    if reduce == "sum":
        model.register_comm_hook(None, _sum_hook)
    elif reduce == "fp16":
        model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif reduce == "bf16":
        model.register_comm_hook(None, default_hooks.bf16_compress_hook)
    elif reduce == "powersgd":
        state = powerSGD_hook.PowerSGDState(
            process_group=None, matrix_approximation_rank=1,
            start_powerSGD_iter=POWERSGD_WARM_STEPS,
        )
        model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
