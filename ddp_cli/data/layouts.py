"""Index tables: which image files a split holds and their labels, per layout.

`imagenet-loc` is the Kaggle ImageNet localization archive. Its
`LOC_train_solution.csv` lists only the ~544k train images that have boxes, so
the train split is every image under `ILSVRC/Data/CLS-LOC/train/<synset>/`,
labelled by its folder: read from `ILSVRC/ImageSets/CLS-LOC/train_cls.txt` when
present (no listing of a million objects on S3), else by listing the folders.
Val labels are the first synset of `PredictionString` in `LOC_val_solution.csv`.
`imagefolder` is torchvision's `train/<class>/*`, `val/<class>/*`.
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass, field
from pathlib import Path

import fsspec
import numpy as np
import pandas as pd

from ddp_cli.errors import ConfigError, DataError, did_you_mean

SPLITS = ("train", "val")
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
LOC_TRAIN = "ILSVRC/Data/CLS-LOC/train"
LOC_VAL = "ILSVRC/Data/CLS-LOC/val"
LOC_TRAIN_LIST = "ILSVRC/ImageSets/CLS-LOC/train_cls.txt"


@dataclass
class IndexTable:
    """Classes in label order and, per split, a frame of `path` (under the root) and `label`."""

    classes: list[str]
    descriptions: list[str]
    splits: dict[str, pd.DataFrame]
    problems: list[dict[str, str]] = field(default_factory=list)

    def save(self, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        meta = {"classes": self.classes, "descriptions": self.descriptions}
        (folder / "classes.json").write_text(json.dumps(meta))
        for name, frame in self.splits.items():
            frame.to_csv(folder / f"{name}.csv", index=False)

    @classmethod
    def load(cls, folder: Path) -> IndexTable:
        meta = json.loads((folder / "classes.json").read_text())
        splits = {
            name: pd.read_csv(folder / f"{name}.csv", dtype={"path": str, "label": "int64"})
            for name in SPLITS
            if (folder / f"{name}.csv").exists()
        }
        return cls(meta["classes"], meta["descriptions"], splits)


def build_index(
    fs: fsspec.AbstractFileSystem,
    root: str,
    layout: str,
    classes: int | list[str] | None = None,
    splits: tuple[str, ...] = SPLITS,
) -> IndexTable:
    """Read the layout's metadata and return the (optionally class-subset) index."""
    reader = _imagenet_loc if layout == "imagenet-loc" else _imagefolder
    synsets, descriptions, frames = reader(fs, root.rstrip("/"), splits)
    problems: list[dict[str, str]] = []
    keep = select_classes(synsets, descriptions, classes)
    relabel = {synsets[old]: new for new, old in enumerate(keep)}
    known = set(synsets)
    out = {}
    for split, frame in frames.items():
        # per distinct synset, not per row: 1.28 M rows have only ~1000 of them
        synset = pd.Categorical(frame["synset"])
        label_of = np.array([relabel.get(c, -1) for c in synset.categories] + [-1], dtype=np.int64)
        unknown_of = np.array([c not in known for c in synset.categories] + [True])
        paths = frame["path"].to_numpy()
        problems += [{"path": path, "reason": "unknown synset"} for path in paths[unknown_of[synset.codes]]]
        labels = label_of[synset.codes]  # code -1 (a missing synset) picks the trailing -1/True
        chosen = labels >= 0
        out[split] = pd.DataFrame({"path": paths[chosen], "label": labels[chosen]})
    return IndexTable([synsets[i] for i in keep], [descriptions[i] for i in keep], out, problems)


def select_classes(
    synsets: list[str], descriptions: list[str], classes: int | list[str] | None
) -> list[int]:
    """Indices of the chosen classes: all, the first N, or named by synset or description."""
    if classes is None:
        return list(range(len(synsets)))
    if isinstance(classes, int):
        if not 1 <= classes <= len(synsets):
            raise ConfigError(f"data.classes: {classes} is out of range; the data set has "
                              f"{len(synsets)} classes")
        return list(range(classes))
    lookup = {s: i for i, s in enumerate(synsets)}
    for i, text in enumerate(descriptions):
        lookup.setdefault(text, i)
        lookup.setdefault(text.split(",")[0].strip(), i)
    if not classes:
        raise ConfigError("data.classes: an empty list selects nothing; remove the key for every class")
    chosen: dict[int, str] = {}
    for name in classes:
        if name not in lookup:
            raise ConfigError(f"data.classes: unknown class {name!r}{did_you_mean(name, list(lookup))}")
        if lookup[name] in chosen:
            raise ConfigError(f"data.classes: {name!r} and {chosen[lookup[name]]!r} name the same "
                              "class; list each class once")
        chosen[lookup[name]] = name
    return list(chosen)


def _read_text(fs: fsspec.AbstractFileSystem, path: str) -> str:
    try:
        return fs.cat_file(path).decode()
    except FileNotFoundError as e:
        raise DataError(f"{path}: missing; is the data set root right?") from e


def _imagenet_loc(fs, root: str, splits: tuple[str, ...]):
    mapping = _read_text(fs, f"{root}/LOC_synset_mapping.txt").splitlines()
    pairs = [line.split(" ", 1) for line in mapping if line.strip()]
    synsets = [p[0] for p in pairs]
    descriptions = [p[1].strip() if len(p) > 1 else p[0] for p in pairs]
    frames = {}
    if "train" in splits:
        frames["train"] = _loc_train(fs, root)
    if "val" in splits:
        csv = pd.read_csv(io.StringIO(_read_text(fs, f"{root}/LOC_val_solution.csv")))
        frames["val"] = pd.DataFrame({
            "path": LOC_VAL + "/" + csv["ImageId"] + ".JPEG",
            "synset": csv["PredictionString"].str.split(" ", n=1).str[0],
        }).sort_values("path", ignore_index=True)
    return synsets, descriptions, frames


def _loc_train(fs, root: str) -> pd.DataFrame:
    listing = f"{root}/{LOC_TRAIN_LIST}"
    if fs.exists(listing):  # `<synset>/<ImageId> <n>` per line; plain str methods beat pandas' here
        lines = _read_text(fs, listing).splitlines()
        paths = sorted(f"{LOC_TRAIN}/{line.partition(' ')[0]}.JPEG" for line in lines if line.strip())
        start = len(LOC_TRAIN) + 1  # same order as a listing gives
        return pd.DataFrame({"path": paths, "synset": [p[start:].partition("/")[0] for p in paths]})
    files = _list_images(fs, f"{root}/{LOC_TRAIN}", root)
    return pd.DataFrame({"path": files, "synset": [p.split("/")[-2] for p in files]})


def _imagefolder(fs, root: str, splits: tuple[str, ...]):
    if not fs.isdir(f"{root}/train"):
        raise DataError(f"{root}/train: missing; an imagefolder root holds train/<class>/ and val/<class>/")
    synsets = sorted(p.rstrip("/").split("/")[-1] for p in fs.ls(f"{root}/train", detail=False)
                     if fs.isdir(p))
    frames = {}
    for split in splits:
        files = _list_images(fs, f"{root}/{split}", root)
        frames[split] = pd.DataFrame({"path": files, "synset": [p.split("/")[-2] for p in files]})
    return synsets, list(synsets), frames


def _list_images(fs, folder: str, root: str) -> list[str]:
    if not fs.isdir(folder):
        raise DataError(f"{folder}: missing split folder; check the data set root")
    prefix = len(fs._strip_protocol(root).rstrip("/")) + 1
    return sorted(
        p[prefix:] for p in fs.find(folder) if p.lower().endswith(IMAGE_EXTENSIONS)
    )
