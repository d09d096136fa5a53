"""Index tables: which image files a split holds and their labels, per layout.

`imagenet-loc` is the Kaggle ImageNet localization archive. Its
`LOC_train_solution.csv` lists only the ~544k train images that have boxes, so
the train split is every image under `ILSVRC/Data/CLS-LOC/train/<synset>/`,
labelled by its folder: read from `ILSVRC/ImageSets/CLS-LOC/train_cls.txt` when
present (no listing of a million objects on S3), else by listing the folders.
Val labels are the first synset of `PredictionString` in `LOC_val_solution.csv`.
`imagefolder` is torchvision's `train/<class>/*`, `val/<class>/*`.

A layout is one entry of `LAYOUTS` (its name, the registry's `layout`) and one
reader function. Names read from files (an `ImageId`, a `train_cls.txt` row)
must stay inside their folder: one that is absolute or climbs out with `..` is
kept as written, so that `FileReader` refuses it (a bad image), and is listed
in `IndexTable.unsafe` by file and value.
"""

from __future__ import annotations

import io
import json
import posixpath
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import fsspec
import numpy as np

from ddp_cli.data.packed import Split
from ddp_cli.data.retry import with_retries
from ddp_cli.data.storage import UNSAFE_PATH, escapes
from ddp_cli.errors import ConfigError, DataError, did_you_mean
from ddp_cli.io import write_text

if TYPE_CHECKING:  # pandas builds the index in the launcher; ranks only load it (0.7 s less each)
    import pandas as pd

SPLITS = ("train", "val")
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
LOC_TRAIN = "ILSVRC/Data/CLS-LOC/train"
LOC_VAL = "ILSVRC/Data/CLS-LOC/val"
LOC_TRAIN_LIST = "ILSVRC/ImageSets/CLS-LOC/train_cls.txt"


@dataclass
class Listing:
    """What a layout's reader finds: classes in file order, per split a frame of `path` and
    `synset`, and the rows naming an unsafe path (`file: column 'value'`)."""

    synsets: list[str]
    descriptions: list[str]
    frames: dict[str, pd.DataFrame]
    unsafe: list[str] = field(default_factory=list)


@dataclass
class IndexTable:
    """Classes in label order and, per split, its rows packed (`Split`: paths under the root, labels)."""

    classes: list[str]
    descriptions: list[str]
    splits: dict[str, Split]
    problems: list[dict[str, str]] = field(default_factory=list)
    unsafe: list[str] = field(default_factory=list)  # `file: column 'value'`; not saved

    def save(self, folder: Path) -> None:
        """The launcher's hand-off: classes.json and per split three .npy files (see `Split`)."""
        write_text(folder / "classes.json", json.dumps({"classes": self.classes,
                                                        "descriptions": self.descriptions}))
        for name, split in self.splits.items():
            split.save(folder, name)

    @classmethod
    def load(cls, folder: Path) -> IndexTable:
        """Each rank's copy: memory-mapped, so no row becomes a Python object."""
        meta = json.loads((folder / "classes.json").read_text())
        splits = {name: Split.load(folder, name) for name in SPLITS if Split.saved(folder, name)}
        return cls(meta["classes"], meta["descriptions"], splits)

    def counts(self) -> dict[str, dict[str, int]]:
        """Images and distinct classes per split, as `datasets show` and `datasets check` report them."""
        return {name: {"images": len(split), "classes": split.classes()}
                for name, split in self.splits.items()}


def build_index(
    fs: fsspec.AbstractFileSystem,
    root: str,
    layout: str,
    classes: int | list[str] | None = None,
    splits: tuple[str, ...] = SPLITS,
    on_bad_image: str = "skip",
) -> IndexTable:
    """Read the layout's metadata and return the (optionally class-subset) index.

    Under `on_bad_image = "error"` a row naming an unsafe path is a DataError here,
    before any worker starts; under "skip" it stays for the loader to skip.
    """
    import pandas as pd

    if layout == SHARDS:
        from ddp_cli.data.shards import shards_table

        return shards_table(fs, root, classes, splits)
    if layout not in LAYOUTS:
        raise ConfigError(f"layout {layout!r} is unknown; known layouts: {', '.join(KNOWN_LAYOUTS)}")
    root = root.rstrip("/")
    listing = LAYOUTS[layout](fs, root, splits)
    if listing.unsafe and on_bad_image == "error":
        raise DataError(f"{root}/{listing.unsafe[0]}: {UNSAFE_PATH}, never read ({len(listing.unsafe)} "
                        'such row(s)); fix the file, or set data.on_bad_image = "skip" to skip them')
    synsets, descriptions = listing.synsets, listing.descriptions
    problems: list[dict[str, str]] = []
    keep = select_classes(synsets, descriptions, classes)
    relabel = {synsets[old]: new for new, old in enumerate(keep)}
    known = set(synsets)
    out = {}
    for split, frame in listing.frames.items():
        # per distinct synset, not per row: 1.28 M rows have only ~1000 of them
        synset = pd.Categorical(frame["synset"])
        label_of = np.array([relabel.get(c, -1) for c in synset.categories] + [-1], dtype=np.int64)
        unknown_of = np.array([c not in known for c in synset.categories] + [True])
        paths = frame["path"].to_numpy()
        problems += [{"path": path, "reason": UNSAFE_PATH if escapes(path) else "unknown synset"}
                     for path in paths[unknown_of[synset.codes]]]
        labels = label_of[synset.codes]  # code -1 (a missing synset) picks the trailing -1/True
        chosen = labels >= 0
        out[split] = Split.of(paths[chosen], labels[chosen])
    return IndexTable([synsets[i] for i in keep], [descriptions[i] for i in keep], out, problems,
                      listing.unsafe)


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
        return with_retries(lambda: fs.cat_file(path), path).decode()
    except FileNotFoundError as e:
        raise DataError(f"{path}: missing; is the data set root right?") from e


def _read_csv(fs, path: str, columns: tuple[str, ...]) -> pd.DataFrame:
    """The CSV at `path` as strings; DataError naming the file if it lacks one of `columns`."""
    import pandas as pd

    try:
        frame = pd.read_csv(io.StringIO(_read_text(fs, path)), dtype=str, keep_default_na=False)
    except (pd.errors.EmptyDataError, pd.errors.ParserError) as e:
        raise DataError(f"{path}: not a CSV ({str(e).strip()}); its header must be "
                        f"{','.join(columns)}") from e
    for column in columns:
        if column not in frame.columns:
            raise DataError(f"{path}: no {column} column (found {', '.join(frame.columns)}); "
                            f"its header must be {','.join(columns)}")
    return frame


def _inside(name: str) -> str | None:
    """`name` (relative to its folder) normalised, or None if it is absolute or climbs out with `..`."""
    normal = posixpath.normpath(name)
    return None if normal.startswith("/") or normal.split("/")[0] == ".." else normal


def _under(folder: str, names: list[str], source: str, what: str) -> tuple[list[str], list[str]]:
    """`folder/<name>.JPEG` per name listed in `source`, and the unsafe rows (`source: what 'name'`).

    An unsafe name keeps its `..` or leading `/` (joined as posixpath does), so the
    path `escapes` and `FileReader` refuses it.
    """
    paths = [f"{folder}/{name}.JPEG" for name in names]
    joined = "\n" + "\n".join(names)
    if ".." not in joined and "\n/" not in joined:  # one scan at C speed spares 1.28 M checks
        return paths, []
    unsafe = []
    for i, name in enumerate(names):
        if name.startswith("/") or ".." in name:
            inside = _inside(name + ".JPEG")
            if inside is None:
                unsafe.append(f"{source}: {what} {name!r}")
            paths[i] = posixpath.join(folder, name + ".JPEG") if inside is None else f"{folder}/{inside}"
    return paths, unsafe


def _imagenet_loc(fs, root: str, splits: tuple[str, ...]) -> Listing:
    import pandas as pd

    mapping = _read_text(fs, f"{root}/LOC_synset_mapping.txt").splitlines()
    pairs = [line.split(" ", 1) for line in mapping if line.strip()]
    synsets = [p[0] for p in pairs]
    descriptions = [p[1].strip() if len(p) > 1 else p[0] for p in pairs]
    listing = Listing(synsets, descriptions, {})
    if "train" in splits:
        listing.frames["train"], listing.unsafe = _loc_train(fs, root)
    if "val" in splits:
        csv = _read_csv(fs, f"{root}/LOC_val_solution.csv", ("ImageId", "PredictionString"))
        paths, unsafe = _under(LOC_VAL, csv["ImageId"].tolist(), "LOC_val_solution.csv", "ImageId")
        listing.unsafe += unsafe
        listing.frames["val"] = pd.DataFrame({
            "path": paths,
            "synset": csv["PredictionString"].str.split(" ", n=1).str[0],
        }).sort_values("path", ignore_index=True)
    return listing


def _loc_train(fs, root: str) -> tuple[pd.DataFrame, list[str]]:
    """The train frame, and the rows of `train_cls.txt` naming an unsafe path."""
    import pandas as pd

    listing = f"{root}/{LOC_TRAIN_LIST}"
    if with_retries(lambda: fs.exists(listing), listing):
        # `<synset>/<ImageId> <n>` per line; plain str methods beat pandas' here
        lines = _read_text(fs, listing).splitlines()
        names = [line.partition(" ")[0] for line in lines if line.strip()]
        paths, unsafe = _under(LOC_TRAIN, names, LOC_TRAIN_LIST, "path")
        paths.sort()  # same order as a listing gives
        start = len(LOC_TRAIN) + 1
        return pd.DataFrame({"path": paths, "synset": [p[start:].partition("/")[0] for p in paths]}), unsafe
    files = _list_images(fs, f"{root}/{LOC_TRAIN}", root)
    return pd.DataFrame({"path": files, "synset": [p.split("/")[-2] for p in files]}), []


def _imagefolder(fs, root: str, splits: tuple[str, ...]) -> Listing:
    import pandas as pd

    if not with_retries(lambda: fs.isdir(f"{root}/train"), f"{root}/train"):
        raise DataError(f"{root}/train: missing; an imagefolder root holds train/<class>/ and val/<class>/")
    synsets = sorted(with_retries(lambda: [p.rstrip("/").split("/")[-1] for p in fs.ls(f"{root}/train",
                                  detail=False) if fs.isdir(p)], f"{root}/train"))
    frames = {}
    for split in splits:
        files = _list_images(fs, f"{root}/{split}", root)
        frames[split] = pd.DataFrame({"path": files, "synset": [p.split("/")[-2] for p in files]})
    return Listing(synsets, list(synsets), frames)


def _list_images(fs, folder: str, root: str) -> list[str]:
    if not with_retries(lambda: fs.isdir(folder), folder):
        raise DataError(f"{folder}: missing split folder; check the data set root")
    prefix = len(fs._strip_protocol(root).rstrip("/")) + 1
    return sorted(
        p[prefix:] for p in with_retries(lambda: fs.find(folder), folder)
        if p.lower().endswith(IMAGE_EXTENSIONS)
    )


LAYOUTS: dict[str, Callable[[fsspec.AbstractFileSystem, str, tuple[str, ...]], Listing]] = {
    "imagenet-loc": _imagenet_loc,
    "imagefolder": _imagefolder,
}


def infer_layout(fs: fsspec.AbstractFileSystem, root: str) -> str:
    """The layout of a root whose registry entry names none (DataSets.jl registries do not)."""
    root = root.rstrip("/")

    def has(name: str, check: Callable[[str], bool]) -> bool:
        return with_retries(lambda: check(f"{root}/{name}"), f"{root}/{name}")

    if has("index.json", fs.exists):
        return SHARDS
    if has("LOC_synset_mapping.txt", fs.exists):
        return "imagenet-loc"
    if has("train", fs.isdir) and has("val", fs.isdir):
        return "imagefolder"
    raise DataError(f"{root}: cannot tell its layout: neither LOC_synset_mapping.txt (imagenet-loc), "
                    "train/ and val/ folders (imagefolder) nor index.json (shards) are there; fix "
                    "storage.path or set layout in the registry entry")


SHARDS = "shards"  # written by `ddp datasets pack` (shards.py): an index, not a listing of files
KNOWN_LAYOUTS = (*LAYOUTS, SHARDS)
