"""Write an ImageNet-sized JPEG data set (Kaggle `imagenet-loc` layout) and a data.toml for it.

    python benchmarks/make_jpegs.py /tmp/jpegs --classes 10 --per-class 40 --val 100

Sides are drawn from 300-500 px, like ImageNet's typical images (or all one
size, `--size 500x375`, ImageNet's most common); the content is
1/f ("pink") noise with correlated colour channels, whose spectrum is close to a
photograph's, so at quality 90 the files come out at 60-140 KB (ImageNet's
average is about 110 KB) and decode at photo-like cost. Deterministic (seeded).
"""

from __future__ import annotations

import argparse
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
import tomli_w
from PIL import Image


def photo_like(rng: np.random.Generator, width: int, height: int) -> Image.Image:
    """An RGB image with a photograph's 1/f spectrum and correlated channels."""
    fy = np.fft.fftfreq(height)[:, None]
    fx = np.fft.rfftfreq(width)[None, :]
    radius = np.hypot(fx, fy)
    radius[0, 0] = 1.0
    amplitude = radius ** -1.1

    def field() -> np.ndarray:
        phases = np.exp(2j * np.pi * rng.random(amplitude.shape))
        return np.fft.irfft2(amplitude * phases, s=(height, width))

    shared = field()
    x = np.stack([0.8 * shared + 0.45 * field() for _ in range(3)], axis=-1)
    x = 128 + 48 * (x - x.mean()) / x.std() + rng.normal(0, 4, x.shape)
    return Image.fromarray(np.clip(x, 0, 255).astype(np.uint8), "RGB")


def make_dataset(root: Path, classes: int, per_class: int, val: int, seed: int = 0,
                 size: tuple[int, int] | None = None, copies: int = 1) -> Path:
    """Write the images (each `size` = (width, height), else drawn; each train image under `copies` names,
    hard links of one file: a large set made fast, each copy costing what a distinct file costs to read
    and decode), the LOC metadata and `root/data.toml` (data set name: `jpegs`). Each image is drawn from
    its own seed (`seed`, its number), so they are rendered on every core and the set is the same."""
    rng = np.random.default_rng(seed)
    synsets = [f"n{2000000 + c:08d}" for c in range(classes)]
    (root / "ILSVRC/ImageSets/CLS-LOC").mkdir(parents=True, exist_ok=True)
    (root / "LOC_synset_mapping.txt").write_text("".join(f"{s} synthetic class {i}\n"
                                                         for i, s in enumerate(synsets)))
    jobs: list[tuple[Path, int, int, tuple[int, int]]] = []

    def image(path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        width, height = size or rng.integers(300, 501, size=2)
        jobs.append((path, int(width), int(height), (seed, len(jobs))))

    listing, links = [], []
    for synset in synsets:
        for i in range(per_class):
            first = root / f"ILSVRC/Data/CLS-LOC/train/{synset}/{synset}_{i}.JPEG"
            image(first)
            for copy in range(copies):
                image_id = f"{synset}_{i}" + (f"_{copy}" if copy else "")
                if copy:
                    links.append((first.with_name(f"{image_id}.JPEG"), first))
                listing.append(f"{synset}/{image_id} {len(listing) + 1}")
    rows = ["ImageId,PredictionString"]
    for i in range(val):
        image_id = f"ILSVRC2012_val_{i + 1:08d}"
        image(root / f"ILSVRC/Data/CLS-LOC/val/{image_id}.JPEG")
        rows.append(f"{image_id},{synsets[i % classes]} 0 0 10 10")
    with ProcessPoolExecutor() as pool:
        list(pool.map(save, jobs, chunksize=8))
    for link, first in links:
        link.hardlink_to(first)
    return write_loc_lists(root, listing, rows, "jpegs",
                           "ImageNet-sized synthetic JPEGs (benchmarks/make_jpegs.py)")


def save(job: tuple[Path, int, int, tuple[int, int]]) -> None:
    path, width, height, seed = job
    photo_like(np.random.default_rng(seed), width, height).save(path, "JPEG", quality=90)


def write_loc_lists(root: Path, listing: list[str], val_rows: list[str], name: str, description: str) -> Path:
    """The Kaggle layout's lists of images written (train by folder, val with its labels) and a data.toml
    naming `root` as data set `name`: its path."""
    (root / "ILSVRC/ImageSets/CLS-LOC/train_cls.txt").write_text("\n".join(listing) + "\n")
    (root / "LOC_train_solution.csv").write_text("ImageId,PredictionString\n")
    (root / "LOC_val_solution.csv").write_text("\n".join(val_rows) + "\n")
    registry = root / "data.toml"
    registry.write_text(tomli_w.dumps({"data_config_version": 1, "datasets": [{
        "name": name, "layout": "imagenet-loc", "description": description,
        "storage": {"driver": "FileSystem", "path": "."}}]}))
    return registry


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", type=Path)
    parser.add_argument("--classes", type=int, default=10)
    parser.add_argument("--per-class", type=int, default=40)
    parser.add_argument("--val", type=int, default=100)
    parser.add_argument("--size", metavar="WxH", help="every image this size (default: sides of 300-500 px)")
    parser.add_argument("--copies", type=int, default=1, help="names per train image (hard links)")
    args = parser.parse_args()
    size = tuple(int(side) for side in args.size.split("x")) if args.size else None
    registry = make_dataset(args.root, args.classes, args.per_class, args.val, size=size, copies=args.copies)
    sizes = [p.stat().st_size for p in args.root.rglob("*.JPEG")]
    print(f"{len(sizes)} JPEGs, mean {np.mean(sizes) / 1e3:.0f} KB; registry: {registry}")


if __name__ == "__main__":
    main()
