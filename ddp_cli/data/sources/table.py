"""The index table every layout ends in: classes in label order and, per split, its rows packed.

A layout whose metadata is a listing of files (imagenet-loc, imagefolder) returns a
`Listing`; `from_listing` turns it into the `IndexTable` (classes chosen, rows relabelled,
unknown synsets and unsafe paths set aside), the same way for each.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from ddp_cli.data.fetch.storage import UNSAFE_PATH, escapes
from ddp_cli.data.sources.packed import Split
from ddp_cli.errors import ConfigError, DataError, did_you_mean
from ddp_cli.io import write_text

if TYPE_CHECKING:  # pandas builds the index in the launcher; ranks only load it (0.7 s less each)
    import pandas as pd

SPLITS = ("train", "val")
UNLABELED = "unlabeled"  # a registry entry's images nobody labelled (unlabeled.py), for FixMatch
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")


@dataclass
class Listing:
    """What a layout's reader finds: classes in file order, per split a frame of `path` and
    `synset`, the rows naming an unsafe path (`file: column 'value'`), and the rows it left out of
    the frames as unusable (`Rejected`: an empty or unknown label, a path listed twice)."""

    synsets: list[str]
    descriptions: list[str]
    frames: dict[str, pd.DataFrame]
    unsafe: list[str] = field(default_factory=list)
    rejected: list[Rejected] = field(default_factory=list)


@dataclass(frozen=True)
class Rejected:
    """A listed row no split holds: its path, why, and where it is (`labels.csv line 7`)."""

    path: str
    reason: str
    where: str


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
        names = (*SPLITS, UNLABELED)
        splits = {name: Split.load(folder, name) for name in names if Split.saved(folder, name)}
        return cls(meta["classes"], meta["descriptions"], splits)

    def counts(self) -> dict[str, dict[str, int]]:
        """Images and distinct classes per split, as `datasets show` and `datasets check` report them."""
        return {name: {"images": len(split), "classes": split.classes()}
                for name, split in self.splits.items()}


def from_listing(listing: Listing, root: str, classes: int | list[str] | None,
                 on_bad_image: str) -> IndexTable:
    """The (optionally class-subset) index of a layout's listing.

    Under `on_bad_image = "error"` a row naming an unsafe path, or one the reader rejected, is a
    DataError here, before any worker starts; under "skip" the first stays for the loader to skip,
    the second is a problem (`datasets check` lists it).
    """
    import pandas as pd

    if listing.unsafe and on_bad_image == "error":
        raise DataError(f"{root}/{listing.unsafe[0]}: {UNSAFE_PATH}, never read ({len(listing.unsafe)} "
                        'such row(s)); fix the file, or set data.on_bad_image = "skip" to skip them')
    if listing.rejected and on_bad_image == "error":
        first = listing.rejected[0]
        raise DataError(f"{root}/{first.where}: {first.reason} ({len(listing.rejected)} such row(s)); fix "
                        'the listing, or set data.on_bad_image = "skip" to leave them out')
    synsets, descriptions = listing.synsets, listing.descriptions
    problems = [{"path": row.path, "reason": f"{row.reason} ({row.where})"} for row in listing.rejected]
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


