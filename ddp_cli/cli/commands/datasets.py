"""`ddp datasets list | show | check | pack | index`: the registry's data sets, what their indexes
hold, their bad files, and packing them into shards (or indexing webdataset's).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from ddp_cli.data.registry import load_registry
from ddp_cli.data.sources.layouts import SHARDS, build_index
from ddp_cli.data.sources.shards import describe as describe_shards
from ddp_cli.data.sources.shards import read_index
from ddp_cli.data.sources.table import UNLABELED
from ddp_cli.errors import ConfigError


def datasets_list(registry: str | None) -> list[dict[str, Any]]:
    return [
        {"name": d.name, "driver": d.storage.driver, "path": d.storage.path,
         "layout": d.layout, "description": d.description}
        for d in load_registry(registry).datasets
    ]


def datasets_show(name: str, registry: str | None) -> dict[str, Any]:
    """The registry entry (no credentials: the registry holds none) and what its index holds."""
    entry = load_registry(registry).get(name)
    fs, root = entry.open()
    index = build_index(fs, root, entry.layout, options=entry.layout_options)
    packed = {"packed": describe_shards(read_index(fs, root))} if entry.layout == SHARDS else {}
    return {
        **entry.model_dump(mode="json", exclude_none=True, exclude={"storage"}),
        "storage": entry.storage.model_dump(mode="json", exclude_defaults=True),
        **packed,
        "splits": index.counts(),
        "classes": [{"index": i, "synset": synset, "description": text}
                    for i, (synset, text) in enumerate(zip(index.classes, index.descriptions, strict=True))],
    }


def datasets_check(name: str, registry: str | None, split: str, workers: int | None,
                   progress: Callable[[int, int], None] | None = None) -> dict[str, Any]:
    """`check_dataset` on the registry entry; `split` is train, val or all."""
    from ddp_cli.data.pipeline.check import check_dataset

    splits = ("train", "val") if split == "all" else (split,)
    entry = load_registry(registry).get(name)
    fs, root = entry.open()
    return {"name": entry.name, "root": entry.storage.path,
            **check_dataset(fs, root, entry.layout, splits, workers, progress, entry.layout_options)}


def datasets_pack(name: str, to: str, registry: str | None, split: str, settings: dict[str, Any],
                  workers: int, progress: Callable[[int, int], None] | None = None) -> dict[str, Any]:
    """`pack` the registry entry `name` into `to` (`split`: train, val or all: both, and the entry's
    `unlabeled` split when it names one); `settings` are `PackOptions`' (max_side, quality, shard_mib,
    on_bad_image)."""
    from ddp_cli.data.pack.writer import PackOptions, Source, pack, pack_index

    opts = PackOptions(**settings)
    entry = load_registry(registry).get(name)
    splits = ("train", "val", *((UNLABELED,) if entry.unlabeled else ())) if split == "all" else (split,)
    fs, root = entry.open()
    if entry.layout == SHARDS:
        raise ConfigError(f"data set {name!r} is packed already (layout shards); pack its source instead")
    index = pack_index(fs, root, entry.layout, splits, opts.on_bad_image, entry.layout_options,
                       entry.unlabeled)
    source = Source(fs, root, entry.name, entry.layout, entry.storage.path)
    return pack(source, index, to, replace(opts, splits=splits), workers, progress)


def datasets_index(root: str, splits: dict[str, str], classes: str | None,
                   progress: Callable[[int, int], None] | None = None) -> dict[str, Any]:
    """Index tar shards written by the webdataset library, so `layout = "shards"` reads them."""
    from ddp_cli.data.pack.wds_index import index_shards

    return index_shards(root, splits, classes, progress)
