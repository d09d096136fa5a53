"""`ddp bench data`: images/s of the training input pipeline against a plain torchvision loader.

Both pipelines read the same files through the same reader, with the same
DataLoader workers, batch size and crop size, and end with a normalised float
batch in the consuming process:

- ddp: header, crop chosen, DCT-scaled decode of only the pixels needed,
  uint8 crop+resize, uint8 collate, normalisation in the consumer (as the
  trainer does on the device);
- baseline: the torchvision ImageNet recipe: PIL open + convert("RGB"),
  RandomResizedCrop, RandomHorizontalFlip, ToTensor, Normalize, float collate.

With `full_decode`, ddp's pipeline is timed a third way, every image decoded
whole (its DCT scaling off): what decoding at the size needed gains, which is
most at small crops (`ratios_reduced_vs_full`).

With a policy (`policies`), both run it after the flip with the same bilinear
interpolation: ddp v2's op on its uint8 crop (`augment.py`), the baseline the
plain `torchvision.transforms` op on its PIL image, where torchvision's
reference recipe puts it.

The machine may be busy with other work, so the pipelines are measured in
alternating rounds (each with fresh workers and a warm-up) and each rate is the
total images over the total timed seconds of its rounds.
"""

from __future__ import annotations

import io
import os
import platform
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import fsspec
import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset, Sampler
from torchvision import transforms as T

from ddp_cli.config import AugmentConfig, DataConfig
from ddp_cli.data.fetch.storage import FileReader
from ddp_cli.data.pipeline.augment import policy, train_transform
from ddp_cli.data.pipeline.loaders import ImageDataset
from ddp_cli.data.pipeline.transforms import MEAN, STD, to_model_input
from ddp_cli.data.registry import load_registry
from ddp_cli.data.sources.layouts import build_index
from ddp_cli.data.sources.packed import Split
from ddp_cli.errors import ConfigError

POLICIES = ("none", "trivialaugment", "randaugment", "autoaugment")
FULL = "ddp_full_decode"  # ddp's pipeline with its DCT scaling off


class EndlessSampler(Sampler[int]):
    """Random indices forever (same seed, same files for both pipelines): no epoch restarts."""

    def __init__(self, n: int, seed: int = 0) -> None:
        self.n, self.seed = n, seed

    def __iter__(self) -> Iterator[int]:
        g = torch.Generator().manual_seed(self.seed)
        while True:
            yield from torch.randperm(self.n, generator=g).tolist()


class TorchvisionStyle(Dataset):
    """torchvision's ImageFolder loader and ImageNet-example transforms, over our file list; `augment`'s
    policy after the flip, as torchvision's reference recipe places it (v1, its default)."""

    def __init__(self, reader: FileReader, paths: Sequence[str], size: int, augment: AugmentConfig) -> None:
        self.reader, self.paths = reader, paths
        self.transform = T.Compose([T.RandomResizedCrop(size), T.RandomHorizontalFlip(),
                                    *(op for _, op in policy(augment, T)),
                                    T.ToTensor(), T.Normalize(MEAN, STD)])
        self.size = size

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int) -> torch.Tensor:
        try:
            img = Image.open(io.BytesIO(self.reader.read(self.paths[index]))).convert("RGB")
        except (OSError, ValueError):  # a bad file: a blank costs the baseline nothing
            return torch.zeros(3, self.size, self.size)
        return self.transform(img)


def bench_data(name: str, registry: str | None, split: str = "train", workers: int = 2,
               seconds: float = 20.0, batch_size: int = 32, image_size: int = 224,
               policies: Sequence[str] = ("none",), rounds: int = 3, full_decode: bool = False) -> dict:
    """Measure both pipelines (and ddp's with full-size decoding, `full_decode`) with each policy on data
    set `name`, alternating in `rounds`; return the shared bench dict."""
    entry = load_registry(registry).get(name)
    fs, root = entry.open()
    table = build_index(fs, root, entry.layout, splits=(split,), options=entry.layout_options).splits[split]
    if len(table) < batch_size:
        raise ConfigError(f"bench data: the {split} split of {name!r} has {len(table)} images, fewer "
                          f"than --batch-size {batch_size}")
    pipelines = {key: pipeline for p in policies
                 for key, pipeline in both_pipelines(fs, root, table, image_size, p, full_decode).items()}
    totals = {key: [0, 0.0] for key in pipelines}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the consumer, like each loader process, on one core
    try:
        for _ in range(rounds):
            for key, (dataset, consume) in pipelines.items():
                images, elapsed = _measure(dataset, consume, workers, batch_size,
                                           seconds / rounds / len(pipelines))
                totals[key][0] += images
                totals[key][1] += elapsed
    finally:
        torch.set_num_threads(threads)
    rates = {key: images / elapsed for key, (images, elapsed) in totals.items()}
    ratios = {p: rates[p, "ddp"] / rates[p, "baseline"] for p in policies}
    return {
        "bench": "data",
        "dataset": name,
        "split": split,
        "files": len(table),
        **set_up(workers, batch_size, image_size, seconds, rounds),
        "rows": [{"policy": p, "pipeline": pipeline, "images": totals[p, pipeline][0],
                  "seconds": totals[p, pipeline][1], "images_per_second": rate,
                  "vs_none": rate / rates["none", pipeline] if "none" in policies else None}
                 for (p, pipeline), rate in rates.items()],
        "ratios": ratios,  # ddp over the baseline, per policy
        "ratio": ratios[policies[0]],
        **({"ratios_reduced_vs_full": {p: rates[p, "ddp"] / rates[p, FULL] for p in policies}}
           if full_decode else {}),
    }


def set_up(workers: int, batch_size: int, image_size: int, seconds: float, rounds: int) -> dict:
    """The keys every data bench reports its set-up with, the machine's included."""
    return {"workers": workers, "batch_size": batch_size, "image_size": image_size, "seconds": seconds,
            "rounds": rounds, "machine": machine()}


def both_pipelines(fs: fsspec.AbstractFileSystem, root: str, table: Split, image_size: int, policy_name: str,
                   full_decode: bool = False) -> dict[tuple[str, str], tuple[Dataset, Callable]]:
    """ddp's and the baseline's pipeline with `policy_name` (and ddp's decoding whole images, `full_decode`),
    each with how its consumer takes a batch."""
    augment, data = AugmentConfig(policy=policy_name), DataConfig(image_size=image_size)
    variants = {"ddp": True, **({FULL: False} if full_decode else {})}
    return {
        **{(policy_name, pipeline): (ImageDataset(fs, root, table, train_transform(
            data, augment, dct_scaling=scaling), "skip", image_size), normalised)
           for pipeline, scaling in variants.items()},
        (policy_name, "baseline"): (TorchvisionStyle(FileReader(fs, root), table.paths, image_size, augment),
                                    lambda batch: batch),
    }


def normalised(batch: tuple) -> torch.Tensor:
    """How the trainer takes ddp's batch: uint8 to a normalised float batch (here on the CPU)."""
    return to_model_input(batch[0], torch.device("cpu"), channels_last=False)


def machine() -> str:
    """CPU model and count, for the record (BENCHMARKS.md)."""
    try:
        model = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                     if line.startswith("model name"))
    except (OSError, StopIteration):
        model = platform.processor() or platform.machine()
    return f"{model}, {os.cpu_count()} cpus"


def _measure(dataset: Dataset, consume: Callable, workers: int, batch_size: int,
             seconds: float) -> tuple[int, float]:
    """Images consumed and seconds taken, after a warm-up, by fresh loader processes."""
    prefetch = DataConfig().prefetch_factor
    loader = DataLoader(dataset, batch_size=batch_size, sampler=EndlessSampler(len(dataset)),
                        num_workers=workers, prefetch_factor=prefetch if workers else None)
    batches = iter(loader)
    for _ in range(max(2, workers * prefetch)):  # start-up, and the batches queued meanwhile
        consume(next(batches))
    images, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        images += len(consume(next(batches)))
    elapsed = time.perf_counter() - started
    del batches  # stops the loader processes
    return images, elapsed
