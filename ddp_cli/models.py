"""Models by name: every torchvision classification model, plus `resnet_tiny` for small images.

`build_model` makes the real, freshly initialised network in a worker.
`check_model` runs in the launcher and in `--dry-run`: it builds the same
network on the meta device (no memory, no arithmetic), pushes a fake batch of
every input size the run will use through it and matches `model.weights`
against it, so a model that cannot take the configured images, or weights
that do not fit, fail before any worker starts.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

from ddp_cli.config import ModelConfig, RunConfig
from ddp_cli.errors import ConfigError, DataError, did_you_mean
from ddp_cli.io import is_checkpoint, load_plain

TINY = "resnet_tiny"
WRAPPER_PREFIXES = ("module.", "_orig_mod.")  # DDP and torch.compile wrap names this way


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
    if name != TINY:
        import torchvision  # noqa: F401


def fixed_size(name: str) -> bool:
    """ViT and MaxViT are built for one input size (position embeddings, attention windows)."""
    return name.startswith(("vit_", "maxvit_"))


def builder_kwargs(name: str, image_size: int) -> dict:
    """What torchvision needs besides num_classes to build `name` for `image_size` inputs."""
    if name in ("inception_v3", "googlenet"):
        return {"aux_logits": False, "init_weights": True}  # one output; no init warning
    if name.startswith("vit_"):
        return {"image_size": image_size}
    if name.startswith("maxvit_"):
        return {"input_size": (image_size, image_size)}
    return {}


def build_model(cfg: ModelConfig, num_classes: int, image_size: int = 224) -> nn.Module:
    """A freshly initialised model (the caller seeds the RNG identically on every rank)."""
    if cfg.name == TINY:
        return TinyResNet(num_classes)
    if cfg.name not in known_models():
        raise ConfigError(f"model.name: unknown model {cfg.name!r}{did_you_mean(cfg.name, known_models())}")
    import torchvision

    try:
        return torchvision.models.get_model(cfg.name, weights=None, num_classes=num_classes,
                                            **builder_kwargs(cfg.name, image_size))
    except (ValueError, AssertionError) as e:  # e.g. maxvit: size not a multiple of its windows
        raise ConfigError(f"model.name: {cfg.name} cannot be built for data.image_size = {image_size} "
                          f"({first_line(e)})") from e


@contextmanager
def tensors_on_meta() -> Iterator[None]:
    """Parameters and buffers move to the meta device as modules register them.

    Accelerate's `init_empty_weights` trick: unlike `with torch.device("meta")`
    it leaves the tensors a constructor computes with on the CPU (RegNet derives
    its widths from tensors), and it needs no memory for vit_h_14's 632M weights.
    """
    register_parameter, register_buffer = nn.Module.register_parameter, nn.Module.register_buffer

    def parameter(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        meta = None if param is None else nn.Parameter(param.to("meta"), param.requires_grad)
        register_parameter(module, name, meta)

    def buffer(module: nn.Module, name: str, tensor: torch.Tensor | None, persistent: bool = True) -> None:
        register_buffer(module, name, None if tensor is None else tensor.to("meta"), persistent)

    nn.Module.register_parameter, nn.Module.register_buffer = parameter, buffer
    try:
        yield
    finally:
        nn.Module.register_parameter, nn.Module.register_buffer = register_parameter, register_buffer


def check_model(cfg: RunConfig, num_classes: int) -> nn.Module:
    """The model on the meta device, after proving it takes every input size the run uses.

    Raises ConfigError naming the key to change. The returned module has real
    shapes (so parameters can be counted) but no data.
    """
    with tensors_on_meta():
        model = build_model(cfg.model, num_classes, cfg.data.image_size).eval()
    sizes = sorted(cfg.data.sizes(cfg.train.epochs))
    if fixed_size(cfg.model.name) and sizes != [cfg.data.image_size]:
        raise ConfigError(f"model.name: {cfg.model.name} takes only data.image_size = "
                          f"{cfg.data.image_size} inputs, but the run also uses {sizes}; unset "
                          "data.min_image_size and data.val_image_size")
    for size in sizes if cfg.model.name != TINY else ():  # convs and an adaptive pool: any size
        try:
            with torch.no_grad():
                model(torch.empty(2, 3, size, size, device="meta"))
        except (RuntimeError, ValueError, AssertionError) as e:
            raise ConfigError(f"model.name: {cfg.model.name} cannot take {size}x{size} images "
                              f"({first_line(e)}); raise data.image_size (and data.min_image_size), "
                              "torchvision trains most models at 224, inception_v3 at 299") from e
    if cfg.model.weights:
        select_weights(model.state_dict(), read_weights(cfg.model.weights), cfg.model, num_classes)
    return model


def read_weights(path: str) -> dict[str, torch.Tensor]:
    """The tensors of a state dict or a ddp checkpoint, with DDP/compile prefixes removed."""
    if not Path(path).is_file():
        raise ConfigError(f"model.weights: {path}: no such file (weights are never downloaded)")
    state = load_plain(Path(path))
    if is_checkpoint(state):
        state = state["model"]
    elif isinstance(state, dict) and isinstance(state.get("state_dict"), dict):
        state = state["state_dict"]
    tensors = {}
    for key, value in state.items() if isinstance(state, dict) else ():
        if isinstance(value, torch.Tensor):
            while key.startswith(WRAPPER_PREFIXES):
                key = key.split(".", 1)[1]
            tensors[key] = value
    if not tensors:
        raise DataError(f"model.weights: {path} holds no tensors; give a state dict or a ddp checkpoint")
    return tensors


def select_weights(expected: Mapping[str, torch.Tensor], found: dict[str, torch.Tensor],
                   cfg: ModelConfig, num_classes: int) -> dict[str, torch.Tensor]:
    """The tensors of `found` to load into a model whose state is `expected`.

    Every tensor must be present with its shape, except a classifier for another
    class count, which `new_head` leaves freshly initialised. Old files without
    BatchNorm's `num_batches_tracked` are fine.
    """
    where = f"model.weights: {cfg.weights} does not fit {cfg.name}"
    missing = [k for k in expected if k not in found and not k.endswith("num_batches_tracked")]
    unexpected = [k for k in found if k not in expected]
    if missing or unexpected:
        raise ConfigError(f"{where}: {_names('missing', missing)}{_names('unexpected', unexpected)}"
                          "is it from another model?")
    wrong = [k for k in found if found[k].shape != expected[k].shape]
    head = [k for k in wrong if _other_class_count(expected[k], found[k], num_classes)]
    if len(head) < len(wrong):
        k = next(k for k in wrong if k not in head)
        raise ConfigError(f"{where}: {k} is {tuple(found[k].shape)} in the file, "
                          f"{tuple(expected[k].shape)} in the model")
    if head and not cfg.new_head:
        raise ConfigError(f"model.weights: {cfg.weights} has a {found[head[0]].shape[0]}-class head, "
                          f"the data set has {num_classes} classes; set model.new_head = true to "
                          "train a fresh head")
    return {k: v for k, v in found.items() if k not in head}


def load_weights(model: nn.Module, cfg: ModelConfig, num_classes: int) -> None:
    """Copy `model.weights` into a freshly built model (in place, on every rank)."""
    model.load_state_dict(select_weights(model.state_dict(), read_weights(cfg.weights), cfg, num_classes),
                          strict=False)


def _other_class_count(model_tensor: torch.Tensor, file_tensor: torch.Tensor, num_classes: int) -> bool:
    return (model_tensor.shape[0] == num_classes and file_tensor.shape[0] != num_classes
            and model_tensor.shape[1:] == file_tensor.shape[1:])


def _names(kind: str, keys: list[str]) -> str:
    if not keys:
        return ""
    more = f" and {len(keys) - 3} more" if len(keys) > 3 else ""
    return f"{kind} {', '.join(keys[:3])}{more}; "


def first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
