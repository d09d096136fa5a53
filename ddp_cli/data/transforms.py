"""Train and val pipelines: PIL crop+resize in one call, uint8 out, normalise on device.

Workers ship uint8 HWC tensors (4x less to copy and pin than float); the
device does `permute` (which yields channels_last strides for free), the
float conversion and the ImageNet normalisation.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from PIL import Image
from torchvision.transforms import RandomResizedCrop

from ddp_cli.data.images import finish, shrink_on_decode

MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)
RESAMPLE = Image.Resampling.BILINEAR


class TrainTransform:
    """RandomResizedCrop + optional horizontal flip, decoding only as many pixels as needed."""

    def __init__(self, size: int, min_scale: float = 0.08, hflip: bool = True) -> None:
        self.size, self.scale, self.hflip = size, (min_scale, 1.0), hflip
        self.ratio = (3 / 4, 4 / 3)

    def __call__(self, img: Image.Image) -> torch.Tensor:
        top, left, h, w = RandomResizedCrop.get_params(img, list(self.scale), list(self.ratio))
        full_w, full_h = img.size
        reduce = min(w, h) / self.size
        k = shrink_on_decode(img, math.ceil(full_w / reduce), math.ceil(full_h / reduce))
        box = (left * k, top * k, (left + w) * k, (top + h) * k)
        out = finish(img).resize((self.size, self.size), RESAMPLE, box=box)
        if self.hflip and torch.rand(()) < 0.5:
            out = out.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        return to_uint8(out)


class ValTransform:
    """Resize the shorter side to `resize`, center-crop `size`: one resize call."""

    def __init__(self, size: int, resize: int) -> None:
        self.size, self.resize = size, resize

    def __call__(self, img: Image.Image) -> torch.Tensor:
        full_w, full_h = img.size
        scale = self.resize / min(full_w, full_h)
        k = shrink_on_decode(img, math.ceil(full_w * scale), math.ceil(full_h * scale))
        side = self.size / scale  # crop side in original pixels
        left, top = (full_w - side) / 2, (full_h - side) / 2
        box = (left * k, top * k, (left + side) * k, (top + side) * k)
        return to_uint8(finish(img).resize((self.size, self.size), RESAMPLE, box=box))


def to_uint8(img: Image.Image) -> torch.Tensor:
    return torch.from_numpy(np.asarray(img, dtype=np.uint8).copy())


def to_model_input(
    images: torch.Tensor, device: torch.device, channels_last: bool
) -> torch.Tensor:
    """uint8 NHWC batch -> normalised float NCHW on `device` (channels_last if asked)."""
    x = images.to(device, non_blocking=True).permute(0, 3, 1, 2).float()
    mean = torch.tensor(MEAN, device=device).view(1, 3, 1, 1) * 255
    std = torch.tensor(STD, device=device).view(1, 3, 1, 1) * 255
    x = (x - mean) / std
    return x.contiguous(memory_format=torch.channels_last if channels_last else
                        torch.contiguous_format)
