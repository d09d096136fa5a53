"""data.decode "auto" made concrete on the workers, before the training loaders are built.

The launcher leaves it "auto" only where both paths can run (`config.resolve`); a run that resumes
has taken the path its checkpoint trained with by then (`run.as_trained`, `config.resolve.resume`: its
pixels are that path's, so the resume is bitwise); otherwise every rank times both paths on its own
train items
(`data.pipeline.decode_probe`), the ranks agree (each path's time is its slowest rank's, all-reduced:
every rank takes the same path) and the faster is kept (`config.resolve.decode_measured`). The rank
that writes the run dir on each node rewrites its config.toml with the choice (an elastic restart
reads it back and measures nothing), and rank 0 logs the figures and what measuring cost.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.distributed as dist

from ddp_cli.config import RunConfig
from ddp_cli.config.resolve import decode_measured, decode_pending
from ddp_cli.data.pipeline.decode_probe import PathTiming, probe_batches, time_path
from ddp_cli.data.pipeline.loaders import build_loaders
from ddp_cli.data.pipeline.semi import run_splits
from ddp_cli.data.pipeline.transforms import normalising
from ddp_cli.data.pipeline.views import contrastive_views
from ddp_cli.data.registry import DatasetEntry
from ddp_cli.data.sources.table import IndexTable
from ddp_cli.distributed.setup import DistContext
from ddp_cli.io import write_text

log = logging.getLogger("ddp")
PATHS = ("cpu", "gpu")


@dataclass(frozen=True)
class DecodeProbe:
    """Both paths' rates (images/s of the slowest rank), the path kept and what measuring cost."""

    rates: dict[str, float]
    seconds: float

    @property
    def choice(self) -> str:
        """The faster path; a tie is "cpu" (it leaves the device to the training)."""
        return "gpu" if self.rates["gpu"] > self.rates["cpu"] else "cpu"

    def line(self) -> str:
        cpu, gpu = self.rates["cpu"], self.rates["gpu"]
        return (f'data.decode "auto": "{self.choice}" (measured: cpu {cpu:,.0f} img/s, gpu {gpu:,.0f} img/s '
                f"per rank; {self.seconds:.1f} s spent measuring)")


def decode_path(cfg: RunConfig, ctx: DistContext, folder: Path, entry: DatasetEntry, index: IndexTable,
                writes: bool) -> RunConfig:
    """`cfg` with data.decode concrete: as given, as the checkpoint trained (`run.as_trained`), or as
    measured here."""
    if not decode_pending(cfg):
        return cfg
    probe = measure(cfg, ctx, entry, index)
    cfg = decode_measured(cfg, probe.choice)
    if ctx.is_main:
        log.info(probe.line())
    if writes:
        write_text(folder / "config.toml", cfg.to_toml())
    return cfg


def measure(cfg: RunConfig, ctx: DistContext, entry: DatasetEntry, index: IndexTable) -> DecodeProbe:
    """Both paths timed on this rank's train items (the labelled ones, as the run's loader takes them;
    SimCLR's two views under pretrain.method), each path's time the slowest rank's."""
    start = time.perf_counter()
    fs, root = entry.open()
    labelled, _ = run_splits(index, cfg)
    index = replace(index, splits={**index.splits, "train": labelled})
    timings: list[PathTiming] = []
    for path in PATHS:
        data = decode_measured(cfg, path).data
        pretrain, gpu = cfg.pretrain, path == "gpu"
        views = contrastive_views(data, cfg.augment, pretrain, gpu) if pretrain.on() else None
        loader = build_loaders(data, fs, root, index, ctx.rank, ctx.world_size, cfg.seed,
                               pin_memory=ctx.device.type == "cuda", augment=cfg.augment, views=views).train
        batches = probe_batches(loader, data.workers, data.prefetch_factor)
        timings.append(time_path(loader, batches, ctx.device, cfg.model.channels_last, normalising(data)))
    seconds = torch.tensor([t.seconds for t in timings], dtype=torch.float64, device=ctx.device)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)  # once, before training: not in the step
    slowest = seconds.tolist()
    rates = {path: t.images / max(s, 1e-9) for path, t, s in zip(PATHS, timings, slowest, strict=True)}
    return DecodeProbe(rates, time.perf_counter() - start)
