"""What the fast recipe changes in a freshly built network: anti-aliased downsampling and residual
branches that start at zero (`model.blurpool`, `model.zero_init_residual`; docs/recipes.md).

Both keep every parameter's name and shape, so a checkpoint, torchvision's or timm's weights and an
export see the same state dict as the plain network's; both are deterministic, so every rank builds
the same network from the same seed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# FFCV's and Zhang's (2019, "Making convolutional networks shift-invariant again") binomial filter
BLUR = torch.tensor([[1.0, 2.0, 1.0], [2.0, 4.0, 2.0], [1.0, 2.0, 1.0]]) / 16
RESIDUAL_NORMS = {"BasicBlock": "bn2", "Bottleneck": "bn3"}  # torchvision's blocks (and resnet_tiny's)
MIN_BLUR_CHANNELS = 16  # as FFCV: not the stem's RGB input, whose detail the first conv still needs


class BlurConv2d(nn.Conv2d):
    """A strided convolution that low-pass filters its input first (BlurPool, as FFCV's ResNets), so
    downsampling does not alias: better accuracy per epoch for a depthwise 3x3 blur's arithmetic.

    A subclass taking over the convolution's own parameters, not a wrapper: names stay `...conv1.weight`.
    The filter is a non-persistent buffer: it follows the module's device and dtype, and never enters a
    state dict."""

    @classmethod
    def replacing(cls, conv: nn.Conv2d) -> BlurConv2d:
        blurred = cls.__new__(cls)
        blurred.__dict__ = conv.__dict__.copy()  # the same parameters, hooks and settings
        blurred._buffers = dict(conv._buffers)
        blurred._non_persistent_buffers_set = set(conv._non_persistent_buffers_set)
        blur = BLUR.to(conv.weight.dtype).expand(conv.in_channels, 1, 3, 3).clone()
        blurred.register_buffer("blur", blur, persistent=False)
        return blurred

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.conv2d(x, self.blur, padding=1, groups=self.in_channels)  # autocast casts both alike
        return super().forward(x)


def blurs(conv: nn.Module) -> bool:
    """Whether BlurPool takes this layer: a strided 2-D convolution past the stem."""
    return (type(conv) is nn.Conv2d and max(conv.stride) > 1 and conv.in_channels >= MIN_BLUR_CHANNELS
            and conv.groups == 1)


def add_blurpool(model: nn.Module) -> int:
    """Every strided convolution past the stem made a `BlurConv2d`, in place; how many."""
    targets = [(parent, name, child) for parent in model.modules()
               for name, child in parent.named_children() if blurs(child)]
    for parent, name, child in targets:
        setattr(parent, name, BlurConv2d.replacing(child))
    return len(targets)


def zero_init_residual(model: nn.Module) -> int:
    """The last BatchNorm of every residual branch set to zero scale, so each block starts as the identity
    (Goyal et al. 2017): the signal passes the whole depth at the start and early steps are stable at a
    high LR. torchvision's BasicBlock/Bottleneck and ddp's `resnet_tiny` (`bn2`/`bn3`), timm's blocks by
    their own `zero_init_last`; how many blocks."""
    count = 0
    for module in model.modules():
        if hasattr(module, "zero_init_last") and callable(module.zero_init_last):
            module.zero_init_last()
        elif last_norm := RESIDUAL_NORMS.get(type(module).__name__):
            norm = getattr(module, last_norm, None)
            if not isinstance(norm, nn.BatchNorm2d):
                continue
            nn.init.zeros_(norm.weight)
        else:
            continue
        count += 1
    return count
