"""A model's FLOPs per image, counted by torch's own counter (`torch.utils.flop_counter`) on the meta
device: nothing is computed and no memory is taken, whatever the model's size.

A training step's FLOPs are the forward's and the backward's, both counted (the backward is about twice
the forward, less where layers are frozen: no weight gradients there). What MFU (observe/mfu.py) and
the loader rule (data/pipeline/autotune.py) read.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

BATCH = 2  # BatchNorm in train mode needs more than one value per channel


def flops_per_image(model: nn.Module, size: int, train: bool = True) -> float:
    """FLOPs of one `size` x `size` image through `model` (on the meta device), forward and, if `train`,
    backward; the meta gradients it leaves are dropped."""
    with FlopCounterMode(display=False) as counter, torch.set_grad_enabled(train):
        out = model(torch.empty(BATCH, 3, size, size, device="meta"))
        if train:
            logits = out if isinstance(out, torch.Tensor) else out[0]  # inception_v3's (logits, aux)
            logits.float().sum().backward()
    if train:
        model.zero_grad(set_to_none=True)
    return counter.get_total_flops() / BATCH
