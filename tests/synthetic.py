"""Tiny image data sets written by the tests themselves, with faults planted on demand."""

from __future__ import annotations

import io
import uuid
from pathlib import Path

import numpy as np
import tomli_w
from PIL import Image


def write_registry(folder: Path, entries: list[dict]) -> Path:
    path = folder / "data.toml"
    path.write_text(tomli_w.dumps({"data_config_version": 1, "datasets": entries}))
    return path


def write_julia_registry(folder: Path, roots: dict[str, Path]) -> Path:
    """A `Data.toml` written as FluxDistributed.jl's is: DataSets.jl version 0, `storage.type`, no layout."""
    path = folder / "Data.toml"
    path.write_text("data_config_version=0\n" + "".join(f"""
[[datasets]]
description="{name} as the Julia seeds register it"
name="{name}"
uuid="{uuid.uuid5(uuid.NAMESPACE_URL, name)}"

    [datasets.storage]
    driver="FileSystem"
    type="BlobTree"
    path="{root}"
""" for name, root in roots.items()))
    return path


def append_line(path: Path, line: str) -> None:
    """One more row at the end of a listing or CSV (which ends with a newline)."""
    with path.open("a") as f:
        f.write(line + "\n")


def image(seed: int, label: int, size: int = 40, mode: str = "RGB") -> Image.Image:
    """A noisy image whose mean colour encodes the label (learnable, deterministic)."""
    rng = np.random.default_rng(seed)
    base = np.zeros((size, size, 3), dtype=np.float64)
    base[..., label % 3] = 160 + 30 * (label // 3)
    pixels = np.clip(base + rng.normal(0, 25, base.shape), 0, 255).astype(np.uint8)
    img = Image.fromarray(pixels, "RGB")
    return img.convert(mode) if mode != "RGB" else img


def make_imagenet_loc(root: Path, classes: int = 3, train_per_class: int = 8, val: int = 7,
                      size: int = 40, train_list: bool = True) -> dict[str, list[str]]:
    """A Kaggle-layout data set; returns the written files per split (paths under root)."""
    synsets = [f"n{1000 + c:08d}" for c in range(classes)]
    (root / "LOC_synset_mapping.txt").parent.mkdir(parents=True, exist_ok=True)
    (root / "LOC_synset_mapping.txt").write_text(
        "".join(f"{s} class {c}, thing {c}\n" for c, s in enumerate(synsets)))
    files: dict[str, list[str]] = {"train": [], "val": []}
    lines, rows = [], ["ImageId,PredictionString"]
    for c, synset in enumerate(synsets):
        folder = root / "ILSVRC/Data/CLS-LOC/train" / synset
        folder.mkdir(parents=True, exist_ok=True)
        for i in range(train_per_class):
            image_id = f"{synset}_{i}"
            image(c * 1000 + i, c, size).save(folder / f"{image_id}.JPEG")
            files["train"].append(f"ILSVRC/Data/CLS-LOC/train/{synset}/{image_id}.JPEG")
            lines.append(f"{synset}/{image_id} {len(lines) + 1}")
    val_dir = root / "ILSVRC/Data/CLS-LOC/val"
    val_dir.mkdir(parents=True, exist_ok=True)
    for i in range(val):
        image_id = f"ILSVRC2012_val_{i + 1:08d}"
        image(10**6 + i, i % classes, size).save(val_dir / f"{image_id}.JPEG")
        rows.append(f"{image_id},{synsets[i % classes]} 1 1 5 5 {synsets[i % classes]} 2 2 6 6")
        files["val"].append(f"ILSVRC/Data/CLS-LOC/val/{image_id}.JPEG")
    if train_list:
        listing = root / "ILSVRC/ImageSets/CLS-LOC/train_cls.txt"
        listing.parent.mkdir(parents=True, exist_ok=True)
        listing.write_text("\n".join(lines) + "\n")
    (root / "LOC_train_solution.csv").write_text("ImageId,PredictionString\n")
    (root / "LOC_val_solution.csv").write_text("\n".join(rows) + "\n")
    return files


def make_imagefolder(root: Path, classes: int = 3, per_class: int = 4, size: int = 40) -> None:
    for split, count in (("train", per_class), ("val", max(1, per_class // 2))):
        for c in range(classes):
            folder = root / split / f"class_{c}"
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(count):
                image(hash((split, c, i)) % 10**6, c, size).save(folder / f"img_{i}.jpg")


CSV_CLASSES = ("zebra", "ant", "moth")  # not in sorted order: the layout sorts them


def make_csv_listed(root: Path, train_per_class: int = 3, val_per_class: int = 1,
                    size: int = 16) -> list[dict[str, str]]:
    """PNGs under `root/images/` and `root/labels.csv` listing them (`path,label,split`, labels the names
    of CSV_CLASSES); returns the listing's rows."""
    rows = []
    for split, count in (("train", train_per_class), ("val", val_per_class)):
        for c, name in enumerate(CSV_CLASSES):
            for i in range(count):
                path = f"images/{split}_{name}_{i}.png"
                (root / path).parent.mkdir(parents=True, exist_ok=True)
                image(hash((split, c, i)) % 10**6, c, size).save(root / path)
                rows.append({"path": path, "label": name, "split": split})
    write_listing(root / "labels.csv", rows)
    return rows


def write_listing(path: Path, rows: list[dict[str, str]]) -> None:
    """`rows` as a CSV with their keys as its header (a .parquet name: a Parquet file of strings)."""
    import pandas as pd

    frame = pd.DataFrame(rows)
    if path.suffix == ".parquet":
        frame.to_parquet(path, index=False)
    else:
        frame.to_csv(path, index=False)


def encoded(img: Image.Image, fmt: str = "JPEG") -> bytes:
    buffer = io.BytesIO()
    img.save(buffer, fmt)
    return buffer.getvalue()


def readme_with_classes(names: list[str], label: str = "label") -> str:
    """A dataset card as the hub writes it: YAML front matter whose features name the classes."""
    entries = "".join(f"          '{i}': {name}\n" for i, name in enumerate(names))
    return (f"---\nlicense: other\ndataset_info:\n  features:\n  - name: image\n    dtype: image\n"
            f"  - name: {label}\n    dtype:\n      class_label:\n        names:\n{entries}"
            "  splits:\n  - name: train\n---\n# A data set\n")


def write_hf_parquet(root: Path, rows: dict[str, int], classes: int = 3, files: int = 2,
                     row_group: int = 4, size: int = 16, folder: str = "data",
                     readme: bool = True) -> dict[str, list[int]]:
    """Image Parquet as the hub ships it (`datasets`' Image: a struct of bytes and path; an int `label`):
    per split (`train`, `validation`, `test`, ...) `files` files `<folder>/<split>-0000i-of-0000n.parquet`
    of `row_group`-row groups; class names `class <i>` in README.md unless `readme` is false. Returns
    each split's labels in row order."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    image_type = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    labels: dict[str, list[int]] = {}
    for s, (split, count) in enumerate(rows.items()):
        labels[split] = [(i * 7 + s) % classes for i in range(count)]
        per_file = -(-count // files)
        for f in range(files):
            chunk = range(f * per_file, min(count, (f + 1) * per_file))
            images = [{"bytes": encoded(image(10_000 * s + i, labels[split][i], size)),
                       "path": f"{split}_{i}.jpg"} for i in chunk]
            table = pa.table({"image": pa.array(images, image_type),
                              "label": pa.array([labels[split][i] for i in chunk], pa.int64())})
            target = root / folder / f"{split}-{f:05d}-of-{files:05d}.parquet"
            target.parent.mkdir(parents=True, exist_ok=True)
            pq.write_table(table, target, row_group_size=row_group)
    if readme:
        (root / "README.md").write_text(readme_with_classes([f"class {c}" for c in range(classes)]))
    return labels


def plant(root: Path, path: str, kind: str, label: int = 0, seed: int = 7) -> None:
    """Overwrite `root/path` with one of real ImageNet's oddities or faults.

    Oddities that must train: "cmyk" and "gray" JPEGs, "png" (a PNG named .JPEG).
    Faults: "truncated" (60% of a JPEG), "garbage" (not an image), "corrupt" (a PNG with zeroed
    compressed data), "missing" (deleted).
    """
    target = root / path
    img = image(seed, label)
    content = {
        "cmyk": lambda: encoded(img.convert("CMYK")),
        "gray": lambda: encoded(img.convert("L")),
        "png": lambda: encoded(img, "PNG"),
        "truncated": lambda: encoded(img)[: len(encoded(img)) * 6 // 10],
        "garbage": lambda: b"this is not an image\n" * 4,
        "corrupt": lambda: (lambda png: png[:100] + b"\x00" * 30 + png[130:])(encoded(img, "PNG")),
    }
    if kind == "missing":
        target.unlink()
    else:
        target.write_bytes(content[kind]())


# A model of the user's own, as the source of the file a test writes (`model.name = "<file>:make"`).
OWN_NET = """
from torch import nn

class Net(nn.Module):
    def __init__(self, num_classes, width=4):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, width, 3, padding=1, bias=False), nn.BatchNorm2d(width),
                                  nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.classify = nn.Linear(width, num_classes)

    def forward(self, x):
        return self.classify(self.body(x))

def make(num_classes, width=4):
    return Net(num_classes, width)
"""


def write_timm_cache(hf_home: Path, name: str = "test_resnet.r160_in1k", revision: str = "0" * 40,
                     **cfg_changes) -> dict:
    """The pretrained weights of timm model `name` (architecture.tag) as `hf download timm/<name>` leaves
    them under HF_HOME: hub/models--timm--<name>/refs/main naming a snapshot holding model.safetensors (a
    seeded 1000-class model's state, returned) and config.json with its pretrained_cfg (`cfg_changes`
    changed)."""
    import json

    import timm
    import torch
    from safetensors.torch import save_file

    torch.manual_seed(1234)
    model = timm.create_model(name, pretrained=False)
    repo = hf_home / "hub" / f"models--timm--{name}"
    snapshot = repo / "snapshots" / revision
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs/main").write_text(revision)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(snapshot / "model.safetensors"))
    cfg = {**model.pretrained_cfg, **cfg_changes}
    (snapshot / "config.json").write_text(json.dumps(
        {"architecture": name.split(".")[0], "num_classes": 1000, "pretrained_cfg": cfg}))
    return state
