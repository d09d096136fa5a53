"""Trainer replicas fed synthetic global batches directly (no loaders), for the gloo tests.

Rank r of k takes the block [r*b, (r+1)*b) of each micro-batch's k*b positions, as
ShardSampler deals them, so k replicas see exactly the batch one process would.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from ddp_cli.config import RunConfig, config_from_dict
from ddp_cli.data.pipeline.loaders import Batch, Loaders
from ddp_cli.distributed.setup import DistContext, seed_everything
from ddp_cli.models import build_model
from ddp_cli.models.projection import add_projection, projected_classifier
from ddp_cli.run.training import assert_identical_across_ranks
from ddp_cli.train.checkpoint import Checkpointer, CheckpointStore
from ddp_cli.train.trainer import Trainer
from tests.resolved import resolved

CLASSES = 3
# fp32 NCHW: the equalities these replicas check are of fp32 arithmetic (ddp's default is bf16 where the
# CPU has it, whose rounding would need tolerances of its own; tests/unit/test_precision.py covers bf16)
BASE = {
    "data": {"batch_size": 4, "image_size": 16},
    "model": {"name": "resnet_tiny", "channels_last": False},
    "optim": {"lr_per_256": 2.0, "weight_decay": 1e-3},
    "schedule": {"name": "cosine", "warmup_steps": 2},
    "train": {"epochs": 1, "precision": "fp32"},
}


def make_config(sections: dict) -> RunConfig:
    """BASE with `sections` merged in, section by section."""
    raw = {name: dict(keys) for name, keys in BASE.items()}
    for name, keys in sections.items():
        raw.setdefault(name, {}).update(keys)
    return config_from_dict(raw)


def global_batch(step: int, size: int, views: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """`size` images (each as `views` views where given: N x views x H x W x C) and labels."""
    g = torch.Generator().manual_seed(100 + step)
    images = torch.randint(0, 256, (size, *([views] if views else []), 16, 16, 3), dtype=torch.uint8,
                           generator=g)
    return images, torch.randint(0, CLASSES, (size,), generator=g)


def group_norm_for_batchnorm(model: nn.Module) -> nn.Module:
    """Each BatchNorm2d replaced by a one-group GroupNorm: a normalisation within each image, so no
    statistic crosses images (or ranks), in training mode as in eval."""
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.BatchNorm2d):
                setattr(module, name, nn.GroupNorm(1, child.num_features))
    return model


def make_trainer(rank: int, world_size: int, cfg: RunConfig, steps: int, folder: str,
                 batchnorm: bool = True) -> Trainer:
    """A Trainer as a worker builds one, with no loaders (steps are fed by hand) and checkpoints
    in `folder`/checkpoints (rank 0 writes); `batchnorm=False`: GroupNorm in its place."""
    ctx = DistContext(rank, world_size, rank, world_size, torch.device("cpu"), "gloo")
    seed_everything(cfg.seed)
    model = build_model(cfg.model, CLASSES)
    if not batchnorm:
        group_norm_for_batchnorm(model)
    if cfg.pretrain.on():
        add_projection(model, cfg.pretrain)
    store = CheckpointStore(Path(folder) / "checkpoints", cfg.checkpoint.keep_last)
    trainer = Trainer(resolved(cfg, steps, ctx.world_size), ctx, model, Loaders(None, [], None), steps,
                      Checkpointer(store, writes=rank == 0))
    trainer.model.eval()  # BatchNorm in eval: a sample's gradient does not depend on its batch-mates
    if cfg.pretrain.on():  # ... but the classifier training: its output is the projection's
        projected_classifier(trainer.model.module).train()
    return trainer


def step_replica(trainer: Trainer, rank: int, world_size: int, step: int) -> None:
    """One optimisation step on this rank's slice of global batch `step`."""
    accum, batch = trainer.accum, trainer.cfg.data.batch_size
    images, labels = global_batch(step, world_size * batch * accum, 2 if trainer.cfg.pretrain.on() else 0)
    mine = torch.arange(len(labels)).view(accum, world_size, batch)[:, rank]  # each micro-batch's block
    trainer.train_step([(Batch(images[idx], labels[idx], [""] * batch, [""] * batch),) for idx in mine])


def weights(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in trainer.model.module.state_dict().items()}


def train_replica(rank: int, world_size: int, sections: dict, steps: int, folder: str,
                  batchnorm: bool = True) -> dict:
    """Run `steps` optimisation steps; {"start": the weights the run began from, "end": after training}
    (checked identical across ranks)."""
    trainer = make_trainer(rank, world_size, make_config(sections), steps, folder, batchnorm)
    start = weights(trainer)
    for step in range(steps):
        step_replica(trainer, rank, world_size, step)
        trainer.state.step += 1  # as train_epoch counts them: batch mixing draws per step
    if world_size > 1:
        assert_identical_across_ranks(trainer.model.module, "after training")
    return {"start": start, "end": weights(trainer)}


def train_replicas(rank: int, world_size: int, runs: list[tuple]) -> list[dict]:
    """`train_replica(rank, world_size, *run)` for each run in turn, in this one process: several
    tests' runs share one spawn (each spawned process costs a torch import)."""
    return [train_replica(rank, world_size, *run) for run in runs]
