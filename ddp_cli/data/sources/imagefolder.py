"""`layout = "imagefolder"`: torchvision's `train/<class>/*`, `val/<class>/*`."""

from __future__ import annotations

import fsspec

from ddp_cli.data.fetch.retry import with_retries
from ddp_cli.data.sources.files import list_images
from ddp_cli.data.sources.table import Listing
from ddp_cli.errors import DataError


def listing(fs: fsspec.AbstractFileSystem, root: str, splits: tuple[str, ...]) -> Listing:
    import pandas as pd

    if not with_retries(lambda: fs.isdir(f"{root}/train"), f"{root}/train"):
        raise DataError(f"{root}/train: missing; an imagefolder root holds train/<class>/ and val/<class>/")
    synsets = sorted(with_retries(lambda: [p.rstrip("/").split("/")[-1] for p in fs.ls(f"{root}/train",
                                  detail=False) if fs.isdir(p)], f"{root}/train"))
    frames = {}
    for split in splits:
        files = list_images(fs, f"{root}/{split}", root)
        frames[split] = pd.DataFrame({"path": files, "synset": [p.split("/")[-2] for p in files]})
    return Listing(synsets, list(synsets), frames)
