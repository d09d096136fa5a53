"""Train and val pipelines: decode only the pixels needed, crop+resize in one call, uint8 out.

Each pipeline knows its crop before decoding, so the decoder can shrink the
image in the DCT (`images.decode`): the crop is drawn first (`TrainTransform.plan`,
with the flip and the augmentation's draws), then rendered (`render`) or, with
data.decode = "gpu", handed over compressed for the rank to render on its device
(`Deferred`, `device_decode.py`). The crop and resize are one
antialiased bilinear `interpolate` on uint8 (PyTorch's vectorised path, the
same filter as PIL's, several times faster; bicubic too, PIL's filter to the
pixel, overshoot saturated). The train crop then gets the run's per-image
augmentation (`augment.py`). Workers ship uint8 HWC tensors
(4x less to copy and pin than float); the device does the `permute` (which
yields channels_last strides for free), the float conversion and the
normalisation (ImageNet's, or the run's `data.mean` and `data.std`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from ddp_cli.config import DataConfig
from ddp_cli.data.pipeline.images import EncodedImage, decode, device_decodable

MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)
Norm = tuple[tuple[float, ...], tuple[float, ...]]  # (mean, std) per channel, of 0-1 pixels
IMAGENET: Norm = (MEAN, STD)


def normalising(data: DataConfig) -> Norm:
    """The run's (mean, std): `data.mean` and `data.std` where set (a timm model's weights set them), else
    ImageNet's."""
    return data.mean or MEAN, data.std or STD


class Augment(Protocol):
    """The per-image augmentation (`augment.Augmentation`): its draws apart from its pixels."""

    def plan(self, size: int) -> Any: ...

    def apply(self, hwc: torch.Tensor, steps: Any) -> torch.Tensor: ...


@dataclass(frozen=True)
class Plan:
    """Every random draw of one training image, made in the loader process from the seeded stream."""

    box: tuple[float, float, float, float]  # the crop: top, left, height, width in the source's pixels
    flip: bool
    size: int  # the output side
    steps: Any = None  # the augmentation's draws (`augment.Steps`), None without one


@dataclass(frozen=True)
class Deferred:
    """An image the rank decodes and renders on its device (data.decode = "gpu"): its compressed bytes
    and its plan; where it was read, and the bad-image policy, should the device's decoder refuse it."""

    data: bytes
    plan: Plan
    interpolation: str
    where: str = ""
    on_bad_image: str = "error"
    more: tuple[Plan, ...] = ()  # more views of the same image (FixMatch's strong view), from its one decode

    def located(self, where: str, on_bad_image: str) -> Deferred:
        return replace(self, where=where, on_bad_image=on_bad_image)

    @property
    def plans(self) -> tuple[Plan, ...]:
        """Its views' plans, in their order in the batch."""
        return self.plan, *self.more


class TrainTransform:
    """RandomResizedCrop + optional horizontal flip, decoding only as many pixels as needed, then
    `augment` (uint8 HWC in and out). With `defer` (data.decode = "gpu"), a JPEG the device's decoder
    takes comes out `Deferred` instead, drawn alike; any other image is rendered here."""

    def __init__(self, size: int, min_scale: float = 0.08, hflip: bool = True,
                 interpolation: str = "bilinear", augment: Augment | None = None,
                 defer: bool = False, dct_scaling: bool = True) -> None:
        self.size, self.scale, self.hflip = size, (min_scale, 1.0), hflip
        self.ratio = (3 / 4, 4 / 3)
        self.interpolation, self.augment, self.defer = interpolation, augment, defer
        self.dct_scaling = dct_scaling  # off: every image decoded whole (`ddp bench data --full-decode`)

    def __call__(self, img: EncodedImage) -> torch.Tensor | Deferred:
        plan = self.plan(img)
        if self.defer and device_decodable(img):
            return Deferred(img.data, plan, self.interpolation)
        return self.render(img, plan)

    def plan(self, img: EncodedImage) -> Plan:
        """The draws, in their order since ddp began: the crop, the flip, the augmentation's."""
        box = random_resized_crop(img.width, img.height, self.scale, self.ratio)
        flip = bool(self.hflip and torch.rand(()) < 0.5)
        return Plan(box, flip, self.size, self.augment.plan(self.size) if self.augment else None)

    def render(self, img: EncodedImage, plan: Plan) -> torch.Tensor:
        """The planned crop, decoded at the smallest DCT scale that still covers it at `plan.size`."""
        top, left, h, w = plan.box
        reduce = min(w, h) / plan.size if self.dct_scaling else 1.0
        pixels, k = decode(img, math.ceil(img.width / reduce), math.ceil(img.height / reduce))
        out = crop_resize(pixels, (top * k, left * k, h * k, w * k), plan.size, self.interpolation)
        if plan.flip:
            out = out.flip(1)
        return self.augment.apply(out, plan.steps) if self.augment else out


class ValTransform:
    """Resize the shorter side to `resize`, center-crop `size`: one resize call. With `defer` (data.decode =
    "gpu"), a JPEG the device's decoder takes comes out `Deferred` (its crop, no flip, no augmentation):
    the rank renders validation's batch on its device as it does training's."""

    def __init__(self, size: int, resize: int, interpolation: str = "bilinear", defer: bool = False) -> None:
        self.size, self.resize, self.interpolation, self.defer = size, resize, interpolation, defer

    def __call__(self, img: EncodedImage) -> torch.Tensor | Deferred:
        scale = self.resize / min(img.width, img.height)
        side = self.size / scale  # crop side in original pixels
        box = ((img.height - side) / 2, (img.width - side) / 2, side, side)
        if self.defer and device_decodable(img):
            return Deferred(img.data, Plan(box, False, self.size), self.interpolation)
        pixels, k = decode(img, math.ceil(img.width * scale), math.ceil(img.height * scale))
        return crop_resize(pixels, tuple(v * k for v in box), self.size, self.interpolation)


def random_resized_crop(
    width: int, height: int, scale: tuple[float, float], ratio: tuple[float, float]
) -> tuple[int, int, int, int]:
    """torchvision's RandomResizedCrop.get_params (same distribution, same fallback), with the
    random numbers drawn in one call: its ten-odd tensor ops per image cost more than the resize."""
    area = width * height
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for u_area, u_ratio, u_top, u_left in torch.rand(10, 4).tolist():
        target = area * (scale[0] + u_area * (scale[1] - scale[0]))
        aspect = math.exp(log_ratio[0] + u_ratio * (log_ratio[1] - log_ratio[0]))
        w, h = round(math.sqrt(target * aspect)), round(math.sqrt(target / aspect))
        if 0 < w <= width and 0 < h <= height:
            return int(u_top * (height - h + 1)), int(u_left * (width - w + 1)), h, w
    in_ratio = width / height  # fallback: the whole image, clamped to the ratio range, centred
    if in_ratio < ratio[0]:
        w, h = width, round(width / ratio[0])
    elif in_ratio > ratio[1]:
        w, h = round(height * ratio[1]), height
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w


def crop_resize(pixels: torch.Tensor, box: tuple[float, float, float, float], size: int,
                mode: str = "bilinear", in_float: bool = False) -> torch.Tensor:
    """The (top, left, height, width) box of an HWC uint8 image, resized (antialiased bilinear or bicubic)
    to size x size HWC uint8; `in_float`: resized in float32 and rounded (CUDA has no uint8 kernel)."""
    y0, x0, h, w = pixel_box(box, pixels.shape[0], pixels.shape[1])
    crop = pixels[y0:y0 + h, x0:x0 + w].unsqueeze(0).permute(0, 3, 1, 2)  # NCHW view of NHWC memory
    if in_float:
        crop = crop.float()
    out = F.interpolate(crop, size=(size, size), mode=mode, antialias=True, align_corners=False)
    if in_float:
        out = out.round_().clamp_(0, 255).to(torch.uint8)
    return out[0].permute(1, 2, 0).contiguous()  # channels_last in, channels_last out: no copy


def pixel_box(box: tuple[float, float, float, float], height: int, width: int) -> tuple[int, int, int, int]:
    """A (top, left, height, width) box in fractional pixels as the whole pixels it crops from an image of
    `height` x `width`: edges rounded, at least one pixel, inside the image."""
    top, left, h, w = box
    y0, x0 = max(0, round(top)), max(0, round(left))
    y1, x1 = min(height, max(y0 + 1, round(top + h))), min(width, max(x0 + 1, round(left + w)))
    return y0, x0, y1 - y0, x1 - x0


def to_model_input(
    images: torch.Tensor, device: torch.device, channels_last: bool, norm: Norm = IMAGENET
) -> torch.Tensor:
    """uint8 NHWC batch -> float NCHW on `device` (channels_last if asked), normalised by `norm`."""
    return model_input(images.to(device, non_blocking=True), channels_last, norm)


def model_input(images: torch.Tensor, channels_last: bool, norm: Norm = IMAGENET) -> torch.Tensor:
    """`to_model_input` of a batch already on its device: uint8 NHWC -> float NCHW there, nothing copied
    between host and device."""
    x, device = images.permute(0, 3, 1, 2), images.device
    out = torch.empty(x.shape, dtype=torch.float32, device=device,
                      memory_format=torch.channels_last if channels_last else torch.contiguous_format)
    out.copy_(x)  # layout and dtype in one pass, then two in-place passes: (x/255 - mean)/std
    scale, shift = normalisation(device, norm)
    return out.mul_(scale).add_(shift)


def normalisation(device: torch.device, norm: Norm = IMAGENET) -> tuple[torch.Tensor, torch.Tensor]:
    """The (scale, shift) of `to_model_input`, per channel, filled on `device` from Python numbers (kernel
    arguments): a tensor copied from host memory would be a blocking copy on a GPU, stalling the host every
    batch; six tiny fills are queued like any kernel, in any fake or real mode."""
    scale, shift = torch.empty(3, device=device), torch.empty(3, device=device)
    for c, (mean, std) in enumerate(zip(*norm, strict=True)):
        scale[c].fill_(1 / (255 * std))
        shift[c].fill_(-mean / std)
    return scale.view(1, 3, 1, 1), shift.view(1, 3, 1, 1)
