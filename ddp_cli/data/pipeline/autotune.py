"""`data.workers = "auto"`: a rank's loader processes, from its cores and a measurement.

Per image a loader process spends D ms reading, decoding, cropping and augmenting
(measured here on a few of the data set's own images), and the model M
core-ms training on it. A rank has C cores (this process's CPU affinity over
the ranks of the node).

- On GPU the model runs on the device: the decoding is what the cores are for,
  and a GPU trains faster than all of them decode for any ImageNet model
  (1,000s of images/s against 100s per core), so every core but the one that
  drives the GPU gets a loader: C - 1 (at least 1).
- On CPU the model computes on the same C cores. Loading in-process stalls
  each step for D per image while C - 1 cores idle (D + M/C per image);
  loader processes overlap the two, (D + M)/C per image at best, and take
  their cores from the model's threads. So the loaders are decoding's share
  of the cores, ceil(C * D / (D + M)), at most C - 1, and none at all unless
  that gain, D (C - 1) / (C D + M), reaches 10%. M is the model's forward
  and backward FLOPs at the train crop (counted on the meta device:
  ddp_cli/flops.py), over one core's measured matmul rate.

Prefetch ("auto"): at least torch's 2 batches per loader process, and 4 batches
queued per rank in all, so one slow batch does not stall the step
(`config.resolve.prefetch_for`).
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace

import fsspec
import torch
from torch import nn

from ddp_cli.config import AugmentConfig, DataConfig
from ddp_cli.data.pipeline.augment import train_transform
from ddp_cli.data.pipeline.images import BadImage
from ddp_cli.data.pipeline.loaders import open_reader, read_row
from ddp_cli.data.pipeline.transforms import ValTransform
from ddp_cli.data.sources.packed import Split
from ddp_cli.flops import flops_per_image

MIN_GAIN = 0.10  # loader processes on CPU only when they would speed a step up this much
SAMPLES = 8  # images decoded to measure D (after one to warm up)


@dataclass(frozen=True)
class LoaderChoice:
    """What a rank's loaders run with, and why (the plan and `train --json` show it)."""

    workers: int
    prefetch_factor: int
    rule: str
    cores_per_rank: int | None = None
    decode_ms: float | None = None
    model_ms: float | None = None

    @classmethod
    def of(cls, data: DataConfig, measured: LoaderChoice | None) -> LoaderChoice:
        """What a resolved config's loaders run with: the measured rule's choice where data.workers was
        "auto" (`measured`), else the numbers as set."""
        if measured is None:
            return cls(data.workers, data.prefetch_factor, "data.workers as set")
        return replace(measured, workers=data.workers, prefetch_factor=data.prefetch_factor)

    def as_dict(self) -> dict[str, object]:
        """The inputs the rule used; none for numbers as set."""
        return {k: round(v, 3) if isinstance(v, float) else v for k, v in asdict(self).items()
                if v is not None}


def cores_per_rank(nproc: int) -> int:
    """This process's cores shared among the node's `nproc` ranks, at least one each."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, (cores or 1) // max(1, nproc))


def decode_ms(fs: fsspec.AbstractFileSystem, root: str, split: Split,
              transform: Callable, samples: int = SAMPLES) -> float:
    """Milliseconds one process takes to read, decode and crop one image, over images spread
    through `split` (bad ones cost their attempt, as they would in a loader)."""
    reader = open_reader(fs, root, split)
    step = max(1, len(split) // (samples + 1))
    picks = list(range(0, len(split), step))[: samples + 1]

    def load(row: int) -> None:
        with contextlib.suppress(BadImage):
            transform(read_row(reader, split, row))

    load(picks[0])  # the first pays for imports and caches
    started = time.perf_counter()
    for row in picks[1:]:
        load(row)
    return (time.perf_counter() - started) * 1000 / max(1, len(picks) - 1)


def model_ms(model: nn.Module, size: int, train: bool = True) -> float:
    """Core-milliseconds of the model's compute per image: FLOPs (of a meta-device `model`)
    over one core's matmul rate."""
    return flops_per_image(model, size, train) / core_flops_per_second() * 1000


def core_flops_per_second(n: int = 256, repeat: int = 4) -> float:
    """One core's float32 matmul rate: an upper bound for convolutions, so M errs low, loaders high."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a, b = torch.randn(n, n), torch.randn(n, n)
        a @ b
        started = time.perf_counter()
        for _ in range(repeat):
            a @ b
        return 2 * n**3 * repeat / (time.perf_counter() - started)
    finally:
        torch.set_num_threads(threads)


def choose_workers(cores: int, device: str, decode: float, model: float | None) -> tuple[int, str]:
    """The rule (module docstring): loader processes for a rank, and the rule as applied."""
    if device == "cuda":
        return max(1, cores - 1), f"GPU: cores per rank - 1 = {cores} - 1, at least 1"
    if cores == 1 or model is None:  # model: None only where it was not needed
        return 0, "CPU, one core per rank: loaders would only take it from the model"
    gain = decode * (cores - 1) / (cores * decode + model)
    if gain < MIN_GAIN:
        return 0, f"CPU: loader processes would gain {gain:.0%} < {MIN_GAIN:.0%}; in-process"
    share = min(cores - 1, math.ceil(cores * decode / (decode + model)))
    return share, (f"CPU: ceil(cores * decode / (decode + model)) = ceil({cores} * {decode:.3g} / "
                   f"{decode + model:.3g}), at most cores - 1; gain {gain:.0%}")


def measure_loaders(cfg: DataConfig, device: str, nproc: int, fs: fsspec.AbstractFileSystem, root: str,
                    split: Split, model: nn.Module, train: bool = True,
                    augment: AugmentConfig = AugmentConfig()) -> LoaderChoice:
    """The loader processes the rule gives a rank (what data.workers "auto" resolves to), from its cores
    and a decode of the split's own images; the prefetch is the resolved config's (`LoaderChoice.of`)."""
    cores = cores_per_rank(nproc)
    size = cfg.image_size if train else cfg.val_image_size or cfg.image_size
    transform = train_transform(cfg, augment, size) if train else \
        ValTransform(size, cfg.val_resize, cfg.val_interpolation or augment.interpolation)
    decode = decode_ms(fs, root, split, transform)
    cost = model_ms(model, size, train) if device == "cpu" and cores > 1 else None
    workers, rule = choose_workers(cores, device, decode, cost)
    return LoaderChoice(workers, 0, rule, cores_per_rank=cores, decode_ms=decode, model_ms=cost)
