"""Write `photos` (10 classes of natural-photo crops) or `textures` (10 classes of fine grey textures):
Kaggle `imagenet-loc` layout and a data.toml for it.

    python benchmarks/make_photo_crops.py /tmp/photos          # 112 px, 300 train + 100 val per class
    ddp train configs/photos.toml --registry /tmp/photos/data.toml
    python benchmarks/make_photo_crops.py /tmp/textures --kind textures --side 64 --train-per-class 60

A data set on which a training recipe shows, built offline: each class is one
colour photograph that an installed package ships (scikit-image's, scikit-learn's
and matplotlib's sample images), each image a random square crop of it (side
SCALE of the photo's shorter side, rotated up to ROTATION degrees, brightness,
contrast and saturation jittered), resized to `--side` px and saved as JPEG.
Train crops come only from the left TRAIN_SHARE of each photo's width and val
crops only from the rest, so val top-1 measures generalisation to unseen parts
of the scene, not memorised pixels. `textures` is a set whose classes live in fine detail: ten grey
images (textures, text, cells, a retina, a scene: TEXTURES), each image a crop of TEXTURE_SPAN source
pixels (close to the output's own scale, so a smaller crop than `--side` blurs what tells the classes
apart), grey so that colour gives nothing away. The Kaggle layout, as the demo's, so
`ddp bench e2e`'s torchrun baseline reads it as it is. Deterministic given `--seed`.
"""

from __future__ import annotations

import argparse
import math
import time
from importlib.resources import files
from pathlib import Path

import numpy as np
from make_jpegs import write_loc_lists  # this folder's benchmarks/make_jpegs.py
from PIL import Image, ImageEnhance

# (class name, package, path inside it): colour photographs, none of them synthetic
PHOTOS = (
    ("astronaut", "skimage", "data/astronaut.png"),
    ("cat", "skimage", "data/chelsea.png"),
    ("coffee", "skimage", "data/coffee.png"),
    ("rocket", "skimage", "data/rocket.jpg"),
    ("motorcycle", "skimage", "data/motorcycle_left.png"),
    ("hubble", "skimage", "data/hubble_deep_field.jpg"),
    ("tissue", "skimage", "data/ihc.png"),
    ("palace", "sklearn", "datasets/images/china.jpg"),
    ("flower", "sklearn", "datasets/images/flower.jpg"),
    ("hopper", "matplotlib", "mpl-data/sample_data/grace_hopper.jpg"),
)
TEXTURES = (
    ("brick", "skimage", "data/brick.png"),
    ("grass", "skimage", "data/grass.png"),
    ("gravel", "skimage", "data/gravel.png"),
    ("moon", "skimage", "data/moon.png"),
    ("page", "skimage", "data/page.png"),
    ("text", "skimage", "data/text.png"),
    ("camera", "skimage", "data/camera.png"),
    ("coins", "skimage", "data/coins.png"),
    ("cell", "skimage", "data/cell.png"),
    ("retina", "skimage", "data/retina.jpg"),
)
KINDS = {"photos": PHOTOS, "textures": TEXTURES}
SYNSETS = tuple(f"n{3000000 + c:08d}" for c in range(len(PHOTOS)))
TRAIN_SHARE = 0.7  # of each photo's width, from the left; val crops come from the rest
SCALE = (0.10, 0.35)  # crop side, as a share of the photo's shorter side
ROTATION = 20.0  # degrees, either way
JITTER = 0.25  # brightness, contrast and saturation factors in [1 - JITTER, 1 + JITTER]
TEXTURE_SPAN = (48, 96)  # textures: the crop's side in source pixels
QUALITY = 90


def photo(package: str, path: str, grey: bool = False) -> Image.Image:
    """A sample image from inside an installed package, as RGB (its grey levels in all three: `grey`)."""
    with Image.open(files(package).joinpath(path)) as img:
        return img.convert("L").convert("RGB") if grey else img.convert("RGB")


def crop(rng: np.random.Generator, img: Image.Image, x0: float, x1: float, side: int,
         span: tuple[float, float]) -> Image.Image:
    """A random rotated, jittered square crop of side in `span` (source px) whose rotated corners all
    lie in columns [x0, x1)."""
    height = img.height
    angle = math.radians(rng.uniform(-ROTATION, ROTATION))
    spread = abs(math.cos(angle)) + abs(math.sin(angle))  # the rotated square's bounding box / its side
    size = rng.uniform(*span)
    size = min(size, (x1 - x0) / spread, height / spread)  # a narrow val strip caps the crop
    half = size * spread / 2
    cx, cy = rng.uniform(x0 + half, x1 - half), rng.uniform(half, height - half)
    c, s = math.cos(angle) * size / 2, math.sin(angle) * size / 2
    # QUAD: the source corners of the output's upper-left, lower-left, lower-right, upper-right
    corners = [(-c + s, -s - c), (-c - s, -s + c), (c - s, s + c), (c + s, s - c)]
    quad = [v for dx, dy in corners for v in (cx + dx, cy + dy)]
    out = img.transform((side, side), Image.Transform.QUAD, quad, Image.Resampling.BICUBIC)
    for enhance in (ImageEnhance.Brightness, ImageEnhance.Contrast, ImageEnhance.Color):
        out = enhance(out).enhance(rng.uniform(1 - JITTER, 1 + JITTER))
    return out


def make_dataset(root: Path, side: int = 112, train_per_class: int = 300, val_per_class: int = 100,
                 seed: int = 0, kind: str = "photos") -> Path:
    """Write the crops, the LOC metadata and `root/data.toml` (data set name: `kind`); the registry."""
    rng = np.random.default_rng(seed)
    train_dir, val_dir = root / "ILSVRC/Data/CLS-LOC/train", root / "ILSVRC/Data/CLS-LOC/val"
    val_dir.mkdir(parents=True, exist_ok=True)
    (root / "ILSVRC/ImageSets/CLS-LOC").mkdir(parents=True, exist_ok=True)
    (root / "LOC_synset_mapping.txt").write_text(
        "".join(f"{s} {name}\n" for s, (name, _, _) in zip(SYNSETS, KINDS[kind], strict=True)))
    listing, val_rows = [], ["ImageId,PredictionString"]
    for synset, (_, package, path) in zip(SYNSETS, KINDS[kind], strict=True):
        img = photo(package, path, grey=kind == "textures")
        span = TEXTURE_SPAN if kind == "textures" else tuple(share * min(img.size) for share in SCALE)
        split = TRAIN_SHARE * img.width
        (train_dir / synset).mkdir(parents=True, exist_ok=True)
        for i in range(train_per_class):
            image_id = f"{synset}_{i}"
            image = crop(rng, img, 0, split, side, span)
            image.save(train_dir / synset / f"{image_id}.JPEG", quality=QUALITY)
            listing.append(f"{synset}/{image_id} {len(listing) + 1}")
        for _ in range(val_per_class):
            image_id = f"ILSVRC2012_val_{len(val_rows):08d}"
            crop(rng, img, split, img.width, side, span).save(val_dir / f"{image_id}.JPEG", quality=QUALITY)
            val_rows.append(f"{image_id},{synset} 0 0 {side - 1} {side - 1}")
    what = "grey texture crops of 10 sample images" if kind == "textures" else "crops of 10 sample photos"
    return write_loc_lists(root, listing, val_rows, kind,
                           f"{what}, {side} px (benchmarks/make_photo_crops.py)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", type=Path)
    parser.add_argument("--kind", choices=sorted(KINDS), default="photos")
    parser.add_argument("--side", type=int, default=112, help="image side, px")
    parser.add_argument("--train-per-class", type=int, default=300)
    parser.add_argument("--val-per-class", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    started = time.perf_counter()
    registry = make_dataset(args.root, args.side, args.train_per_class, args.val_per_class, args.seed,
                            args.kind)
    print(f"{len(KINDS[args.kind]) * (args.train_per_class + args.val_per_class)} JPEGs in "
          f"{time.perf_counter() - started:.1f} s; registry: {registry}")


if __name__ == "__main__":
    main()
