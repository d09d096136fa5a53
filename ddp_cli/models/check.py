"""The model checked before any worker starts, in the launcher and in `--dry-run`.

`check_model` builds the run's network on the meta device (no memory, no arithmetic), pushes a fake
batch of every input size the run will use through it (one logit per class must come out) and matches
`model.weights`, `model.freeze` and `optim.layer_decay` against it (and under pretrain.method, SimCLR's
projection), so a model that cannot take the configured images, or weights or names that do not fit,
fail with the key to change.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from ddp_cli.config import RunConfig
from ddp_cli.errors import ConfigError
from ddp_cli.models.families import TINY, fixed_size
from ddp_cli.models.finetune import classifier_head, freeze, vit_depth
from ddp_cli.models.projection import add_projection
from ddp_cli.models.timm_model import cached_weights
from ddp_cli.models.weights import initial_weights, is_timm_pretrained, select_weights
from ddp_cli.models.zoo import build_model, first_line


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
                logits = model(torch.empty(2, 3, size, size, device="meta"))
        except (RuntimeError, ValueError, AssertionError, TypeError) as e:
            fix = ("raise data.image_size (and data.min_image_size), torchvision trains most models at "
                   "224, inception_v3 at 299")
            if size == cfg.data.min_image_size:  # progressive resizing's first crop, maybe by default
                fix = ("it is data.min_image_size, progressive resizing's first crop: raise it, or set "
                       "data.progressive = false")
            raise ConfigError(f"model.name: {cfg.model.name} cannot take {size}x{size} images "
                              f"({first_line(e)}); {fix}") from e
        check_logits(logits, cfg.model.name, num_classes)
    if is_timm_pretrained(cfg.model):
        cached_weights(cfg.model.name)  # there, or exit 3; timm fits them (a fresh head where needed)
    elif cfg.model.weights:
        select_weights(model.state_dict(), initial_weights(cfg.model), cfg.model, num_classes)
    check_finetune(model, cfg)
    if cfg.pretrain.on():  # a Linear classifier to project from, or exit 2 before any worker starts
        with tensors_on_meta():
            add_projection(model, cfg.pretrain)
    return model


def check_logits(logits: object, name: str, num_classes: int) -> None:
    """A batch of 2 images must give 2 x num_classes logits (a factory that ignores num_classes, say)."""
    shape = tuple(logits.shape) if isinstance(logits, torch.Tensor) else None
    if shape != (2, num_classes):
        got = f"shape {shape}" if shape else f"a {type(logits).__name__}"
        raise ConfigError(f"model.name: {name} gives {got} for 2 images, not (2, {num_classes}): one logit "
                          "per class of the data set; build the classifier with num_classes outputs (a "
                          "factory taking num_classes= gets the class count) and return the logits alone")


def check_finetune(model: nn.Module, cfg: RunConfig) -> None:
    """What fine-tuning asks of the model: modules to freeze that exist (frozen on `model`, as the
    workers will), something left to train, and a ViT for layer-wise LR decay."""
    freeze(model, cfg.model)
    if not any(param.requires_grad for param in model.parameters()):
        raise ConfigError(f"model.freeze: {', '.join(cfg.model.freeze)} holds every parameter of "
                          f"{cfg.model.name}: nothing would train")
    if cfg.optim.layer_decay != 1:
        vit_depth(model, cfg.model.name)
    if cfg.optim.head_lr_mult != 1:
        classifier_head(model, cfg.model.name)
