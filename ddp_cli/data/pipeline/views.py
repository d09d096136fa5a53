"""Two views of one image: FixMatch's weak and strong, or SimCLR's pair.

The weak view is the crop and flip of training (the flip only where data.hflip:
a mirrored digit is another glyph); the strong view is another crop and flip of
the same image, then RandAugment with `strong_ops` ops at a magnitude drawn per
image (the paper's RandAugment variant: no fixed magnitude to tune), then Cutout,
a grey square of a random side up to `cutout` of the image's. Every draw is
torch's global RNG, which `EpochItems` seeds per (seed, epoch, index): the views
are the same whatever the loader processes, and after a resume. The draws come
first (`TrainTransform.plan`, `StrongAugment.plan`), the pixels after, as for a
training image: rendered in the loader processes, or, with data.decode = "gpu",
both views rendered on the rank's device from one decode of the JPEG there
(`device_decode`), their steps replayed a functional at a time (`batched_ops`).

SimCLR's views (pretrain.method, `contrastive_views`) are two draws of the same
pipeline: a crop of area pretrain.crop_scale-1 and a flip, then its colour
distortion (`ColourDistortion`: jitter with probability 0.8, grey with 0.2).
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torchvision.transforms import v2
from torchvision.transforms.v2 import functional as F

from ddp_cli.config import AugmentConfig, DataConfig, PretrainConfig, SemiConfig
from ddp_cli.data.pipeline.augment import INTERPOLATION, Augmentation, Step, Steps, recorded
from ddp_cli.data.pipeline.images import EncodedImage
from ddp_cli.data.pipeline.transforms import Deferred, TrainTransform

MAGNITUDES = 31  # RandAugment's bins: magnitude 0-30
GREY = torch.tensor([127], dtype=torch.uint8).view(1, 1, 1)  # Cutout's fill, the paper's (0.5 of the range)


class StrongAugment(Augmentation):
    """RandAugment(strong_ops) at a magnitude drawn uniformly from 1-30 for each image, then Cutout, as
    `semi.strong` says: drawn by `plan` (the magnitude, the ops' draws, Cutout's square), applied by
    `apply` (PIL's kernels in the loader) or replayed on the rank's device (data.decode = "gpu")."""

    def __init__(self, semi: SemiConfig, interpolation: str) -> None:
        mode = INTERPOLATION[interpolation]
        self.by_magnitude = ([v2.RandAugment(semi.strong_ops, m, MAGNITUDES, mode) for m in range(MAGNITUDES)]
                             if semi.strong != "none" else None)
        self.cutout = semi.cutout if semi.strong == "randaugment+cutout" else 0.0

    def plan(self, size: int) -> Steps:
        on_image = []
        if self.by_magnitude:
            on_image = recorded(self.by_magnitude[int(torch.randint(1, MAGNITUDES, ()))], size)
        return on_image, [cutout(size, size, self.cutout)] if self.cutout else []


def cutout(h: int, w: int, largest: float) -> Step:
    """A grey square of side uniform in [0, largest x side), centred anywhere, clipped to the h x w image:
    its erase."""
    side, cy, cx = torch.rand(3).tolist()
    half = side * largest * min(h, w) / 2
    top, left = round(cy * h - half), round(cx * w - half)
    i, j = min(max(top, 0), h), min(max(left, 0), w)
    bottom, right = min(max(top + round(2 * half), 0), h), min(max(left + round(2 * half), 0), w)
    return F.erase, {"i": i, "j": j, "h": max(bottom - i, 0), "w": max(right - j, 0), "v": GREY,
                     "inplace": False}


class ColourDistortion(Augmentation):
    """SimCLR's colour distortion of strength s (Chen et al. 2020, appendix A): ColorJitter(0.8s, 0.8s,
    0.8s, 0.2s) with probability 0.8, then grey with probability 0.2; drawn and applied as any policy."""

    def __init__(self, s: float) -> None:
        jitter = v2.ColorJitter(0.8 * s, 0.8 * s, 0.8 * s, min(0.2 * s, 0.5))
        self.on_image = v2.Compose([v2.RandomApply([jitter], p=0.8), v2.RandomGrayscale(p=0.2)])
        self.on_tensor = None


class TwoViews:
    """Two views of one image (`first` then `second`): uint8 2 x H x W x C, both from one decode. With
    `defer` (data.decode = "gpu"), a JPEG the device's decoder takes comes out one `Deferred` with both
    views' plans (`Deferred.more`: the second's), rendered on the rank's device from its one decode there."""

    def __init__(self, first: TrainTransform, second: TrainTransform) -> None:
        self.first, self.second, self.size = first, second, first.size

    def __call__(self, img: EncodedImage) -> torch.Tensor | Deferred:
        first, second = self.first(img), self.second(img)
        if isinstance(first, Deferred):
            return replace(first, more=(second.plan,))
        return torch.stack([first, second])


def fixmatch_views(data: DataConfig, augment: AugmentConfig, semi: SemiConfig,
                   defer: bool = False) -> TwoViews:
    """FixMatch's weak view, then its strong one."""
    hflip, mode = data.hflip and semi.weak == "flip+crop", augment.interpolation
    weak = TrainTransform(data.image_size, semi.crop_scale, hflip, mode, defer=defer)
    strong = TrainTransform(data.image_size, semi.crop_scale, hflip, mode, StrongAugment(semi, mode), defer)
    return TwoViews(weak, strong)


def contrastive_views(data: DataConfig, augment: AugmentConfig, pretrain: PretrainConfig,
                      defer: bool = False) -> TwoViews:
    """SimCLR's pair: the same crop, flip and colour distortion, drawn twice."""
    colour = ColourDistortion(pretrain.color_strength) if pretrain.color_strength else None
    view = TrainTransform(data.image_size, pretrain.crop_scale, data.hflip, augment.interpolation, colour,
                          defer)
    return TwoViews(view, view)


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


def contrastive_view_names(data: DataConfig, augment: AugmentConfig, pretrain: PretrainConfig) -> list[str]:
    """SimCLR's view's ops in the order they run (both views alike), for the dry-run plan."""
    scale = f"scale=({pretrain.crop_scale:g}, 1)"
    ops = [f"RandomResizedCrop({data.image_size}, {scale}, {augment.interpolation})"]
    ops += ["RandomHorizontalFlip"] if data.hflip else []
    s = pretrain.color_strength
    if s:
        ops += [f"ColorJitter({0.8 * s:g}, {0.8 * s:g}, {0.8 * s:g}, {min(0.2 * s, 0.5):g}) p=0.8",
                "RandomGrayscale p=0.2"]
    return ops
