"""A registry entry's `unlabeled` split: a folder of images under the root that nobody labelled.

Whatever the entry's layout, the folder is listed through the same filesystem
(local or S3), every image under it at any depth, each of label -1 (unknown).
FixMatch (`semi.method = "fixmatch"`) learns from it; nothing else reads it.
"""

from __future__ import annotations

import fsspec
import numpy as np

from ddp_cli.data.sources.files import list_images
from ddp_cli.data.sources.packed import Split
from ddp_cli.data.sources.table import UNLABELED
from ddp_cli.errors import DataError

__all__ = ["UNLABELED", "unlabeled_split"]
UNKNOWN = -1  # the label of an image nobody labelled


def unlabeled_split(fs: fsspec.AbstractFileSystem, root: str, folder: str) -> Split:
    """Every image under `root/folder`, paths relative to the root, labels unknown."""
    where = f"{root.rstrip('/')}/{folder.strip('/')}"
    try:
        files = list_images(fs, where, root)
    except DataError:
        raise DataError(f"{where}: missing; the registry entry's unlabeled names a folder of images under "
                        "the data set's root") from None
    if not files:
        raise DataError(f"{where}: no images (any of .jpg, .png, .webp, ...); put the unlabelled images "
                        "there or remove unlabeled from the registry entry")
    return Split.of(files, np.full(len(files), UNKNOWN))
