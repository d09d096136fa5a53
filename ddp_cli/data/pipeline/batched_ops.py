"""Augmentation calls replayed on a group of images at once, each image with its own magnitude (the GPU
decode's render, `device_decode.replay_grouped`).

Policies draw a magnitude per image: FixMatch's strong view a RandAugment magnitude from 1-30,
TrivialAugment one of 31 bins, colour jitter a continuous factor, Cutout and erasing a box. Grouping
only the calls that are equal leaves most images a call (and its launches) of their own, so a batch's
launches would grow with it. Here each functional's calls, whatever their magnitudes, are one group:
v2's tensor kernels written with the per-image numbers as a column of a tensor (one host-to-device copy
of the group's table), so the launches a batch are a few per functional the policy knows. The arithmetic
is v2's, in float32 with the factor a tensor instead of a Python number: the pixels equal v2's up to
float rounding, one level at most (tests/unit/test_device_decode.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.nn.functional import conv2d, grid_sample
from torchvision.transforms.v2 import functional as F
from torchvision.transforms.v2.functional._color import _rgb_to_grayscale_image
from torchvision.transforms.v2.functional._geometry import _get_inverse_affine_matrix

from ddp_cli.data.pipeline.batched_resize import host_tensor, to_device

Calls = list[dict[str, Any]]  # the recorded keyword arguments of each image of a group


@dataclass(frozen=True)
class Batched:
    """A functional's batched kernel: `per_image` its arguments that vary between images; `takes` whether
    a recorded call is one the kernel covers (else it is replayed as recorded, equal calls together)."""

    per_image: tuple[str, ...]
    kernel: Callable[[torch.Tensor, Calls], torch.Tensor]  # N x C x H x W uint8 and its calls -> the same
    takes: Callable[[dict[str, Any]], bool] = lambda kwargs: True


def column(calls: Calls, key: str, device: torch.device) -> torch.Tensor:
    """N x 1 x 1 x 1 float32: each call's `key`."""
    return host_tensor([float(call[key]) for call in calls], device).view(-1, 1, 1, 1)


def blend(images: torch.Tensor, other: torch.Tensor, calls: Calls, key: str) -> torch.Tensor:
    """v2's `_blend` (ratio x image + (1 - ratio) x other), each image its own ratio (1 - ratio taken in
    double precision on the host, as v2 takes it)."""
    weights = host_tensor([[float(call[key]), 1.0 - float(call[key])] for call in calls], images.device)
    ratio, rest = (weights[:, k].view(-1, 1, 1, 1) for k in range(2))
    return images.mul(ratio).add_(other.mul(rest)).clamp_(0, 255).to(images.dtype)


def grey(images: torch.Tensor) -> torch.Tensor:
    return _rgb_to_grayscale_image(images, num_output_channels=1, preserve_dtype=False).floor_()


def brightness(images: torch.Tensor, calls: Calls) -> torch.Tensor:
    return images.mul(column(calls, "brightness_factor", images.device)).clamp_(0, 255).to(images.dtype)


def saturation(images: torch.Tensor, calls: Calls) -> torch.Tensor:
    return blend(images, grey(images), calls, "saturation_factor")


def contrast(images: torch.Tensor, calls: Calls) -> torch.Tensor:
    return blend(images, grey(images).mean(dim=(-3, -2, -1), keepdim=True), calls, "contrast_factor")


def sharpness(images: torch.Tensor, calls: Calls) -> torch.Tensor:
    """v2's: the inner pixels blended with a 3 x 3 smoothing (1s around a 5, over 13), the border kept."""
    if images.shape[-1] <= 2 or images.shape[-2] <= 2:
        return images
    kernel = host_tensor([[1 / 13, 1 / 13, 1 / 13], [1 / 13, 5 / 13, 1 / 13], [1 / 13, 1 / 13, 1 / 13]],
                         images.device).expand(3, 1, 3, 3)
    output = images.to(torch.float32, copy=True)
    blurred = conv2d(output, kernel, groups=3).round_()
    inner = output[..., 1:-1, 1:-1]
    rest = host_tensor([1.0 - float(call["sharpness_factor"]) for call in calls], images.device)
    inner.add_(blurred.sub_(inner).mul_(rest.view(-1, 1, 1, 1)))
    return output.clamp_(0, 255).to(images.dtype)


def posterize(images: torch.Tensor, calls: Calls) -> torch.Tensor:
    masks = [((1 << call["bits"]) - 1) << (8 - call["bits"]) if call["bits"] < 8 else 255 for call in calls]
    return images & host_tensor(masks, images.device, torch.uint8).view(-1, 1, 1, 1)


def solarize(images: torch.Tensor, calls: Calls) -> torch.Tensor:
    return torch.where(images >= column(calls, "threshold", images.device), 255 - images, images)


def centre(call: dict[str, Any], width: int, height: int) -> list[float]:
    """The call's centre as v2's kernels take it: from the image's middle (RandAugment shears about the
    top left corner)."""
    if call.get("center") is None:
        return [0.0, 0.0]
    return [c - s * 0.5 for c, s in zip(call["center"], (width, height), strict=True)]


def affine_matrix(call: dict[str, Any], width: int, height: int) -> list[float]:
    """The inverse matrix v2's affine kernel samples with."""
    return _get_inverse_affine_matrix(centre(call, width, height), float(call["angle"]),
                                      [float(t) for t in call["translate"]], float(call["scale"]),
                                      [float(s) for s in call["shear"]])


def rotation_matrix(call: dict[str, Any], width: int, height: int) -> list[float]:
    """v2's rotate kernel's: an affine by the opposite angle."""
    return _get_inverse_affine_matrix(centre(call, width, height), -(float(call["angle"]) % 360), [0.0, 0.0],
                                      1.0, [0.0, 0.0])


def warp(matrix: Callable[[dict[str, Any], int, int], list[float]]
         ) -> Callable[[torch.Tensor, Calls], torch.Tensor]:
    """v2's affine and rotate kernels (`_affine_grid`, `_apply_grid_transform` without a fill colour), one
    matrix an image: one grid for the group and one `grid_sample`."""
    def kernel(images: torch.Tensor, calls: Calls) -> torch.Tensor:
        n, _, h, w = images.shape
        device = images.device
        theta = host_tensor([matrix(call, w, h) for call in calls], device).view(n, 2, 3)
        base = torch.empty(1, h, w, 3, device=device)
        base[..., 0].copy_(torch.linspace((1.0 - w) * 0.5, (w - 1.0) * 0.5, steps=w, device=device))
        ys = torch.linspace((1.0 - h) * 0.5, (h - 1.0) * 0.5, steps=h, device=device)
        base[..., 1].copy_(ys.unsqueeze_(-1))
        base[..., 2].fill_(1)
        halves = host_tensor([0.5 * w, 0.5 * h], device)
        grid = base.view(1, h * w, 3).matmul(theta.transpose(1, 2).div_(halves))
        mode = calls[0]["interpolation"].value
        out = grid_sample(images.to(torch.float32), grid.view(n, h, w, 2), mode=mode, padding_mode="zeros",
                          align_corners=False)
        return out.round_().to(images.dtype)
    return kernel


def unfilled(kwargs: dict[str, Any]) -> bool:
    """A warp onto the image's own size, outside it black (as the policies ask)."""
    return kwargs.get("fill") is None and not kwargs.get("expand", False) \
        and str(kwargs["interpolation"].value) in ("nearest", "bilinear")


def erase(images: torch.Tensor, calls: Calls) -> torch.Tensor:
    """Each image's box filled with its one colour: a mask from a table of the boxes."""
    n, _, h, w = images.shape
    device = images.device
    boxes = host_tensor([[call["i"], call["j"], call["h"], call["w"]] for call in calls], device)
    top, left, height, width = (boxes[:, k].view(-1, 1, 1, 1) for k in range(4))
    y = torch.arange(h, device=device).view(1, 1, -1, 1)
    x = torch.arange(w, device=device).view(1, 1, 1, -1)
    inside = (y >= top) & (y < top + height) & (x >= left) & (x < left + width)
    colours = to_device(torch.stack([call["v"].expand(3, 1, 1) for call in calls]).to(images.dtype), device)
    return torch.where(inside, colours, images)


def one_colour(kwargs: dict[str, Any]) -> bool:
    return kwargs["v"].shape[-2:] == (1, 1)


BATCHED: dict[Callable, Batched] = {
    F.adjust_brightness: Batched(("brightness_factor",), brightness),
    F.adjust_saturation: Batched(("saturation_factor",), saturation),
    F.adjust_contrast: Batched(("contrast_factor",), contrast),
    F.adjust_sharpness: Batched(("sharpness_factor",), sharpness),
    F.posterize: Batched(("bits",), posterize),
    F.solarize: Batched(("threshold",), solarize),
    F.affine: Batched(("angle", "translate", "scale", "shear", "center"), warp(affine_matrix), unfilled),
    F.rotate: Batched(("angle", "center"), warp(rotation_matrix), unfilled),
    F.erase: Batched(("i", "j", "h", "w", "v"), erase, one_colour),  # a box of one colour: Cutout, erasing's
}
