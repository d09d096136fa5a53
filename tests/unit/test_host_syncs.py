"""No host syncs in the training step: the host runs ahead of the GPU, queueing kernels.

The real Trainer (one-rank gloo group, DDP, gradient accumulation, gradient clipping, MixUp and the
EMA on) trains an epoch and validates under `HostSyncs` (tests/syncs.py), which counts what would make
the host wait for a GPU: none in a step, one per logging window (its loss, checked finite), one at the
epoch's end (its mean loss), and a few per validation whatever its number of batches.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from replicas import CLASSES, make_config
from syncs import HostSyncs

from ddp_cli.data.pipeline.loaders import Batch, Loaders
from ddp_cli.data.pipeline.sampler import ShardSampler
from ddp_cli.distributed.setup import DistContext, seed_everything
from ddp_cli.models import build_model
from ddp_cli.train.inference import evaluate
from ddp_cli.train.trainer import Trainer
from tests.resolved import resolved

STEPS, EVERY, ACCUM, BATCH = 4, 2, 2, 2
CPU = torch.device("cpu")


class Batches(list):
    """A loader stand-in: its batches, and the order `logits_by_batch` reads split positions from."""

    @property
    def sampler(self) -> range:
        return range(sum(len(batch.labels) for batch in self))


def batches(count: int, skipped: bool = False) -> Batches:
    """`count` collated batches as a loader yields them (uint8 images, labels, host tensors); the first
    item of each a stand-in for a bad file if `skipped`."""
    g = torch.Generator().manual_seed(count)
    return Batches(Batch(torch.randint(0, 256, (BATCH, 16, 16, 3), dtype=torch.uint8, generator=g),
                         torch.randint(0, CLASSES, (BATCH,), generator=g),
                         ["bad.jpg" if skipped and i == 0 else "" for i in range(BATCH)], [""] * BATCH)
                   for _ in range(count))


@pytest.fixture
def syncs():
    """The counter, on a one-rank gloo group, with one thread (two threads on a busy pair of cores
    made the epoch ten times slower)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with HostSyncs(CPU) as counter:
            yield counter
    finally:
        dist.destroy_process_group()
        torch.set_num_threads(threads)


@pytest.fixture
def trainer(syncs) -> Trainer:
    """Built under the counter, so that it knows which of the trainer's tensors are host ones."""
    cfg = make_config({"data": {"batch_size": BATCH}, "logging": {"every_steps": EVERY},
                       "train": {"grad_accum": ACCUM, "ema_decay": 0.9},
                       "optim": {"grad_clip": 1.0}, "augment": {"mixup_alpha": 0.2}})
    seed_everything(cfg.seed)
    sampler = ShardSampler(STEPS * ACCUM * BATCH, 0, 1, shuffle=True, seed=0, batch_size=BATCH,
                           with_epoch=True)
    loaders = Loaders(batches(STEPS * ACCUM), batches(2), sampler)
    return Trainer(resolved(cfg, STEPS), DistContext(0, 1, 0, 1, CPU, "gloo"),
                   build_model(cfg.model, CLASSES),
                   loaders, STEPS)


def counting(syncs: HostSyncs, method, counts: list[int]):
    """`method`, appending to `counts` the syncs of each call."""
    def counted(*args, **kwargs):
        before = len(syncs)
        try:
            return method(*args, **kwargs)
        finally:
            counts.append(len(syncs) - before)
    return counted


def test_a_training_step_makes_no_host_sync_and_a_logging_window_one(syncs, trainer, monkeypatch):
    steps, windows = [], []
    monkeypatch.setattr(trainer, "train_step", counting(syncs, trainer.train_step, steps))
    monkeypatch.setattr(trainer, "check_finite", counting(syncs, trainer.check_finite, windows))
    before = len(syncs)
    trainer.train_epoch(0)
    assert steps == [0] * STEPS, syncs.report(before)
    assert windows == [1] * (STEPS // EVERY), syncs.report(before)
    assert len(syncs) - before == len(windows) + 1, syncs.report(before)  # + the epoch's mean loss


@pytest.mark.parametrize("keep_topk", [0, 3])  # 3: `validate --predictions` keeps each image's top 3
def test_a_validation_makes_the_same_few_host_syncs_whatever_its_batches(syncs, trainer, keep_topk):
    counts, start = [], len(syncs)
    for count in (1, 4):
        before = len(syncs)
        totals = evaluate(trainer.model.module, batches(count, skipped=True), CPU, "fp32", False,
                          keep_topk=keep_topk)
        counts.append(len(syncs) - before)
        assert totals.metrics["images"] == count * (BATCH - 1)  # the stand-ins not counted
        assert len(totals.kept) == (count * (BATCH - 1) if keep_topk else 0)
    # the class count and the totals; kept predictions: read in one piece, and gather_object's own 4
    assert counts[0] == counts[1] <= 2 + 5 * bool(keep_topk), syncs.report(start)


def test_the_counter_sees_each_kind_of_sync_on_device_tensors_only():
    with HostSyncs(CPU) as syncs:
        host = torch.arange(4.0)
        device = host.clone().to(CPU, non_blocking=True)  # on a CPU, `to` returns the tensor it moves
        reads = [lambda t: t[0].item(), lambda t: t.tolist(), lambda t: bool(t[0]), lambda t: float(t[0]),
                 lambda t: int(t[0]), lambda t: t.nonzero(), lambda t: t[t > 1], lambda t: t.clone().cpu()]
        for read in reads:
            read(host)
        assert len(syncs) == 0, syncs.report()
        for read in reads:
            read(device)
        assert len(syncs) == len(reads), syncs.report()
        device.add_(host).copy_(host, non_blocking=True)
        assert len(syncs) == len(reads), syncs.report()
        device.copy_(host)
        torch.tensor([1.0, 2.0], device=CPU)
        host.to(CPU)
        assert len(syncs) == len(reads) + 3, syncs.report(len(reads))
