"""Models: built by name (torchvision's zoo, timm's, a user's own factory), fitted with weights, exported.
May import config and the foundations (user_model and timm_model: the foundations only), export also train.

Rooms: `zoo` builds and checks every model and does the fine-tuning surgery; `user_model` and
`timm_model` locate a user's factory and timm's architectures and weights (config reads model names
with them, so they sit below it); `export` writes a checkpoint's weights for other programs, with a
model card.

The zoo's public names are handed on here (`ddp_cli.models.TinyResNet` is what an exported model card
names), imported on first use: importing config imports `user_model` and so runs this file, which must
then import neither torch nor the zoo (which imports config).
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

__all__ = ["TinyResNet", "build_model", "builder_kwargs", "check_model", "classifier_head", "freeze",
           "hub_weights", "initial_weights", "is_weight_name", "known_models", "load_weights",
           "read_weights", "tensors_on_meta", "vit_depth"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(import_module("ddp_cli.models.zoo"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
