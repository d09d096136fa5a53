"""Models by name: every torchvision classification model, plus `resnet_tiny` for small images."""

from __future__ import annotations

import torch
import torchvision
from torch import nn
from torchvision.models.resnet import BasicBlock

from ddp_cli.config import ModelConfig
from ddp_cli.errors import ConfigError, did_you_mean

TINY = "resnet_tiny"


class TinyResNet(nn.Module):
    """A CIFAR-style ResNet (3x3 stem, no max-pool, three stages) for 32-64 px images."""

    def __init__(self, num_classes: int, width: int = 32) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True)
        )
        stages, channels = [], width
        for out, stride in ((width, 1), (2 * width, 2), (4 * width, 2)):
            down = None
            if stride != 1 or out != channels:
                down = nn.Sequential(nn.Conv2d(channels, out, 1, stride, bias=False), nn.BatchNorm2d(out))
            stages.append(BasicBlock(channels, out, stride, down))
            channels = out
        self.stages = nn.Sequential(*stages)
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.stages(self.stem(x)))


def known_models() -> list[str]:
    return sorted([TINY, *torchvision.models.list_models(module=torchvision.models)])


def build_model(cfg: ModelConfig, num_classes: int) -> nn.Module:
    """A freshly initialised model (the caller seeds the RNG identically on every rank)."""
    if cfg.name == TINY:
        return TinyResNet(num_classes)
    if cfg.name not in known_models():
        raise ConfigError(f"model.name: unknown model {cfg.name!r}{did_you_mean(cfg.name, known_models())}")
    extra = {"aux_logits": False, "init_weights": True} if cfg.name in ("inception_v3", "googlenet") else {}
    return torchvision.models.get_model(cfg.name, weights=None, num_classes=num_classes, **extra)


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
