"""CPU time per image of decoding at the size needed: libjpeg-turbo (simplejpeg) at each DCT scale, and
ddp's whole train transform with its DCT scaling on and off.

    python benchmarks/decode_scales.py /tmp/jpegs-500 [--image-size 112] [--images 100] [--repeats 12]

Process CPU time, not wall time (the machine may be shared), interleaved over the
variants, the median of the repeats; the transform draws the same crops in both
variants (seeded per image). The 1/8 scale's time is mostly the entropy decoding,
which no scale shrinks: the floor of what decoding at the size needed can save
(BENCHMARKS.md, "Decoding at the size needed"). The PIL rows measure the one saving
left to a decoder that could stop early: not decoding the rows below the crop (on
average a random-resized crop ends at 90 % of the image's height at ddp's default
scale range, a quarter up, and at 86 % at Inception's 0.08: the rows measure 86 %);
PIL stops there only when its tile is cut short and truncated images are allowed,
which is why ddp does not decode so.
"""

from __future__ import annotations

import argparse
import io
import math
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import simplejpeg
import torch
from PIL import Image, ImageFile

from ddp_cli.config import AugmentConfig, DataConfig
from ddp_cli.data.pipeline.augment import train_transform
from ddp_cli.data.pipeline.images import open_image


def decoding_at(k: int, files: list[bytes]) -> Callable[[], None]:
    sizes = [simplejpeg.decode_jpeg_header(f)[:2] for f in files]

    def run() -> None:
        for data, (height, width) in zip(files, sizes, strict=True):
            simplejpeg.decode_jpeg(data, "RGB", min_width=-(-width // k), min_height=-(-height // k))
    return run


def pil_rows(k: int, share: float, files: list[bytes]) -> Callable[[], None]:
    """PIL's decode at 1/k of the first `share` of the rows (libjpeg stops there: nothing below is read)."""
    def run() -> None:
        ImageFile.LOAD_TRUNCATED_IMAGES = True  # PIL stops early only so; the other variants keep its check
        try:
            for data in files:
                image = Image.open(io.BytesIO(data))
                image.draft("RGB", (image.width // k, image.height // k))
                tile = image.tile[0]
                image.tile = [tile._replace(extents=(0, 0, image.width, math.ceil(image.height * share)))]
                image.load()
        finally:
            ImageFile.LOAD_TRUNCATED_IMAGES = False
    return run


def transforming(image_size: int, dct_scaling: bool, files: list[bytes]) -> Callable[[], None]:
    transform = train_transform(DataConfig(image_size=image_size), AugmentConfig(), dct_scaling=dct_scaling)

    def run() -> None:
        for seed, data in enumerate(files):
            torch.manual_seed(seed)
            transform(open_image(data))
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", type=Path)
    parser.add_argument("--image-size", type=int, default=112)
    parser.add_argument("--images", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=12)
    args = parser.parse_args()
    torch.set_num_threads(1)
    files = [p.read_bytes() for p in sorted(args.root.rglob("*.JPEG"))[:args.images]]
    variants = {**{f"decode 1/{k}": decoding_at(k, files) for k in (1, 2, 4, 8)},
                **{f"PIL 1/{k}, {share:.0%} of the rows": pil_rows(k, share, files)
                   for k in (1, 2) for share in (1.0, 0.86)},
                f"transform {args.image_size} px, DCT scaling": transforming(args.image_size, True, files),
                f"transform {args.image_size} px, full decode": transforming(args.image_size, False, files)}
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.repeats):
        for name, run in variants.items():
            started = time.process_time()
            run()
            times[name].append((time.process_time() - started) / len(files) * 1e3)
    kb = sum(len(f) for f in files) / len(files) / 1e3
    print(f"{len(files)} JPEGs, mean {kb:.0f} KB; CPU ms per image, median of {args.repeats}:")
    medians = {name: statistics.median(spent) for name, spent in times.items()}
    for name, ms in medians.items():
        print(f"  {name}: {ms:.3f}")
    scaled, full = list(medians.values())[-2:]
    print(f"  transform: DCT scaling {full / scaled:.2f}x the images per CPU second of full decode")


if __name__ == "__main__":
    main()
