"""Semi-supervised data: which train images keep their labels, and the endless unlabelled stream.

`labels_per_class = N` keeps N images per class of the train split, drawn by the
seed alone (every rank draws the same, before any loader process exists, so the
subset is the same at any number of them and after a resume). Under FixMatch the
rest of the split becomes the unlabelled split, its labels kept only to measure
the pseudo-labels; a registry entry's own `unlabeled` split takes its place.
SimCLR (`pretrain.method`) reads no label: it trains on the whole train split
followed by the registry's unlabeled split, where the entry names one.

The unlabelled stream runs across the labelled epochs: its own epochs (passes
over the unlabelled split, each a fresh order) are dealt over the ranks by the
train sampler (`ShardSampler`, batch mu x batch_size), each image once per pass
across the world, and its position, (pass, positions consumed in it by all
ranks), is the run's state: a resume, at any world size, deals the rest of the
pass over the ranks there are, as the labelled epoch's rest is.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

import fsspec
import numpy as np
from torch.utils.data import Sampler

from ddp_cli.config import EMA_BN_IMAGES, RunConfig, SemiConfig
from ddp_cli.config.resolve import require_resolved
from ddp_cli.data.fetch.retry import IoPolicy
from ddp_cli.data.pipeline.loaders import (
    EpochItems,
    Loaders,
    ViewsDataset,
    build_loaders,
    make_loader,
    shard_cache,
)
from ddp_cli.data.pipeline.sampler import ShardSampler
from ddp_cli.data.pipeline.seeds import derived_seed
from ddp_cli.data.pipeline.views import contrastive_views, fixmatch_views
from ddp_cli.data.sources.packed import Split
from ddp_cli.data.sources.table import IndexTable
from ddp_cli.data.sources.unlabeled import UNLABELED
from ddp_cli.errors import ConfigError

LABELLED, UNLABELLED = 2, 3  # derived_seed streams: the labelled subset's draw, the views' augmentation


def labelled_rows(labels: np.ndarray, per_class: int, seed: int) -> np.ndarray:
    """Row numbers (sorted) of `per_class` images of each class, drawn by `seed` alone."""
    rng = np.random.default_rng(derived_seed(seed, stream=LABELLED))
    chosen = []
    for label in np.unique(labels):
        rows = np.flatnonzero(labels == label)
        if len(rows) < per_class:
            raise ConfigError(f"semi.labels_per_class: class {label} of the train split has {len(rows)} "
                              f"images, fewer than {per_class}; lower semi.labels_per_class")
        chosen.append(rng.permutation(rows)[:per_class])
    return np.sort(np.concatenate(chosen))


def take(split: Split, rows: np.ndarray, labels: np.ndarray | None = None) -> Split:
    """The split's rows `rows` (sorted), in order; a packed split's shards keep their rows together."""
    members = None if split.members is None else split.members[rows]
    starts = None if split.starts is None else np.searchsorted(rows, split.starts)
    return Split.of([split.paths[int(i)] for i in rows], split.labels[rows] if labels is None else labels,
                    members, starts, split.container)


def semi_splits(train: Split, unlabeled: Split | None, semi: SemiConfig,
                seed: int) -> tuple[Split, Split | None]:
    """(labelled split, unlabelled split or None): see the module's docstring."""
    labelled, rest = train, None
    if semi.labels_per_class is not None:
        keep = labelled_rows(np.asarray(train.labels), semi.labels_per_class, seed)
        labelled = take(train, keep)
        rest = take(train, np.setdiff1d(np.arange(len(train)), keep))
    if not semi.on():
        return labelled, None
    unlabelled = unlabeled if unlabeled is not None else rest
    if unlabelled is None or not len(unlabelled):
        raise ConfigError(f'semi.method: "{semi.method}" needs unlabelled images: name an unlabeled split in '
                          "the data set's registry entry, or set semi.labels_per_class")
    return labelled, unlabelled


def run_splits(index: IndexTable, cfg: RunConfig) -> tuple[Split, Split | None]:
    """(the split the run's train loader reads, FixMatch's unlabelled split or None): `semi_splits`'s, or
    under pretrain.method every train image and then the registry's unlabeled split's, labels unread."""
    train, unlabeled = index.splits["train"], index.splits.get(UNLABELED)
    if cfg.pretrain.on():
        return (train if unlabeled is None else train.joined(unlabeled)), None
    return semi_splits(train, unlabeled, cfg.semi, cfg.seed)


def check_unlabelled(images: int, world_size: int, cfg: RunConfig) -> None:
    """A pass over the unlabelled split holds at least one micro-step of every rank."""
    if images < world_size * cfg.data.batch_size * cfg.semi.mu:
        raise ConfigError(f"semi.mu: the {images} unlabelled images are fewer than one step takes "
                          f"(world size {world_size} x batch_size {cfg.data.batch_size} x mu {cfg.semi.mu}); "
                          "lower semi.mu or data.batch_size")


def position(n: int, chunk: int, epoch: int, seen: int) -> tuple[int, int]:
    """(pass, positions consumed), moved on to the next pass where what is left of this one is less than
    a chunk (one micro-step of every rank: the sampler drops it)."""
    return (epoch + 1, 0) if n - seen < chunk else (epoch, seen)


class UnlabelledStream(Sampler):
    """Endless: pass after pass of the unlabelled split, from `start(pass, consumed)`, this rank's share
    (`ShardSampler`: blocks of mu x batch_size, (index, pass, 0) items for `EpochItems`)."""

    def __init__(self, sampler: ShardSampler) -> None:
        self.sampler, self.n, self.chunk = sampler, sampler.n, sampler.chunk
        self.epoch, self.seen = 0, 0

    def start(self, epoch: int, seen: int) -> None:
        self.epoch, self.seen = epoch, seen

    def advance(self, epoch: int, seen: int) -> tuple[int, int]:
        """The position after one micro-step of every rank from (epoch, seen)."""
        return position(self.n, self.chunk, epoch, seen + self.chunk)

    def __iter__(self) -> Iterator[tuple[int, int, int]]:
        epoch, seen = position(self.n, self.chunk, self.epoch, self.seen)
        while True:
            self.sampler.set_epoch(epoch, skip=seen)
            yield from iter(self.sampler)
            epoch, seen = epoch + 1, 0


def build_semi_loaders(cfg: RunConfig, fs: fsspec.AbstractFileSystem, root: str, index: IndexTable,
                       rank: int, world_size: int, pin_memory: bool) -> Loaders:
    """`build_loaders` over the labelled split (with the EMA's BatchNorm sample where the run recomputes its
    statistics), and under FixMatch the unlabelled stream's loader; under pretrain.method, over the whole
    train split and the registry's unlabeled split in SimCLR's views."""
    require_resolved(cfg, "the loaders")
    labelled, unlabelled = run_splits(index, cfg)
    index = replace(index, splits={**index.splits, "train": labelled})
    if cfg.pretrain.on():  # every image, as its two views
        views = contrastive_views(cfg.data, cfg.augment, cfg.pretrain, defer=cfg.data.decode == "gpu")
        return build_loaders(cfg.data, fs, root, index, rank, world_size, cfg.seed, pin_memory,
                             augment=cfg.augment, views=views)
    loaders = build_loaders(cfg.data, fs, root, index, rank, world_size, cfg.seed, pin_memory,
                            augment=cfg.augment, calibration=EMA_BN_IMAGES if cfg.train.ema_bn_epochs else 0)
    if unlabelled is None:
        return loaders
    check_unlabelled(len(unlabelled), world_size, cfg)
    data, batch = cfg.data, cfg.data.batch_size * cfg.semi.mu
    views = fixmatch_views(data, cfg.augment, cfg.semi, defer=data.decode == "gpu")  # as training's images
    dataset = ViewsDataset(fs, root, unlabelled, views, data.on_bad_image, views.size, data.cache_dir,
                           shard_cache(data), IoPolicy.of(data), data.shuffle_shards)
    seed = derived_seed(cfg.seed, stream=UNLABELLED)
    stream = UnlabelledStream(ShardSampler(len(dataset), rank, world_size, shuffle=True, seed=seed,
                                           batch_size=batch, with_epoch=True, shards=unlabelled.starts,
                                           window=data.shuffle_shards))
    loader = make_loader(EpochItems(dataset, seed), stream, batch, data.workers, data.prefetch_factor,
                         pin_memory, drop_last=True, seed=seed + rank)
    return replace(loaders, unlabelled=loader, unlabelled_stream=stream)
