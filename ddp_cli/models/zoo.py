"""Models by name: every torchvision classification model, `resnet_tiny` for small images, a
factory of the user's own (`package.module:factory`, `file.py:factory`: `ddp_cli.models.user_model`), and
timm's (`timm/<architecture>[.<tag>]`: `ddp_cli.models.timm_model`).

`build_model` makes the real, freshly initialised network in a worker (with `model.kwargs` for its
builder), with the fast recipe's tweaks (`tweaks`). What is done to it next lives beside: `weights`
(`model.weights`: files, torchvision's names, timm's pretrained) and `finetune` (freezing, the head,
a ViT's layers); `check` proves it all on the meta device before any worker starts.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch
from torch import nn

from ddp_cli.config import ModelConfig
from ddp_cli.config.model_names import is_timm_model
from ddp_cli.errors import ConfigError, did_you_mean
from ddp_cli.models.families import TINY
from ddp_cli.models.timm_model import build as timm_builder
from ddp_cli.models.timm_model import import_timm
from ddp_cli.models.tweaks import add_blurpool, zero_init_residual
from ddp_cli.models.user_model import call, factory, is_user_model

MOBILENET_V3_KWARGS = ["width_mult", "reduced_tail", "dilated"]  # read by its builders, not its class


class BasicBlock(nn.Module):
    """torchvision's ResNet BasicBlock, with its parameter names, without importing torchvision.

    torchvision costs 1.2 s to import, in the launcher and in every worker;
    the demo's model does not need it (torchvision models import it when built).
    """

    def __init__(self, inplanes: int, planes: int, stride: int = 1, downsample: nn.Module | None = None):
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 3, stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(planes, planes, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = downsample

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + (x if self.downsample is None else self.downsample(x)))


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
    import torchvision  # here, not at the top: see BasicBlock

    return sorted([TINY, *torchvision.models.list_models(module=torchvision.models)])


def import_builders(name: str) -> None:
    """Import now what building model `name` needs (torchvision: ~2 s), to pay for it while
    something else runs (the launcher's index build)."""
    if is_timm_model(name):
        import_timm(name)
    elif name != TINY and not is_user_model(name):
        import torchvision  # noqa: F401


def own_kwargs(name: str, image_size: int) -> dict:
    """What ddp passes torchvision's builder besides num_classes to build `name` for `image_size` inputs."""
    if name in ("inception_v3", "googlenet"):
        return {"aux_logits": False, "init_weights": True}  # one output; no init warning
    if name.startswith("vit_"):
        return {"image_size": image_size}
    if name.startswith("maxvit_"):
        return {"input_size": (image_size, image_size)}
    return {}


def builder_kwargs(cfg: ModelConfig, image_size: int) -> dict:
    """Every keyword argument of the builder besides num_classes: ddp's own and `model.kwargs`
    (what an exported model's card tells a program to pass)."""
    return {**own_kwargs(cfg.name, image_size), **cfg.kwargs}


def model_builder(name: str) -> Callable[..., nn.Module]:
    """The callable that makes model `name` from `num_classes=` and keyword arguments."""
    if name == TINY:
        return TinyResNet
    if name not in known_models():
        raise ConfigError(f"model.name: unknown model {name!r}{did_you_mean(name, known_models())}")
    import torchvision

    builder = torchvision.models.get_model_builder(name)
    return lambda **kwargs: builder(weights=None, **kwargs)


def builder_keywords(name: str) -> list[str]:
    """The keyword arguments `name`'s builder takes besides num_classes: its class's (torchvision's
    builders pass theirs on to it; the class is their return annotation), and mobilenet_v3's own."""
    if name == TINY:
        cls, extra = TinyResNet, []
    else:
        import torchvision

        cls = inspect.signature(torchvision.models.get_model_builder(name)).return_annotation
        extra = MOBILENET_V3_KWARGS if name.startswith("mobilenet_v3") else []
    named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return [p.name for p in inspect.signature(cls.__init__).parameters.values()
            if p.kind in named and p.name not in ("self", "num_classes")] + extra


def check_kwargs(cfg: ModelConfig, image_size: int) -> None:
    """`model.kwargs` names only keywords of the builder (a typo would otherwise be ignored by the
    builders that take **kwargs), and none that ddp sets itself."""
    own = own_kwargs(cfg.name, image_size)
    known = builder_keywords(cfg.name) if cfg.kwargs else []
    for key in cfg.kwargs:
        if key in own:
            raise ConfigError(f"model.kwargs: {key} is set by ddp for {cfg.name} (from data.image_size, "
                              "or to build it with one output); remove it")
        if key not in known:
            raise ConfigError(f"model.kwargs: {cfg.name} takes no keyword {key!r}; its builder takes "
                              f"{', '.join(known) or 'none'}")


def build_model(cfg: ModelConfig, num_classes: int, image_size: int = 224) -> nn.Module:
    """A freshly initialised model (the caller seeds the RNG identically on every rank), with the fast
    recipe's tweaks where asked (`tweaks`: not to a model of the user's own, whose design is theirs)."""
    if is_user_model(cfg.name):
        return user_model(cfg, num_classes)
    model = zoo_model(cfg, num_classes, image_size)
    if cfg.zero_init_residual:
        zero_init_residual(model)
    if cfg.blurpool:
        add_blurpool(model)
    return model


def zoo_model(cfg: ModelConfig, num_classes: int, image_size: int) -> nn.Module:
    """torchvision's, `resnet_tiny` or timm's model, as its builder makes it."""
    if is_timm_model(cfg.name):  # create_model takes **kwargs: a wrong one is the class's TypeError
        return call(cfg.name, timm_builder(cfg.name), num_classes, cfg.kwargs)
    builder = model_builder(cfg.name)
    check_kwargs(cfg, image_size)
    try:
        return builder(num_classes=num_classes, **builder_kwargs(cfg, image_size))
    except (ValueError, AssertionError, TypeError) as e:  # e.g. maxvit: size not a multiple of its windows
        if cfg.kwargs:
            raise ConfigError(f"model.kwargs: {cfg.name} cannot be built with {cfg.kwargs} for "
                              f"data.image_size = {image_size} ({first_line(e)})") from e
        if isinstance(e, TypeError):
            raise
        raise ConfigError(f"model.name: {cfg.name} cannot be built for data.image_size = {image_size} "
                          f"({first_line(e)})") from e


def user_model(cfg: ModelConfig, num_classes: int) -> nn.Module:
    """The user's factory called (`user_model.call`): what it returns must be a model."""
    model = call(cfg.name, factory(cfg.name, cfg.source.root if cfg.source else None), num_classes,
                 cfg.kwargs)
    if not isinstance(model, nn.Module):
        raise ConfigError(f"model.name: {cfg.name} returned a {type(model).__name__}, not a torch.nn.Module")
    return model


def first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
