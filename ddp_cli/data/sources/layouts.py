"""The layouts a registry entry may name, each one reader, and the index table they all end in.

A layout is one module of this folder and one entry of `LAYOUTS`: its name (the
registry's `layout`) and a function from (filesystem, root, classes, splits,
on_bad_image) to an `IndexTable`. Layouts whose metadata lists files return a
`Listing` and share `table.from_listing`; `shards` reads its own index. `csv` and
`parquet` have options of their own (`LayoutOptions`): the registry's
`[datasets.csv]` (`CsvListing`) and `[datasets.parquet]` (`ParquetOptions`).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import fsspec

from ddp_cli.data.fetch.retry import with_retries
from ddp_cli.data.sources import csv_layout, imagefolder, imagenet_loc
from ddp_cli.data.sources.csv_layout import CSV, CsvListing
from ddp_cli.data.sources.parquet import PARQUET, ParquetOptions, parquet_table
from ddp_cli.data.sources.shards import SHARDS, shards_table
from ddp_cli.data.sources.table import SPLITS, IndexTable, Listing, from_listing
from ddp_cli.errors import ConfigError, DataError

Reader = Callable[[fsspec.AbstractFileSystem, str, int | list[str] | None, tuple[str, ...], str], IndexTable]
LayoutOptions = CsvListing | ParquetOptions  # a registry entry's table of its layout's own, if any


def listed(read: Callable[[fsspec.AbstractFileSystem, str, tuple[str, ...]], Listing]) -> Reader:
    """A layout that lists files, as a `Reader`."""
    return lambda fs, root, classes, splits, on_bad_image: from_listing(
        read(fs, root, splits), root, classes, on_bad_image)


LAYOUTS: dict[str, Reader] = {
    "imagenet-loc": listed(imagenet_loc.listing),
    "imagefolder": listed(imagefolder.listing),
    SHARDS: lambda fs, root, classes, splits, on_bad_image: shards_table(fs, root, classes, splits),
    CSV: listed(csv_layout.listing),
    PARQUET: parquet_table,  # Hugging Face `datasets` Parquet (parquet.py)
}
KNOWN_LAYOUTS = tuple(LAYOUTS)


def build_index(
    fs: fsspec.AbstractFileSystem,
    root: str,
    layout: str,
    classes: int | list[str] | None = None,
    splits: tuple[str, ...] = SPLITS,
    on_bad_image: str = "skip",
    options: LayoutOptions | None = None,
) -> IndexTable:
    """The layout's (optionally class-subset) index of the data set at `root`; `options`: the layout's
    own (the registry entry's `layout_options`), if not the defaults."""
    if layout not in LAYOUTS:
        raise ConfigError(f"layout {layout!r} is unknown; known layouts: {', '.join(KNOWN_LAYOUTS)}")
    reader = LAYOUTS[layout]
    if layout == CSV:
        reader = listed(partial(csv_layout.listing, spec=options))
    elif layout == PARQUET:
        reader = partial(parquet_table, spec=options)
    return reader(fs, root.rstrip("/"), classes, splits, on_bad_image)


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
    if has("*.parquet", fs.glob) or has("data/*.parquet", fs.glob):
        return PARQUET
    raise DataError(f"{root}: cannot tell its layout: neither LOC_synset_mapping.txt (imagenet-loc), "
                    "train/ and val/ folders (imagefolder), index.json (shards) nor *.parquet files "
                    "(parquet, also under data/) are there; fix storage.path or set layout in the registry "
                    "entry")
