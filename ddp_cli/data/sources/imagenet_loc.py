"""`layout = "imagenet-loc"`: the Kaggle ImageNet localization archive.

Its `LOC_train_solution.csv` lists only the ~544k train images that have boxes, so
the train split is every image under `ILSVRC/Data/CLS-LOC/train/<synset>/`,
labelled by its folder: read from `ILSVRC/ImageSets/CLS-LOC/train_cls.txt` when
present (no listing of a million objects on S3), else by listing the folders.
Val labels are the first synset of `PredictionString` in `LOC_val_solution.csv`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import fsspec

from ddp_cli.data.fetch.retry import with_retries
from ddp_cli.data.sources.files import list_images, read_csv, read_text, under
from ddp_cli.data.sources.table import Listing

if TYPE_CHECKING:
    import pandas as pd

LOC_TRAIN = "ILSVRC/Data/CLS-LOC/train"
LOC_VAL = "ILSVRC/Data/CLS-LOC/val"
LOC_TRAIN_LIST = "ILSVRC/ImageSets/CLS-LOC/train_cls.txt"


def listing(fs: fsspec.AbstractFileSystem, root: str, splits: tuple[str, ...]) -> Listing:
    import pandas as pd

    mapping = read_text(fs, f"{root}/LOC_synset_mapping.txt").splitlines()
    pairs = [line.split(" ", 1) for line in mapping if line.strip()]
    synsets = [p[0] for p in pairs]
    descriptions = [p[1].strip() if len(p) > 1 else p[0] for p in pairs]
    listing = Listing(synsets, descriptions, {})
    if "train" in splits:
        listing.frames["train"], listing.unsafe = _loc_train(fs, root)
    if "val" in splits:
        csv = read_csv(fs, f"{root}/LOC_val_solution.csv", ("ImageId", "PredictionString"))
        paths, unsafe = under(LOC_VAL, csv["ImageId"].tolist(), "LOC_val_solution.csv", "ImageId")
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
        lines = read_text(fs, listing).splitlines()
        names = [line.partition(" ")[0] for line in lines if line.strip()]
        paths, unsafe = under(LOC_TRAIN, names, LOC_TRAIN_LIST, "path")
        paths.sort()  # same order as a listing gives
        start = len(LOC_TRAIN) + 1
        return pd.DataFrame({"path": paths, "synset": [p[start:].partition("/")[0] for p in paths]}), unsafe
    files = list_images(fs, f"{root}/{LOC_TRAIN}", root)
    return pd.DataFrame({"path": files, "synset": [p.split("/")[-2] for p in files]}), []
