"""Per-image cost of each augmentation policy on one core, by the kernels that could run it.

    python benchmarks/augment_kernels.py /tmp/jpegs [--images 200] [--rounds 5]

On 224 px RandomResizedCrops of the JPEGs under ROOT (benchmarks/make_jpegs.py),
milliseconds per image, best of ROUNDS passes (same seeds each pass):

- ddp: what the loaders run (`ddp_cli.data.pipeline.augment`): v2's ops on v2's PIL
  kernels, the uint8 crop to a PIL image and back included;
- v2 tensor: the same v2 ops on the uint8 CHW tensor (no bicubic: v2's tensor
  geometry kernels take nearest and bilinear only);
- v1 PIL: `torchvision.transforms` on the PIL image, `ddp bench data`'s baseline.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torchvision import transforms as T

from ddp_cli.config import AugmentConfig
from ddp_cli.data.pipeline.augment import Augmentation, compose, image_ops, policy

CASES = [AugmentConfig(policy=name, interpolation=mode) for name in ("trivialaugment", "randaugment",
                                                                     "autoaugment")
         for mode in ("bilinear", "bicubic")] + [AugmentConfig(color_jitter=0.4)]


def per_image_ms(op: Callable, inputs: list, rounds: int) -> float:
    best = float("inf")
    for _ in range(rounds):
        torch.manual_seed(0)
        started = time.perf_counter()
        for x in inputs:
            op(x)
        best = min(best, (time.perf_counter() - started) / len(inputs))
    return best * 1000


def crops(root: Path, count: int) -> list[Image.Image]:
    torch.manual_seed(0)
    crop = T.RandomResizedCrop(224)
    return [crop(Image.open(path).convert("RGB")) for path in sorted(root.rglob("*.JPEG"))[:count]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", type=Path)
    parser.add_argument("--images", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)  # as in a loader process
    pils = crops(args.root, args.images)
    hwc = [torch.from_numpy(np.array(p)) for p in pils]
    chw = [t.permute(2, 0, 1).contiguous() for t in hwc]
    print("| op | ddp (v2, PIL kernels) | v2 tensor kernels | v1 PIL (baseline) |")
    print("| --- | ---: | ---: | ---: |")
    for cfg in CASES:
        v1 = T.Compose([op for _, op in policy(cfg, T)] or [T.ColorJitter(*[cfg.color_jitter] * 3)])
        tensor = "n/a" if cfg.interpolation == "bicubic" else \
            f"{per_image_ms(compose(image_ops(cfg)), chw, args.rounds):.2f}"
        print(f"| {image_ops(cfg)[0][0]} | {per_image_ms(Augmentation(cfg), hwc, args.rounds):.2f} | "
              f"{tensor} | {per_image_ms(v1, pils, args.rounds):.2f} |")


if __name__ == "__main__":
    main()
