"""FixMatch's two views of an unlabelled image, made in the loader processes from one decode.

The weak view is the crop and flip of training (the flip only where data.hflip:
a mirrored digit is another glyph); the strong view is another crop and flip of
the same image, then RandAugment with `strong_ops` ops at a magnitude drawn per
image (the paper's RandAugment variant: no fixed magnitude to tune), then Cutout,
a grey square of a random side up to `cutout` of the image's. Every draw is
torch's global RNG, which `EpochItems` seeds per (seed, epoch, index): the views
are the same whatever the loader processes, and after a resume.
"""

from __future__ import annotations

import numpy as np
import torch
from PIL import Image
from torchvision.transforms import v2

from ddp_cli.config import AugmentConfig, DataConfig, SemiConfig
from ddp_cli.data.pipeline.augment import INTERPOLATION
from ddp_cli.data.pipeline.images import EncodedImage
from ddp_cli.data.pipeline.transforms import TrainTransform

MAGNITUDES = 31  # RandAugment's bins: magnitude 0-30
GREY = 127  # Cutout's fill, the paper's (0.5 of the pixel range)


class RandomMagnitudeRandAugment:
    """RandAugment(num_ops) at a magnitude drawn uniformly from 1-30 for each image."""

    def __init__(self, num_ops: int, interpolation: str) -> None:
        mode = INTERPOLATION[interpolation]
        self.by_magnitude = [v2.RandAugment(num_ops, m, MAGNITUDES, mode) for m in range(MAGNITUDES)]

    def __call__(self, hwc: torch.Tensor) -> torch.Tensor:
        op = self.by_magnitude[int(torch.randint(1, MAGNITUDES, ()))]
        return torch.from_numpy(np.array(op(Image.fromarray(hwc.numpy()))))


def cutout(hwc: torch.Tensor, largest: float) -> torch.Tensor:
    """A grey square of side uniform in [0, largest x side), centred anywhere, clipped to the image."""
    h, w = hwc.shape[:2]
    side, cy, cx = torch.rand(3).tolist()
    half = side * largest * min(h, w) / 2
    top, left = round(cy * h - half), round(cx * w - half)
    out = hwc.clone()
    out[max(top, 0):max(top + round(2 * half), 0), max(left, 0):max(left + round(2 * half), 0)] = GREY
    return out


class StrongAugment:
    """RandAugment at a random magnitude, then Cutout, as `semi.strong` says."""

    def __init__(self, semi: SemiConfig, interpolation: str) -> None:
        self.randaugment = (RandomMagnitudeRandAugment(semi.strong_ops, interpolation)
                            if semi.strong != "none" else None)
        self.cutout = semi.cutout if semi.strong == "randaugment+cutout" else 0.0

    def __call__(self, hwc: torch.Tensor) -> torch.Tensor:
        if self.randaugment:
            hwc = self.randaugment(hwc)
        return cutout(hwc, self.cutout) if self.cutout else hwc


class TwoViews:
    """Weak and strong view of one decoded image, stacked: uint8 2 x H x W x C."""

    def __init__(self, data: DataConfig, augment: AugmentConfig, semi: SemiConfig) -> None:
        hflip = data.hflip and semi.weak == "flip+crop"
        self.weak = TrainTransform(data.image_size, semi.crop_scale, hflip, augment.interpolation)
        self.strong = TrainTransform(data.image_size, semi.crop_scale, hflip, augment.interpolation)
        self.strong_augment = StrongAugment(semi, augment.interpolation)  # after the strong crop's draws
        self.size = data.image_size

    def __call__(self, img: EncodedImage) -> torch.Tensor:
        return torch.stack([self.weak(img), self.strong_augment(self.strong(img))])


def view_names(data: DataConfig, augment: AugmentConfig, semi: SemiConfig) -> dict[str, list[str]]:
    """The two views' ops in the order they run, for the dry-run plan."""
    crop = f"RandomResizedCrop({data.image_size}, scale=({semi.crop_scale:g}, 1), {augment.interpolation})"
    weak = [crop] + (["RandomHorizontalFlip"] if data.hflip and semi.weak == "flip+crop" else [])
    strong = list(weak)
    if semi.strong != "none":
        strong.append(f"RandAugment(num_ops={semi.strong_ops}, magnitude=random 1-30)")
    if semi.strong == "randaugment+cutout":
        strong.append(f"Cutout(up to {semi.cutout:g} of the side, grey)")
    return {"weak": weak, "strong": strong}
