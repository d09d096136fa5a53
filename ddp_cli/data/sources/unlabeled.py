"""A registry entry's `unlabeled` split: the images nobody labelled, in the entry's own layout.

Where the layout lists files (imagefolder, imagenet-loc, csv), `unlabeled` names a
folder under the root, every image under it at any depth. In a packed root
(`shards`) it names a split of index.json (`ddp datasets pack --split all` packs
a source's `unlabeled` split as `unlabeled`, labels -1), in a Parquet root (`parquet`)
the split of the files `<name>-*.parquet`, as Hugging Face `datasets` names its
splits; their labels, if any, are ignored. Each
image's label is -1 (unknown), through the same filesystem (local or S3).
FixMatch and its successors (`semi.method`) learn from it, SimCLR
(`pretrain.method`) after the train split; nothing else reads it.
"""

from __future__ import annotations

import fsspec
import numpy as np

from ddp_cli.data.sources.files import list_images
from ddp_cli.data.sources.packed import PARQUET, Split
from ddp_cli.data.sources.parquet import parquet_unlabeled
from ddp_cli.data.sources.shards import SHARDS, packed_split, read_index
from ddp_cli.data.sources.table import UNLABELED
from ddp_cli.errors import DataError

__all__ = ["UNLABELED", "unlabeled_split"]
UNKNOWN = -1  # the label of an image nobody labelled


def unlabeled_split(fs: fsspec.AbstractFileSystem, root: str, layout: str, name: str,
                    on_bad_image: str = "skip") -> Split:
    """The entry's unlabelled split `name` (module docstring), paths as its layout's, labels unknown."""
    root = root.rstrip("/")
    if layout == SHARDS:
        return packed_split(fs, root, read_index(fs, root), name, None)
    if layout == PARQUET:
        return parquet_unlabeled(fs, root, name, on_bad_image)
    return folder_split(fs, root, name)


def folder_split(fs: fsspec.AbstractFileSystem, root: str, folder: str) -> Split:
    """Every image under `root/folder`, paths relative to the root, labels unknown."""
    where = f"{root}/{folder.strip('/')}"
    try:
        files = list_images(fs, where, root)
    except DataError:
        raise DataError(f"{where}: missing; the registry entry's unlabeled names a folder of images under "
                        "the data set's root") from None
    if not files:
        raise DataError(f"{where}: no images (any of .jpg, .png, .webp, ...); put the unlabelled images "
                        "there or remove unlabeled from the registry entry")
    return Split.of(files, np.full(len(files), UNKNOWN))
