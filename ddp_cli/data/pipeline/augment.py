"""Per-image augmentation in the loader processes, after the fast crop: torchvision.transforms.v2's own ops.

The policy (TrivialAugmentWide, RandAugment, AutoAugment's ImageNet policy)
and colour jitter run through v2's PIL kernels: v2's tensor kernels cannot
rotate, shear or translate bicubic (the ViT, ConvNeXt and EfficientNetV2
recipes' interpolation) and are no faster bilinear on one core. The crop is
uint8 HWC, PIL's own layout, so it goes there and back in two plain copies
(cheap beside the ops themselves). Random erasing,
a slice assignment, stays on the tensor.

Every random draw is v2's (its `make_params`, torch's global RNG), which
`EpochItems` seeds per (seed, epoch, index): a sample is augmented the same way
whatever the loader processes, and a resumed run sees the same pixels.

The draws and the pixels are apart: `Augmentation.plan` runs the ops on a
stand-in image (`Drawing`) whose kernels only record each v2 functional called
and its arguments (`Steps`), and `replay` applies them to pixels: PIL's kernels
in the loader processes, v2's tensor kernels where the rank decodes on its
device (data.decode = "gpu", `device_decode.py`). Same draws, same order,
whichever pixels they end on.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

import numpy as np
import torch
from PIL import Image
from torchvision import tv_tensors
from torchvision.transforms import v2
from torchvision.transforms.v2 import functional as F

from ddp_cli.config import AugmentConfig, DataConfig
from ddp_cli.data.pipeline.transforms import MEAN, STD, TrainTransform

INTERPOLATION = {"bilinear": v2.InterpolationMode.BILINEAR, "bicubic": v2.InterpolationMode.BICUBIC}
MEAN_PIXEL = tuple(round(255 * m) for m in MEAN)  # what 0 is after normalisation
Ops = list[tuple[str, v2.Transform]]  # each op with its name for the plan, in the order they run
Step = tuple[Callable, dict[str, Any]]  # a v2 functional and the keyword arguments an op drew for it
Steps = tuple[list[Step], list[Step]]  # on the image (the policy, jitter), then on the tensor (erasing)
NO_STEPS: Steps = ([], [])
# Every functional the policies, jitter, erasing and SimCLR's grey call: each gets a recording kernel
# for `Drawing`. One missing would run the real kernel on the stand-in and go unrecorded (test_augment
# replays every policy against the live op to catch that).
RECORDED = (F.affine, F.rotate, F.adjust_brightness, F.adjust_contrast, F.adjust_saturation,
            F.adjust_sharpness, F.adjust_hue, F.posterize, F.solarize, F.autocontrast, F.equalize,
            F.invert, F.erase, F.rgb_to_grayscale)


class PixelErasing(v2.RandomErasing):
    """v2.RandomErasing for uint8 pixels. Its "random" fill is N(0, 1) noise meant for a normalised
    tensor (torchvision and timm erase after Normalize); cast to uint8 it would be 0, 1 and 255.
    Here the same draws are mapped to the pixels that normalise to them: N(mean, std) x 255."""

    def make_params(self, flat_inputs: list[Any]) -> dict[str, Any]:
        params = super().make_params(flat_inputs)
        if self.value is None and params["v"] is not None:
            std, mean = (torch.tensor(c).view(-1, 1, 1) for c in (STD, MEAN))
            params["v"] = (params["v"] * std + mean).mul_(255).round_().clamp_(0, 255).to(torch.uint8)
        return params


def policy(cfg: AugmentConfig, ops: ModuleType = v2) -> Ops:
    """The policy op, if any, from `ops` (v2, or v1 `torchvision.transforms` for `ddp bench data`'s
    baseline: the same classes); its geometric ops resample with the run's interpolation."""
    mode = INTERPOLATION[cfg.interpolation]
    if cfg.policy == "trivialaugment":
        return [(f"TrivialAugmentWide({cfg.interpolation})", ops.TrivialAugmentWide(interpolation=mode))]
    if cfg.policy == "randaugment":
        return [(f"RandAugment(num_ops={cfg.num_ops}, magnitude={cfg.magnitude}, {cfg.interpolation})",
                 ops.RandAugment(cfg.num_ops, cfg.magnitude, interpolation=mode))]
    if cfg.policy == "autoaugment":
        return [(f"AutoAugment(IMAGENET, {cfg.interpolation})",
                 ops.AutoAugment(ops.AutoAugmentPolicy.IMAGENET, interpolation=mode))]
    return []


def image_ops(cfg: AugmentConfig) -> Ops:
    """The ops on the whole image, in timm's and torchvision's order: the policy, then colour jitter."""
    s = cfg.color_jitter
    jitter = [(f"ColorJitter(brightness={s:g}, contrast={s:g}, saturation={s:g})",
               v2.ColorJitter(brightness=s, contrast=s, saturation=s))] if s else []
    return policy(cfg) + jitter


def tensor_ops(cfg: AugmentConfig) -> Ops:
    """Random erasing, last (the recipes erase the finished tensor)."""
    if not cfg.random_erase:
        return []
    value = cfg.random_erase_value
    fill = MEAN_PIXEL if value == "mean" else value  # "random": PixelErasing's noise
    shown = f"{value:g}" if isinstance(value, float) else value
    return [(f"RandomErasing(p={cfg.random_erase:g}, value={shown})",
             PixelErasing(p=cfg.random_erase, value=fill, inplace=True))]


def op_names(cfg: AugmentConfig) -> list[str]:
    """The per-image ops' names, in the order they run."""
    return [name for name, _ in image_ops(cfg) + tensor_ops(cfg)]


def compose(ops: Ops) -> v2.Compose | None:
    return v2.Compose([op for _, op in ops]) if ops else None


class Drawing(tv_tensors.Image):
    """A stand-in image: the ops draw their parameters on it as on real pixels (its size is the crop's),
    and its kernels record the calls (`drawn`) instead of computing."""


drawn: list[Step] = []  # the calls recorded since `Augmentation.plan` began (one plan at a time)


def _recording(functional: Callable) -> Callable:
    def kernel(image: Drawing, **kwargs: Any) -> Drawing:
        drawn.append((functional, kwargs))
        return image
    return kernel


for _functional in RECORDED:
    F.register_kernel(_functional, Drawing)(_recording(_functional))


def recorded(ops: Callable | None, size: int) -> list[Step]:
    """The calls `ops` makes on a size x size image, its draws made (none without ops)."""
    drawn.clear()
    if ops:
        ops(torch.zeros((), dtype=torch.uint8).expand(3, size, size).as_subclass(Drawing))
    calls = list(drawn)
    drawn.clear()
    return calls


def replay(image: Any, steps: list[Step], device: torch.device | None = None) -> Any:
    """`steps` applied to `image` (a PIL image, or a CHW tensor: v2 picks the kernel); tensor arguments
    (erasing's values) moved to `device`, from pinned memory where they come from a loader's batch."""
    for functional, kwargs in steps:
        if device is not None:
            kwargs = {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v
                      for k, v in kwargs.items()}
        image = functional(image, **kwargs)
    return image


class Augmentation:
    """The per-image ops on one uint8 HWC crop (a fresh tensor, which erasing overwrites): drawn by
    `plan`, applied by `apply`."""

    def __init__(self, cfg: AugmentConfig) -> None:
        self.on_image, self.on_tensor = compose(image_ops(cfg)), compose(tensor_ops(cfg))

    def plan(self, size: int) -> Steps:
        """The ops' draws for a size x size crop, in the order the ops make them."""
        return recorded(self.on_image, size), recorded(self.on_tensor, size)

    def apply(self, hwc: torch.Tensor, steps: Steps) -> torch.Tensor:
        """`steps` on a CPU crop: the image's through PIL's kernels, erasing on the tensor."""
        on_image, on_tensor = steps
        if on_image:
            hwc = torch.from_numpy(np.array(replay(Image.fromarray(hwc.numpy()), on_image)))
        if on_tensor:
            hwc = replay(hwc.permute(2, 0, 1), on_tensor).permute(1, 2, 0)
        return hwc


def augmentation(cfg: AugmentConfig) -> Augmentation | None:
    """The per-image augmentation, or None when the config asks for none."""
    return Augmentation(cfg) if op_names(cfg) else None


def train_transform(data: DataConfig, augment: AugmentConfig, size: int | None = None,
                    defer: bool = False, dct_scaling: bool = True) -> TrainTransform:
    """A run's train pipeline (crop side `size`, default data.image_size); `defer`: the JPEGs the device
    decodes are left to the rank (data.decode = "gpu")."""
    return TrainTransform(size or data.image_size, data.min_crop_scale, data.hflip, augment.interpolation,
                          augmentation(augment), defer, dct_scaling)
