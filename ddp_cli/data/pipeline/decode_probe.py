"""data.decode "auto": both decode paths timed on the run's own train items, on the device that trains.

Each path's train loader (the same sampler, seeds and items; "cpu": rendered in the loader processes,
"gpu": handed over compressed and rendered by the rank, `device_decode`) yields its first batches and
each batch is made the model's input on the device (`model_input`), as the training step takes it.
The first batch of each path is not timed (the loader processes start, the device warms up); the next
`probe_batches` are, and the device is synchronised once at the end, so a path's time is what its
batches cost until the device holds them. Per-rank times are then agreed on (`run.decode_choice`):
the world goes at its slowest rank's pace.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch.utils.data import DataLoader

from ddp_cli.data.pipeline.transforms import Norm, model_input

PROBE_BATCHES = 4  # timed per path, after one untimed, beyond the batches the loaders hold queued


@dataclass(frozen=True)
class PathTiming:
    """One path on one rank: the images it delivered to the device and the seconds they took."""

    images: int
    seconds: float


def probe_batches(loader: DataLoader, workers: int, prefetch_factor: int) -> int:
    """Batches to time: PROBE_BATCHES beyond those the loader processes hold ready at the start (they
    were made while the first batch was, and would flatter the path), within the loader's epoch."""
    queued = workers * prefetch_factor if workers else 0
    return max(1, min(PROBE_BATCHES + queued, len(loader) - 1))


def time_path(loader: DataLoader, batches: int, device: torch.device, channels_last: bool,
              norm: Norm) -> PathTiming:
    """`batches` of `loader` after its first, each made the model's input on `device`; the loader's
    processes are ended after (persistent ones would live on with the loader)."""
    it = iter(loader)
    try:
        on_device(next(it).images, device, channels_last, norm)
        _synchronise(device)
        start, images = time.perf_counter(), 0
        for _ in range(batches):
            batch = next(it, None)
            if batch is None:
                break
            on_device(batch.images, device, channels_last, norm)
            images += len(batch.labels)
        _synchronise(device)
        return PathTiming(images, time.perf_counter() - start)
    finally:
        getattr(it, "_shutdown_workers", lambda: None)()  # the loader processes, now: not at its GC


def on_device(images: torch.Tensor, device: torch.device, channels_last: bool, norm: Norm) -> torch.Tensor:
    """A batch made the model's input on `device`; one of views (N x V x H x W x C: SimCLR's) as N x V
    images."""
    images = images.to(device, non_blocking=True)
    return model_input(images.flatten(0, 1) if images.dim() == 5 else images, channels_last, norm)


def _synchronise(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
