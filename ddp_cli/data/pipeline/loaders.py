"""Feeding N replicas: the image dataset, its per-epoch items, DataLoader construction.

Which images each rank takes, and in which order, is the sampler's (sampler.py):
k ranks with batch b together see what one process with batch k*b sees, and
validation counts every image exactly once whatever the world size.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import signal
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import fsspec
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler, default_collate, get_worker_info

from ddp_cli.config import AugmentConfig, DataConfig
from ddp_cli.data.fetch.parquet_reader import ParquetReader, row_file
from ddp_cli.data.fetch.retry import IoPolicy, count_retries
from ddp_cli.data.fetch.row_groups import NodeGroups, group_folder
from ddp_cli.data.fetch.shard_reader import ShardReader
from ddp_cli.data.fetch.storage import FileReader, UnsafePath
from ddp_cli.data.pipeline.augment import train_transform
from ddp_cli.data.pipeline.device_decode import DeferredBatch, collate_images
from ddp_cli.data.pipeline.images import BadImage, EncodedImage, bad_image_message, open_image
from ddp_cli.data.pipeline.sampler import ShardSampler, shard_sequence
from ddp_cli.data.pipeline.seeds import CALIBRATION, derived_seed
from ddp_cli.data.pipeline.transforms import Deferred, ValTransform
from ddp_cli.data.sources.packed import PARQUET, Split
from ddp_cli.data.sources.table import IndexTable
from ddp_cli.errors import DataError

SKIP_ATTEMPTS = 16
PR_SET_PDEATHSIG = 1  # prctl(2)
LEAD = 4  # remote shards downloaded ahead at least: a window of 1-3 shards is read too soon after its start


Reader = FileReader | ShardReader | ParquetReader


def fetch(reader: Reader, path: str, member: np.ndarray | None = None) -> EncodedImage:
    """Read a file (or, `member` = (offset, size), an image in a shard; (row group, row), one in a Parquet
    file) and its image header; `BadImage` if it is missing, unreadable or unsafe."""
    try:
        return open_image(reader.read(path) if member is None else reader.read(path, member))
    except UnsafePath as e:
        raise BadImage(str(e)) from e
    except FileNotFoundError as e:
        raise BadImage("missing file") from e
    except OSError as e:  # local I/O errors; remote ones arrive as DataError
        raise BadImage(f"unreadable ({e.strerror or e})") from e


def open_reader(fs: fsspec.AbstractFileSystem, root: str, split: Split, cache_dir: str | None = None,
                shard_cache: int = 32, policy: IoPolicy = IoPolicy(), window: int = 8,
                shared: bool = False) -> Reader:
    """The reader of `split`'s rows: files under the root, images inside packed shards, or rows of Parquet
    files (which keeps the `window` row groups being read and two more: the one a batch straddles into;
    `shared`: row groups decoded once per node for all its readers, `shard_cache` of them kept)."""
    if split.container == PARQUET and split.sharded:
        node = NodeGroups(group_folder(fs, root), shard_cache) if shared else None
        return ParquetReader(fs, root, window + 2, policy, node)
    if split.sharded:
        return ShardReader(fs, root, cache_dir, shard_cache, policy)
    return FileReader(fs, root, cache_dir, policy)


def read_row(reader: Reader, split: Split, row: int) -> EncodedImage:
    """`fetch` of the split's row `row`, wherever its bytes lie."""
    return fetch(reader, split.paths[row], None if split.members is None else split.members[row])


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
        shard_cache: int = 32,
        policy: IoPolicy = IoPolicy(),
        window: int = 8,
    ) -> None:
        self.reader = open_reader(fs, root, split, cache_dir, shard_cache, policy, window, shared=True)
        self.window = window  # shards read at a time (data.shuffle_shards), for `read_ahead`
        self.transform = transform
        self.split, self.paths, self.labels = split, split.paths, split.labels
        self.on_bad_image, self.out_size = on_bad_image, out_size

    def __len__(self) -> int:
        return len(self.paths)

    def load(self, index: int) -> torch.Tensor:
        return self.transform(read_row(self.reader, self.split, index))

    def __getitem__(self, index: int):
        skipped: list[str] = []
        for attempt in range(SKIP_ATTEMPTS):
            candidate = (index + attempt * 7919) % len(self.paths)  # a prime stride
            where = f"{self.reader.root}/{self.paths[candidate]}"
            try:
                image = self.load(candidate)
                if isinstance(image, Deferred):  # decoded by the rank: should its decoder refuse it
                    image = image.located(where, self.on_bad_image)
                return image, int(self.labels[candidate]), "\n".join(skipped), ""
            except BadImage as e:
                if self.on_bad_image == "report":  # predict: the reason is the answer for this input
                    return self.failed(index, str(e))
                if self.on_bad_image == "error":
                    return self.failed(index, bad_image_message(where, str(e)))
                skipped.append(where)
            except DataError as e:
                return self.failed(index, str(e))
        return self.failed(index, f"{SKIP_ATTEMPTS} bad images in a row, the last {where}; "
                                  "run `ddp datasets check` on the data set")

    def __getitems__(self, indices: list[int]) -> list:
        """A batch (the DataLoader asks for whole batches when this exists): the files read together
        first (`FileReader.prefetch`), then each item exactly as `__getitem__` makes it."""
        self.read_ahead(indices)
        return [self[i] for i in indices]

    def read_ahead(self, indices: list[int], seed: int = 0, epoch: int | None = None) -> None:
        """Before a batch: its files requested together; for remote shards and Parquet row groups, the
        ones read after this batch's fetched in the background: the next `window` (at least LEAD) of the
        (seed, epoch) shard order in training, on into the next epoch's, or of the file order in
        validation (`epoch` None). The cache (`shard_cache`) holds this window and that many more."""
        self.reader.prefetch([self.paths[i] for i in indices])
        if isinstance(self.reader, FileReader):  # files are read together
            return
        starts, count = self.split.starts, len(self.split.starts) - 1
        shards = set((np.searchsorted(starts, indices, side="right") - 1).tolist())
        ahead = max(self.window, LEAD)
        if epoch is None:
            after = range(max(shards) + 1, min(max(shards) + 1 + ahead, count))
        else:
            sequence = epoch_shards(count, seed, epoch) + epoch_shards(count, seed, epoch + 1)
            following = (max(sequence.index(j) for j in shards) // self.window + 1) * self.window
            after = sequence[following:following + ahead]
        firsts = [int(starts[j]) for j in after if starts[j] < starts[j + 1]]
        if isinstance(self.reader, ParquetReader):  # a row group: its file, and its number in the file
            self.reader.read_ahead([(row_file(self.paths[i]), int(self.split.members[i][0])) for i in firsts])
        else:
            self.reader.download_ahead([self.paths[i].split("/", 1)[0] for i in firsts])

    def failed(self, index: int, message: str):
        blank = torch.zeros(self.out_size, self.out_size, 3, dtype=torch.uint8)
        return blank, int(self.labels[index]), "", message


class ViewsDataset(ImageDataset):
    """Items whose image is two views (2 x H x W x C: FixMatch's, SimCLR's), a bad one's stand-in too."""

    def failed(self, index: int, message: str):
        blank = torch.zeros(2, self.out_size, self.out_size, 3, dtype=torch.uint8)
        return blank, int(self.labels[index]), "", message


def epoch_shards(count: int, seed: int, epoch: int) -> list[int]:
    """The order in which the training sampler reads the shards in `epoch` (`sampler.shard_order`)."""
    return shard_sequence(count, torch.Generator().manual_seed(derived_seed(seed, epoch)))


class EpochItems(Dataset):
    """Training items that depend on the epoch, whichever process loads them.

    Persistent loader processes hold their own copy of the dataset and never
    see an attribute changed between epochs, so the epoch travels with each
    index, and so does the copy under repeated augmentation: the sampler
    (`with_epoch=True`) yields (index, epoch, copy). From them come the crop side
    under progressive resizing, and the augmentation's random numbers: seeded by
    (seed, epoch, index), plus the copy past the first so that no two copies are
    augmented alike. So a sample is augmented the same way whatever the number
    of loader processes, and a resumed run sees exactly what an uninterrupted
    one would have.
    """

    def __init__(self, dataset: ImageDataset, seed: int,
                 size_at: Callable[[int], int] | None = None) -> None:
        self.dataset, self.seed, self.size_at = dataset, seed, size_at

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitems__(self, items: list[tuple[int, int, int]]) -> list:
        """A batch: its files read together, then each item as `__getitem__` makes it (same seeds)."""
        self.dataset.read_ahead([index for index, _, _ in items], self.seed, items[0][1])
        return [self[item] for item in items]

    def __getitem__(self, item: tuple[int, int, int]):
        index, epoch, copy = item
        if self.size_at:
            self.dataset.transform.size = self.dataset.out_size = self.size_at(epoch)
        with torch.random.fork_rng(devices=[]):  # the loading process's own RNG stays untouched
            keys = (epoch, index, copy) if copy else (epoch, index)  # copy 0: seeded as without repeats
            torch.default_generator.manual_seed(derived_seed(self.seed, *keys))  # torch.manual_seed: +0.25 ms
            return self.dataset[index]


def start_loader_process(worker_id: int) -> None:
    """First thing in each loader process.

    It leaves SIGINT/SIGTERM (sent to the whole process group) to its trainer, which keeps using it
    for the step it finishes before checkpointing; it ends with the trainer, at once (Linux: killed
    when its rank is gone; torch's own check comes only every 5 s, and the launcher learns that a
    rank ended only when its loader processes have too: a failing run took 10 s more to stop). And
    it freezes the objects inherited from the rank out of the cyclic GC: a collection writes to
    every object it visits, which copies the page out of the rank (~90 MB per loader process
    within an epoch).
    """
    gc.freeze()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    with contextlib.suppress(OSError, AttributeError):  # not Linux: torch's check ends it within 5 s
        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # the rank forks from its main thread


class Batch(NamedTuple):
    """What every loader yields: the items of `ImageDataset`, collated (a field per item part)."""

    images: torch.Tensor | DeferredBatch  # uint8, N x H x W x C (`to_model_input` makes the model's input)
    labels: torch.Tensor  # int64
    skipped: Sequence[str]  # per item: the bad files it stands in for, newline-joined ("" if none)
    errors: Sequence[str]  # per item: a message to raise ("" if none)


def collate(items: list[tuple]) -> Batch:
    """The DataLoader's collate_fn: the default one, read by name; images the rank decodes (data.decode =
    "gpu") packed with the rest as one `DeferredBatch`. In a loader process the batch's tensors are placed
    in shared memory here, where a full /dev/shm raises in the loader and reaches the rank; left to the
    queue's feeder thread (the labels were), the failure was only printed there, the batch lost, and the
    rank waited for it until killed."""
    if any(isinstance(item[0], Deferred) for item in items):
        images = collate_images([item[0] for item in items])
        batch = Batch(images, *default_collate([item[1:] for item in items]))
    else:
        batch = Batch(*default_collate(items))
    if get_worker_info() is not None:
        images = batch.images
        for tensor in (images.pixels, images.data) if isinstance(images, DeferredBatch) else (images,):
            tensor.share_memory_()
        batch.labels.share_memory_()
    return batch


def skipped_files(field: Sequence[str]) -> list[str]:
    """The bad files a batch's `skipped` field names."""
    return [path for joined in field if joined for path in joined.split("\n")]


def requested(field: Sequence[str]) -> torch.Tensor:
    """Which items of a batch are the samples asked for (not stand-ins for bad files)."""
    return torch.tensor([not joined for joined in field], dtype=torch.bool)


@dataclass
class Loaders:
    train: DataLoader | None
    val: DataLoader
    train_sampler: ShardSampler | None
    unlabelled: DataLoader | None = None  # semi.method = "fixmatch": the unlabelled views' loader (semi.py)
    unlabelled_stream: Sampler | None = None  # its sampler: an endless `semi.UnlabelledStream`
    calibration: DataLoader | None = None  # train.ema_bn_epochs: the EMA's BatchNorm sample


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
    """A DataLoader with persistent prefetching workers and a seeded augmentation RNG; the rank's retry
    counter is made first, so the loader processes fork with it."""
    count_retries()
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
        collate_fn=collate,
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
    augment: AugmentConfig = AugmentConfig(),
    calibration: int = 0,
    views: Callable | None = None,
) -> Loaders:
    """This rank's train and val loaders (`train=False` for validation-only jobs), and with `calibration`
    images its share of the EMA's BatchNorm sample; with `views` (pretrain.method: `contrastive_views`),
    each train image is its two views instead of one crop."""
    val = eval_loader(cfg, fs, root, index.splits["val"], rank, world_size, seed, pin_memory,
                      interpolation=augment.interpolation, defer=cfg.decode == "gpu")
    if not train:
        return Loaders(None, val, None)
    transform = views or train_transform(cfg, augment, defer=cfg.decode == "gpu")
    split = index.splits["train"]
    dataset = (ViewsDataset if views else ImageDataset)(
        fs, root, split, transform, cfg.on_bad_image, transform.size, cfg.cache_dir, shard_cache(cfg),
        IoPolicy.of(cfg), cfg.shuffle_shards)
    sampler = ShardSampler(len(dataset), rank, world_size, shuffle=True, seed=seed, batch_size=cfg.batch_size,
                           repeats=augment.repeated_aug, with_epoch=True, shards=split.starts,
                           window=cfg.shuffle_shards)
    items = EpochItems(dataset, seed, cfg.train_size if cfg.min_image_size else None)
    train_loader = make_loader(items, sampler, cfg.batch_size, cfg.workers, cfg.prefetch_factor, pin_memory,
                               drop_last=True, seed=seed + 1000 * (rank + 1))
    sample = calibration_loader(cfg, fs, root, split, rank, world_size, seed, pin_memory, calibration,
                                augment.interpolation) if calibration else None
    return Loaders(train_loader, val, sampler, calibration=sample)


def shard_cache(cfg: DataConfig) -> int:
    """Remote shards a node keeps: the window being read and the ones downloaded ahead (the next
    window, at least LEAD shards: `ImageDataset.read_ahead`), with room for stragglers."""
    return 2 * cfg.shuffle_shards + LEAD


def eval_loader(cfg: DataConfig, fs: fsspec.AbstractFileSystem, root: str, split: Split, rank: int,
                world_size: int, seed: int, pin_memory: bool, on_bad_image: str | None = None,
                interpolation: str = "bilinear", defer: bool = False) -> DataLoader:
    """Validation's pipeline over `split` in order, this rank's every k-th item: nothing padded or
    dropped. `on_bad_image` "report" (predict) hands a bad file's reason over as the item's error;
    `interpolation` is the val resize's unless `data.val_interpolation` is set; `defer`: the JPEGs
    decoded and rendered on the rank's device (data.decode = "gpu", `device_decode`)."""
    dataset = val_dataset(cfg, fs, root, split, on_bad_image or cfg.on_bad_image, interpolation, defer)
    sampler = ShardSampler(len(dataset), rank, world_size, shuffle=False)
    return make_loader(dataset, sampler, cfg.batch_size, cfg.workers, cfg.prefetch_factor, pin_memory,
                       drop_last=False, seed=seed + 1000 * (rank + 1))


def calibration_loader(cfg: DataConfig, fs: fsspec.AbstractFileSystem, root: str, split: Split, rank: int,
                       world_size: int, seed: int, pin_memory: bool, images: int,
                       interpolation: str = "bilinear") -> DataLoader:
    """This rank's equal share of a fixed, seeded sample of `images` train rows, at the val crop: what the
    EMA's BatchNorm statistics are recomputed from (`EmaModel.recalibrate`). Equal shares, so that every
    rank runs the same batches (SyncBatchNorm gathers in each). A sharded split's sample comes from its
    first `shuffle_shards` shards: a remote one is read a window at a time, not a shard per image. Read
    in the rank's own process, once (the trainer keeps the batches)."""
    dataset = val_dataset(cfg, fs, root, split, cfg.on_bad_image, interpolation)
    rows = len(split) if split.starts is None else int(split.starts[min(cfg.shuffle_shards,
                                                                        len(split.starts) - 1)])
    taken = min(images, rows) // world_size * world_size
    draw = torch.Generator().manual_seed(derived_seed(seed, stream=CALIBRATION))
    order = torch.randperm(rows, generator=draw)
    return DataLoader(dataset, batch_size=cfg.batch_size, sampler=order[:taken][rank::world_size].tolist(),
                      pin_memory=pin_memory, collate_fn=collate)


def val_dataset(cfg: DataConfig, fs: fsspec.AbstractFileSystem, root: str, split: Split, on_bad_image: str,
                interpolation: str, defer: bool = False) -> ImageDataset:
    """`split` as validation sees it: resized, centre-cropped to the val crop (on the rank's device with
    `defer`)."""
    transform = ValTransform(cfg.val_image_size or cfg.image_size, cfg.val_resize,
                             cfg.val_interpolation or interpolation, defer)
    return ImageDataset(fs, root, split, transform, on_bad_image, transform.size, cfg.cache_dir,
                        shard_cache(cfg), IoPolicy.of(cfg), cfg.shuffle_shards)
