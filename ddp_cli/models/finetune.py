"""Fine-tuning's surgery on a built model: `model.freeze` (modules or parameters, for the whole run or
its first epochs), the classifier head (`optim.head_lr_mult`) and a ViT's layers (`optim.layer_decay`).

`freeze` is done to the model before DDP wraps it; `optim` groups the parameters by the names found here.
"""

from __future__ import annotations

import re

from torch import nn

from ddp_cli.config import ModelConfig
from ddp_cli.errors import ConfigError, did_you_mean

# torchvision's ViT blocks and timm's (ViT, DeiT, BEiT, EVA: blocks.N at the top)
VIT_BLOCK = re.compile(r"(?:encoder\.layers\.encoder_layer_|blocks\.)(\d+)\.")
VIT_EMBEDDINGS = ("conv_proj.", "class_token", "encoder.pos_embedding",  # torchvision's
                  "patch_embed.", "cls_token", "reg_token", "pos_embed")  # timm's


def frozen_parameters(model: nn.Module, cfg: ModelConfig) -> list[str]:
    """The parameters `model.freeze` names (modules, or parameters such as ViT's class_token), by name;
    a name the model lacks is a ConfigError with the close matches."""
    modules = [name for name, _ in model.named_modules() if name]
    params = [name for name, _ in model.named_parameters()]
    for name in cfg.freeze:
        if name not in modules and name not in params:
            raise ConfigError(f"model.freeze: {cfg.name} has no module {name!r}"
                              f"{did_you_mean(name, modules + params)}")
    return [p for p in params if any(p == name or p.startswith(name + ".") for name in cfg.freeze)]


def freeze(model: nn.Module, cfg: ModelConfig) -> None:
    """Freeze `model.freeze` for the whole run (`freeze_epochs = 0`) before DDP wraps the model: without
    requires_grad no gradient is computed or all-reduced for them and the optimiser never holds them.
    Frozen for the first N epochs only, they keep their gradients and the optimiser holds them at a zero
    LR until epoch N (`optim.param_groups`): DDP's set of gradients cannot change mid-run."""
    frozen = set(frozen_parameters(model, cfg))  # the names are checked either way
    if cfg.freeze_epochs:
        return
    for name, param in model.named_parameters():
        if name in frozen:
            param.requires_grad_(False)


def classifier_head(model: nn.Module, name: str = "the model") -> str:
    """The module that makes the logits: the one the model's `get_classifier()` returns (timm's
    convention; how a model of one's own names its head), else the last Linear (SqueezeNet: Conv2d) the
    model registers, i.e. fc (ResNet, RegNet), classifier.N (VGG, EfficientNet, ConvNeXt, MobileNet),
    heads.head (ViT), head (Swin; TinyResNet's head.2); tested on all of torchvision's classifiers."""
    named = getattr(model, "get_classifier", None)
    head = named() if callable(named) else None
    found = [n for n, m in model.named_modules() if (m is head if head is not None else
                                                      isinstance(m, nn.Linear | nn.Conv2d))]
    if not found:
        raise ConfigError(f"optim.head_lr_mult: {name} has no recognisable classifier head (no nn.Linear or "
                          "Conv2d, or get_classifier() returns none of its modules); give the model a "
                          "get_classifier() method returning its head module, or set optim.head_lr_mult = 1")
    return found[-1]


def vit_depth(model: nn.Module, name: str) -> int:
    """L, the encoder blocks of a ViT (torchvision's or timm's); layer-wise LR decay is defined for
    nothing else."""
    blocks = {int(m.group(1)) for p, _ in model.named_parameters() if (m := VIT_BLOCK.match(p))}
    if not blocks:
        raise ConfigError(f"optim.layer_decay: layer-wise LR decay needs a ViT (torchvision vit_*: "
                          f"encoder.layers.encoder_layer_N; timm's: blocks.N); {name} has no such layers; "
                          "set optim.layer_decay = 1 (a model of your own: name its blocks so)")
    return max(blocks) + 1


def vit_layer(param: str, depth: int) -> int:
    """A ViT parameter's layer for layer-wise LR decay (BEiT's numbering): 0 for the patch and position
    embeddings and the class token, i + 1 for encoder block i, depth + 1 for the final norm and the head."""
    if param.startswith(VIT_EMBEDDINGS):
        return 0
    block = VIT_BLOCK.match(param)
    return int(block.group(1)) + 1 if block else depth + 1
