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

Validation deals in order, rank r taking r, r+k, ...: every image exactly once,
nothing padded or dropped.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
from torch.utils.data import Sampler

from ddp_cli.data.seeds import derived_seed


def permutation(n: int, seed: int, epoch: int) -> torch.Tensor:
    return torch.randperm(n, generator=torch.Generator().manual_seed(derived_seed(seed, epoch)))


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
    (train, `shuffle`), or in order, every k-th image (val).

    `set_epoch(epoch, skip)` resumes mid-epoch: the first `skip` positions of the
    epoch's order (trained on by all ranks together: whole global batches) are left
    out and the rest dealt over this sampler's ranks, whatever the world size that
    consumed them. With `with_epoch` it yields `(index, epoch, copy)` for `EpochItems`
    (copy: which of the repeated-augmentation copies, 0 without).
    """

    def __init__(self, n: int, rank: int, world_size: int, shuffle: bool, seed: int = 0,
                 batch_size: int = 1, repeats: int = 1, with_epoch: bool = False) -> None:
        self.n, self.rank, self.world_size, self.batch_size = n, rank, world_size, batch_size
        self.shuffle, self.seed, self.repeats, self.with_epoch = shuffle, seed, repeats, with_epoch
        self.chunk = world_size * batch_size  # positions per global batch
        self.epoch, self.skip, self.layout = 0, 0, self.chunk

    def set_epoch(self, epoch: int, skip: int = 0, layout: int = 0) -> None:
        """`layout`: the chunk the epoch's order was laid out for when it began at another world size
        (repeated augmentation spaces copies by it); 0 = this sampler's."""
        self.epoch, self.skip, self.layout = epoch, skip, layout or self.chunk

    def order(self) -> torch.Tensor:
        """The epoch's (index, copy) rows, all ranks'."""
        return repeated(permutation(self.n, self.seed, self.epoch), self.repeats, self.layout)

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
