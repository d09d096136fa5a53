"""The heart of ddp: k replicas with batch b behave as one process with batch k*b."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import run_distributed

from ddp_cli.config import config_from_dict
from ddp_cli.data.loaders import Loaders
from ddp_cli.distributed.setup import DistContext, seed_everything
from ddp_cli.distributed.worker import assert_identical_across_ranks
from ddp_cli.models import build_model
from ddp_cli.observe.console import RunConsole
from ddp_cli.train.trainer import Trainer

CLASSES = 3
STEPS = 4


def global_batch(step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    images = torch.randint(0, 256, (size, 16, 16, 3), dtype=torch.uint8, generator=g)
    return images, torch.randint(0, CLASSES, (size,), generator=g)


def train_replica(rank: int, world_size: int, batch: int, accum: int, optim: dict, folder: str):
    """Run STEPS optimisation steps on this rank's slice of each global batch."""
    cfg = config_from_dict({
        "data": {"batch_size": batch, "image_size": 16},
        "model": {"name": "resnet_tiny"},
        "optim": {"lr_per_256": 2.0, "weight_decay": 1e-3, **optim},
        "schedule": {"name": "cosine", "warmup_steps": 2},
        "train": {"grad_accum": accum, "epochs": 1},
    })
    ctx = DistContext(rank, world_size, rank, world_size, torch.device("cpu"), "gloo")
    seed_everything(cfg.seed)
    model = build_model(cfg.model, CLASSES)
    loaders = Loaders(train=[None] * STEPS * accum, val=[], train_sampler=None)
    trainer = Trainer(cfg, ctx, loaders, model, Path(folder), {}, RunConsole(False))
    trainer.model.eval()  # BatchNorm in eval: a sample's gradient does not depend on its batch-mates
    per_step = world_size * batch * accum
    for step in range(STEPS):
        images, labels = global_batch(step, per_step)
        # rank r holds positions r, r+k, ... of the global batch, as ShardSampler deals them
        mine = torch.arange(rank, per_step, world_size)
        micro = [(images[idx], labels[idx], torch.zeros(len(idx), dtype=torch.long), [""] * len(idx))
                 for idx in mine.chunk(accum)]
        trainer.train_step(micro)
    if world_size > 1:
        assert_identical_across_ranks(trainer.model.module, "after training")
    return {k: v.clone() for k, v in trainer.model.module.state_dict().items()}


def single_process(tmp_path, batch: int, accum: int, optim: dict):
    return run_distributed(train_replica, 1, tmp_path, batch, accum, optim, str(tmp_path))[0]


def assert_same_weights(a: dict, b: dict, atol: float = 1e-5) -> None:
    """Equal up to float reduction order: every element within atol, nearly all within 1e-5."""
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-4, atol=atol, msg=name)
        if a[name].is_floating_point():
            assert (a[name] - b[name]).abs().mean() < 1e-6, name


# Adam divides by sqrt(v): for the few elements whose gradient is ~0, the last
# bits of the all-reduce sum decide a sign, so a handful move by ~lr/100.
OPTIMS = [({"name": "sgd", "momentum": 0.9, "nesterov": True}, 1e-5), ({"name": "adamw"}, 1e-3)]


@pytest.mark.parametrize(("optim", "atol"), OPTIMS, ids=["sgd", "adamw"])
def test_two_replicas_equal_one_process_on_the_combined_batch(tmp_path, optim, atol):
    ranks = run_distributed(train_replica, 2, tmp_path, 4, 1, optim, str(tmp_path))
    reference = single_process(tmp_path / "single", 8, 1, optim)
    for weights in ranks:
        assert_same_weights(weights, reference, atol)
    untouched = build_model(config_from_dict({"model": {"name": "resnet_tiny"}}).model, CLASSES)
    moved = max((ranks[0][k] - v).abs().max().item() for k, v in untouched.state_dict().items()
                if v.is_floating_point())
    assert moved > 1e-3, "training did not change the weights; the comparison would be vacuous"


def test_gradient_accumulation_equals_the_larger_batch(tmp_path):
    optim = {"name": "sgd", "momentum": 0.9}
    accumulated = run_distributed(train_replica, 2, tmp_path, 2, 3, optim, str(tmp_path))
    reference = single_process(tmp_path / "single", 12, 1, optim)
    for weights in accumulated:
        assert_same_weights(weights, reference)
