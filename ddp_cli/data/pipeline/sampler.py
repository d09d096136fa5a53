"""Which positions of an epoch's order each rank trains on, so that k ranks are one process.

Training deals the epoch's order in global chunks of k*b positions (k ranks, b
images each) and rank r takes the BLOCK [r*b, (r+1)*b) of every chunk: step s's
k batches are positions [s*k*b, (s+1)*k*b) in order, the very batch one process
with batch k*b takes at step s. Blocks, not every k-th position, because batch
mixing pairs adjacent positions (2j, 2j+1) of a batch: with b even no pair
crosses a rank, and the single process pairs the same images. Positions past
the last whole chunk are dropped (the epoch's partial step).

Repeated augmentation (m copies, torchvision's RASampler, timm's
RepeatAugSampler) keeps the epoch at n positions, n the split's size: the
order shows about n/m images of the permutation m times each. They come in
groups of q = floor(k*b/m) images laid out m times over (q images, the same q
again, ...), so the copies of an image sit q apart; q >= b puts them on m
different ranks whenever k >= m, including a group that straddles two chunks.
The layout depends on k*b alone, so one process with batch k*b sees it too.

A packed data set (`layout = "shards"`) is read a few shards at a time, so the
epoch's order is not one permutation of every image: the shards come in a
fresh (seed, epoch) order, `window` at a time, and the images of each window are
shuffled together (`shard_order`). It depends on (seed, epoch) alone, like the
permutation it replaces, so everything above holds for shards too.

Validation deals in order, rank r taking r, r+k, ...: every image exactly once,
nothing padded or dropped.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np
import torch
from torch.utils.data import Sampler

from ddp_cli.data.pipeline.seeds import derived_seed


def permutation(n: int, seed: int, epoch: int) -> torch.Tensor:
    return torch.randperm(n, generator=torch.Generator().manual_seed(derived_seed(seed, epoch)))


def shard_sequence(shards: int, g: torch.Generator) -> list[int]:
    """The epoch's order of the shards: `g`'s first draw (seeded by (seed, epoch)), so a loader process
    that knows (seed, epoch) knows which shards come next (shard_reader.py downloads them ahead)."""
    return torch.randperm(shards, generator=g).tolist()


def shard_order(starts: np.ndarray, seed: int, epoch: int, window: int) -> torch.Tensor:
    """Rows of shards in a (seed, epoch) order, read `window` shards at a time, the rows of each window
    permuted together; the rows of shard j are starts[j]:starts[j + 1]."""
    g = torch.Generator().manual_seed(derived_seed(seed, epoch))
    shards = shard_sequence(len(starts) - 1, g)
    windows = []
    for first in range(0, len(shards), window):
        group = shards[first:first + window]
        rows = torch.cat([torch.arange(int(starts[j]), int(starts[j + 1])) for j in group])
        windows.append(rows[torch.randperm(len(rows), generator=g)])
    return torch.cat(windows) if windows else torch.zeros(0, dtype=torch.int64)


def repeated(order: torch.Tensor, repeats: int, chunk: int) -> torch.Tensor:
    """(index, copy) rows, as many as `order` has: each group of q = chunk // repeats images of
    `order` `repeats` times over, copy c of the group's i-th image at position c*q + i of the group."""
    n = len(order)
    if repeats == 1:
        return torch.stack([order, torch.zeros_like(order)], 1)
    q = max(1, min(chunk, n) // repeats)
    groups = math.ceil(n / (repeats * q))  # groups * q <= n/m + q <= n: enough images for m >= 2
    images = order[: groups * q].view(groups, 1, q).expand(groups, repeats, q)
    copies = torch.arange(repeats).view(1, repeats, 1).expand(groups, repeats, q)
    return torch.stack([images.reshape(-1), copies.reshape(-1)], 1)[:n]


def deal(rows: torch.Tensor, rank: int, world_size: int, batch_size: int) -> torch.Tensor:
    """Rank `rank`'s block of every whole chunk of `world_size` x `batch_size` rows."""
    steps = len(rows) // (world_size * batch_size)
    chunks = rows[: steps * world_size * batch_size].view(steps, world_size, batch_size, -1)
    return chunks[:, rank].reshape(-1, rows.shape[1])


class ShardSampler(Sampler):
    """Rank `rank`'s share of [0, n): a fresh order every epoch, dealt in blocks of `batch_size`
    (train, `shuffle`), or in order, every k-th image (val). `shards`/`window`: a packed split's shard
    starts and how many shards are read at a time (`shard_order`).

    `set_epoch(epoch, skip)` resumes mid-epoch: the first `skip` positions of the
    epoch's order (trained on by all ranks together: whole global batches) are left
    out and the rest dealt over this sampler's ranks, whatever the world size that
    consumed them. With `with_epoch` it yields `(index, epoch, copy)` for `EpochItems`
    (copy: which of the repeated-augmentation copies, 0 without).
    """

    def __init__(self, n: int, rank: int, world_size: int, shuffle: bool, seed: int = 0,
                 batch_size: int = 1, repeats: int = 1, with_epoch: bool = False,
                 shards: np.ndarray | None = None, window: int = 1) -> None:
        self.n, self.rank, self.world_size, self.batch_size = n, rank, world_size, batch_size
        self.shuffle, self.seed, self.repeats, self.with_epoch = shuffle, seed, repeats, with_epoch
        self.chunk = world_size * batch_size  # positions per global batch
        self.epoch, self.skip, self.layout = 0, 0, self.chunk
        self.shards, self.window = shards, window  # packed: first row of each shard, then n

    def set_epoch(self, epoch: int, skip: int = 0, layout: int = 0) -> None:
        """`layout`: the chunk the epoch's order was laid out for when it began at another world size
        (repeated augmentation spaces copies by it); 0 = this sampler's."""
        self.epoch, self.skip, self.layout = epoch, skip, layout or self.chunk

    def order(self) -> torch.Tensor:
        """The epoch's (index, copy) rows, all ranks'."""
        order = (permutation(self.n, self.seed, self.epoch) if self.shards is None
                 else shard_order(self.shards, self.seed, self.epoch, self.window))
        return repeated(order, self.repeats, self.layout)

    def __iter__(self) -> Iterator[int] | Iterator[tuple[int, int, int]]:
        if not self.shuffle:
            return iter(range(self.rank, self.n, self.world_size))
        mine = deal(self.order()[self.skip :], self.rank, self.world_size, self.batch_size).tolist()
        if self.with_epoch:
            return ((index, self.epoch, copy) for index, copy in mine)
        return (index for index, _ in mine)

    def __len__(self) -> int:
        if self.shuffle:
            return self.n // self.chunk * self.batch_size
        return len(range(self.rank, self.n, self.world_size))
