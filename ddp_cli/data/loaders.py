"""Feeding N replicas: sharded sampling, the image dataset, DataLoader construction.

Training shards a fresh permutation per epoch without replacement, rank r taking
positions r, r+k, r+2k, ...: the k per-rank batches of step s together are
exactly positions [s*k*b, (s+1)*k*b) of the permutation, i.e. the batch one
process with batch k*b would see. Validation shards without padding, so every
image is counted exactly once whatever the world size.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import fsspec
import numpy as np
import pandas as pd
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from ddp_cli.config import DataConfig
from ddp_cli.data.images import BadImage, open_image
from ddp_cli.data.layouts import IndexTable
from ddp_cli.data.transforms import TrainTransform, ValTransform

SKIP_ATTEMPTS = 16


class ShardSampler(Sampler[int]):
    """Rank `rank`'s share of [0, n): shuffled per epoch (train) or in order (val)."""

    def __init__(self, n: int, rank: int, world_size: int, shuffle: bool, seed: int = 0) -> None:
        self.n, self.rank, self.world_size = n, rank, world_size
        self.shuffle, self.seed, self.epoch = shuffle, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def _order(self) -> list[int]:
        if not self.shuffle:
            return list(range(self.n))
        # (seed, epoch) mixed, so seed s at epoch e+1 is not seed s+1 at epoch e
        g = torch.Generator().manual_seed(int(np.random.SeedSequence([self.seed, self.epoch])
                                              .generate_state(1)[0]))
        order = torch.randperm(self.n, generator=g)
        return order[: self.n - self.n % self.world_size].tolist()  # equal shares, no repeats

    def __iter__(self) -> Iterator[int]:
        return iter(self._order()[self.rank :: self.world_size])

    def __len__(self) -> int:
        if self.shuffle:
            return self.n // self.world_size
        return len(range(self.rank, self.n, self.world_size))


class ImageDataset(Dataset):
    """Reads `root/path` through fsspec, decodes, transforms; applies the bad-image policy.

    Items are `(uint8 HWC image, label, skipped, error)`. Under "skip" a bad file
    is replaced by the next good one and counted in `skipped`; under "error" the
    item carries the message and the trainer raises it, so a worker process
    never dies with a traceback and every rank learns of it the same way.
    """

    def __init__(
        self,
        fs: fsspec.AbstractFileSystem,
        root: str,
        table: pd.DataFrame,
        transform: Callable,
        on_bad_image: str = "error",
        out_size: int = 224,
    ) -> None:
        self.fs, self.root, self.transform = fs, root.rstrip("/"), transform
        self.paths = table["path"].tolist()
        self.labels = table["label"].tolist()
        self.on_bad_image, self.out_size = on_bad_image, out_size

    def __len__(self) -> int:
        return len(self.paths)

    def load(self, index: int) -> torch.Tensor:
        path = f"{self.root}/{self.paths[index]}"
        try:
            data = self.fs.cat_file(path)
        except FileNotFoundError as e:
            raise BadImage("missing file") from e
        return self.transform(open_image(data))

    def __getitem__(self, index: int):
        for skipped in range(SKIP_ATTEMPTS):
            candidate = (index + skipped * 7919) % len(self.paths)  # a prime stride
            try:
                return self.load(candidate), self.labels[candidate], skipped, ""
            except BadImage as e:
                message = f"{self.root}/{self.paths[candidate]}: {e}"
                if self.on_bad_image == "error":
                    break
        blank = torch.zeros(self.out_size, self.out_size, 3, dtype=torch.uint8)
        return blank, self.labels[index], 0, message


@dataclass
class Loaders:
    train: DataLoader | None
    val: DataLoader
    train_sampler: ShardSampler | None


def make_loader(
    dataset: ImageDataset,
    sampler: ShardSampler,
    batch_size: int,
    workers: int,
    prefetch_factor: int,
    pin_memory: bool,
    drop_last: bool,
    seed: int,
) -> DataLoader:
    """A DataLoader with persistent prefetching workers and a seeded augmentation RNG."""
    return DataLoader(
        dataset,
        batch_size=batch_size,
        sampler=sampler,
        num_workers=workers,
        persistent_workers=workers > 0,
        prefetch_factor=prefetch_factor if workers > 0 else None,
        pin_memory=pin_memory,
        drop_last=drop_last,
        generator=torch.Generator().manual_seed(seed),
    )


def build_loaders(
    cfg: DataConfig,
    fs: fsspec.AbstractFileSystem,
    root: str,
    index: IndexTable,
    rank: int,
    world_size: int,
    seed: int,
    pin_memory: bool,
    train: bool = True,
) -> Loaders:
    """This rank's train and val loaders (`train=False` for validation-only jobs)."""

    def loader(split: str, transform: Callable, shuffle: bool) -> tuple[DataLoader, ShardSampler]:
        table = index.splits[split]
        dataset = ImageDataset(fs, root, table, transform, cfg.on_bad_image, cfg.image_size)
        sampler = ShardSampler(len(dataset), rank, world_size, shuffle=shuffle, seed=seed)
        return make_loader(dataset, sampler, cfg.batch_size, cfg.workers, cfg.prefetch_factor,
                           pin_memory, drop_last=shuffle, seed=seed + 1000 * (rank + 1)), sampler

    val, _ = loader("val", ValTransform(cfg.image_size, cfg.val_resize), shuffle=False)
    if not train:
        return Loaders(None, val, None)
    transform = TrainTransform(cfg.image_size, cfg.min_crop_scale, cfg.hflip)
    train_loader, sampler = loader("train", transform, shuffle=True)
    return Loaders(train_loader, val, sampler)
