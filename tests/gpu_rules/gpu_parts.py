"""What the fake-GPU tests train: a tiny conv net, 32 tiny images as loaders deal them to rank 3 of 8."""

from __future__ import annotations

from typing import Any

import torch
from replicas import CLASSES, make_config
from torch import nn
from torch.utils.data import Dataset

from ddp_cli.config import RunConfig
from ddp_cli.data.pipeline.loaders import Loaders, make_loader
from ddp_cli.data.pipeline.sampler import ShardSampler
from ddp_cli.distributed.setup import DistContext, choose_device, seed_everything
from ddp_cli.train.checkpoint import Checkpointer
from ddp_cli.train.objectives import Micro
from ddp_cli.train.trainer import Trainer
from gpu_rules.node import RANK, WORLD
from tests.resolved import resolved

SIZE, IMAGES, BATCH = 8, 32, 2  # 32 images: 2 per rank and step, 2 steps an epoch; val: 4 per rank


def tiny_net() -> nn.Module:
    """Conv, BatchNorm (buffers DDP broadcasts), pooling, a linear head: the layers a ResNet has, few ops."""
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                         nn.Flatten(), nn.Linear(4, CLASSES))


class TinyImages(Dataset):
    """Items as ImageDataset makes them (uint8 HWC image, label, skipped, error), for a training
    sampler's (index, epoch, copy) and a validation sampler's index alike."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.images = torch.randint(0, 256, (IMAGES, SIZE, SIZE, 3), dtype=torch.uint8, generator=g)

    def __len__(self) -> int:
        return IMAGES

    def __getitem__(self, item: Any):
        index = item[0] if isinstance(item, tuple) else item
        return self.images[index], index % CLASSES, "", ""


def tiny_loaders(pin_memory: bool = True) -> Loaders:
    """Rank 3's loaders as build_loaders makes them for a GPU worker (pinned, no loader processes)."""
    data = TinyImages()
    train = ShardSampler(IMAGES, RANK, WORLD, shuffle=True, batch_size=BATCH, with_epoch=True)
    val = ShardSampler(IMAGES, RANK, WORLD, shuffle=False)
    return Loaders(make_loader(data, train, BATCH, 0, 2, pin_memory, drop_last=True, seed=1),
                   make_loader(data, val, BATCH, 0, 2, pin_memory, drop_last=False, seed=1), train)


def gpu_config(**sections: dict) -> RunConfig:
    return make_config({"data": {"batch_size": BATCH, "image_size": SIZE}, **sections})


def gpu_trainer(cfg: RunConfig, checkpointer: Checkpointer | None = None) -> Trainer:
    """A Trainer as a worker on cuda:3 builds one: the device bound first (`choose_device`)."""
    seed_everything(cfg.seed)
    ctx = DistContext(RANK, WORLD, RANK, WORLD, choose_device("nccl", RANK), "nccl")
    return Trainer(resolved(cfg, 2, ctx.world_size, "cuda"), ctx, tiny_net(), tiny_loaders(), 2, checkpointer)


def micro_batches(trainer: Trainer) -> list[Micro]:
    """One step's labelled micro-batches, pinned as the loader hands them over."""
    batches = iter(trainer.loaders.train)
    trainer.loaders.train_sampler.set_epoch(0)
    return [(next(batches),) for _ in range(trainer.accum)]
