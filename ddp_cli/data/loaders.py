"""Feeding N replicas: sharded sampling, the image dataset, DataLoader construction.

Training shards a fresh permutation per epoch without replacement, rank r taking
positions r, r+k, r+2k, ...: the k per-rank batches of step s together are
exactly positions [s*k*b, (s+1)*k*b) of the permutation, i.e. the batch one
process with batch k*b would see. Validation shards without padding, so every
image is counted exactly once whatever the world size.
"""

from __future__ import annotations

import gc
import signal
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import fsspec
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from ddp_cli.config import DataConfig
from ddp_cli.data.images import BadImage, EncodedImage, open_image
from ddp_cli.data.layouts import IndexTable
from ddp_cli.data.packed import Split
from ddp_cli.data.storage import FileReader, UnsafePath
from ddp_cli.data.transforms import TrainTransform, ValTransform
from ddp_cli.errors import DataError

SKIP_ATTEMPTS = 16


class ShardSampler(Sampler[int]):
    """Rank `rank`'s share of [0, n): shuffled per epoch (train) or in order (val).

    `set_epoch(epoch, skip)` resumes mid-epoch: the first `skip` positions of the
    epoch's permutation (already trained on, by all ranks together) are left out
    and the rest dealt as before, whatever the world size that consumed them.
    With `with_epoch` it yields
    `(index, epoch)` pairs for `EpochItems`.
    """

    def __init__(self, n: int, rank: int, world_size: int, shuffle: bool, seed: int = 0,
                 with_epoch: bool = False) -> None:
        self.n, self.rank, self.world_size = n, rank, world_size
        self.shuffle, self.seed, self.epoch, self.skip = shuffle, seed, 0, 0
        self.with_epoch = with_epoch

    def set_epoch(self, epoch: int, skip: int = 0) -> None:
        self.epoch, self.skip = epoch, skip

    def _order(self) -> list[int]:
        if not self.shuffle:
            return list(range(self.n))
        # (seed, epoch) mixed, so seed s at epoch e+1 is not seed s+1 at epoch e
        g = torch.Generator().manual_seed(int(np.random.SeedSequence([self.seed, self.epoch])
                                              .generate_state(1)[0]))
        order = torch.randperm(self.n, generator=g)
        return order[: self.n - self.n % self.world_size].tolist()  # equal shares, no repeats

    def __iter__(self) -> Iterator[int] | Iterator[tuple[int, int]]:
        mine = self._order()[self.skip :][self.rank :: self.world_size]
        return ((i, self.epoch) for i in mine) if self.with_epoch else iter(mine)

    def __len__(self) -> int:
        if self.shuffle:
            return self.n // self.world_size
        return len(range(self.rank, self.n, self.world_size))


def fetch(reader: FileReader, path: str) -> EncodedImage:
    """Read a file and its image header; `BadImage` if it is missing, unreadable or unsafe."""
    try:
        return open_image(reader.read(path))
    except UnsafePath as e:
        raise BadImage(str(e)) from e
    except FileNotFoundError as e:
        raise BadImage("missing file") from e
    except OSError as e:  # local I/O errors; remote ones arrive as DataError
        raise BadImage(f"unreadable ({e.strerror or e})") from e


class ImageDataset(Dataset):
    """Reads `root/path` (through a `FileReader`), decodes, transforms; applies the bad-image policy.

    Items are `(uint8 HWC image, label, skipped, error)`:
    - `skipped`: under "skip", the bad files this item stands in for, newline-joined
      ("" if none), so the trainer can count distinct bad files, not hits;
    - `error`: a message for the trainer to raise: a bad file under "error", or a
      storage failure (credentials, network) under either policy.
    So a loader process never dies with a traceback, and every rank learns of a
    bad file the same way. The index stays packed (`Split`): reading a row
    touches no per-row Python object, so forked loader processes share its pages.
    """

    def __init__(
        self,
        fs: fsspec.AbstractFileSystem,
        root: str,
        split: Split,
        transform: Callable,
        on_bad_image: str = "error",
        out_size: int = 224,
        cache_dir: str | None = None,
    ) -> None:
        self.reader = FileReader(fs, root, cache_dir)
        self.transform = transform
        self.paths, self.labels = split.paths, split.labels
        self.on_bad_image, self.out_size = on_bad_image, out_size

    def __len__(self) -> int:
        return len(self.paths)

    def load(self, index: int) -> torch.Tensor:
        return self.transform(fetch(self.reader, self.paths[index]))

    def __getitem__(self, index: int):
        skipped: list[str] = []
        for attempt in range(SKIP_ATTEMPTS):
            candidate = (index + attempt * 7919) % len(self.paths)  # a prime stride
            where = f"{self.reader.root}/{self.paths[candidate]}"
            try:
                return self.load(candidate), int(self.labels[candidate]), "\n".join(skipped), ""
            except BadImage as e:
                if self.on_bad_image == "error":
                    return self.failed(index, f"bad image {where}: {e} "
                                              '(set data.on_bad_image = "skip" to skip it)')
                skipped.append(where)
            except DataError as e:
                return self.failed(index, str(e))
        return self.failed(index, f"{SKIP_ATTEMPTS} bad images in a row, the last {where}; "
                                  "run `ddp datasets check` on the data set")

    def failed(self, index: int, message: str):
        blank = torch.zeros(self.out_size, self.out_size, 3, dtype=torch.uint8)
        return blank, int(self.labels[index]), "", message


class EpochItems(Dataset):
    """Training items that depend on the epoch, whichever process loads them.

    Persistent loader processes hold their own copy of the dataset and never
    see an attribute changed between epochs, so the epoch travels with each
    index (`ShardSampler(with_epoch=True)`). From it come the crop side under
    progressive resizing, and the augmentation's random numbers: seeded by
    (seed, epoch, index), so a sample is augmented the same way whatever the
    number of loader processes, and a resumed run sees exactly what an
    uninterrupted one would have.
    """

    def __init__(self, dataset: ImageDataset, seed: int,
                 size_at: Callable[[int], int] | None = None) -> None:
        self.dataset, self.seed, self.size_at = dataset, seed, size_at

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, item: tuple[int, int]):
        index, epoch = item
        if self.size_at:
            self.dataset.transform.size = self.dataset.out_size = self.size_at(epoch)
        with torch.random.fork_rng(devices=[]):  # the loading process's own RNG stays untouched
            torch.manual_seed(int(np.random.SeedSequence([self.seed, epoch, index]).generate_state(1)[0]))
            return self.dataset[index]


def start_loader_process(worker_id: int) -> None:
    """First thing in each loader process.

    It leaves SIGINT/SIGTERM (sent to the whole process group) to its trainer, which keeps using it
    for the step it finishes before checkpointing; it ends with the trainer. And it freezes the
    objects inherited from the rank out of the cyclic GC: a collection writes to every object it
    visits, which copies the page out of the rank (~90 MB per loader process within an epoch).
    """
    gc.freeze()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def skipped_files(field: list[str]) -> list[str]:
    """The bad files a batch's `skipped` field names."""
    return [path for joined in field if joined for path in joined.split("\n")]


def requested(field: list[str]) -> torch.Tensor:
    """Which items of a batch are the samples asked for (not stand-ins for bad files)."""
    return torch.tensor([not joined for joined in field], dtype=torch.bool)


@dataclass
class Loaders:
    train: DataLoader | None
    val: DataLoader
    train_sampler: ShardSampler | None


def make_loader(
    dataset: Dataset,
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
        worker_init_fn=start_loader_process,
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

    def loader(split: str, transform: Callable, shuffle: bool,
               size_at: Callable[[int], int] | None = None) -> tuple[DataLoader, ShardSampler]:
        table = index.splits[split]
        dataset = ImageDataset(fs, root, table, transform, cfg.on_bad_image, transform.size, cfg.cache_dir)
        sampler = ShardSampler(len(dataset), rank, world_size, shuffle=shuffle, seed=seed,
                               with_epoch=shuffle)
        items = EpochItems(dataset, seed, size_at) if shuffle else dataset
        return make_loader(items, sampler, cfg.batch_size, cfg.workers, cfg.prefetch_factor, pin_memory,
                           drop_last=shuffle, seed=seed + 1000 * (rank + 1)), sampler

    val, _ = loader("val", ValTransform(cfg.val_image_size or cfg.image_size, cfg.val_resize), shuffle=False)
    if not train:
        return Loaders(None, val, None)
    transform = TrainTransform(cfg.image_size, cfg.min_crop_scale, cfg.hflip)
    progressive = cfg.train_size if cfg.min_image_size else None
    train_loader, sampler = loader("train", transform, shuffle=True, size_at=progressive)
    return Loaders(train_loader, val, sampler)
