"""Models: built by name (torchvision's zoo, timm's, a user's own factory), fitted with weights.
May import config and the foundations; never train (a checkpoint's export is train/export.py).

Rooms: `zoo` builds every model by name (`tweaks`: the fast recipe's surgery on it); `weights` finds and
fits `model.weights`; `finetune` freezes modules and finds the head and a ViT's layers; `check` proves a
model on the meta device before any worker starts; `user_model` and `timm_model` locate a user's factory
and timm's architectures and weights (the syntax of their names is the config's: config/model_names.py);
`families` says from a name alone which models take any input size (a fact of the config's resolve pass).

The public names are handed on here (`ddp_cli.models.TinyResNet` is what an exported model card
names), imported on first use: the commands that read a config import `user_model`, and so run this
file, without paying torch's import. Inside the package, code imports the module that holds a name.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

# each public name and the module that holds it
HOMES = {
    "TinyResNet": "zoo", "build_model": "zoo", "builder_kwargs": "zoo", "known_models": "zoo",
    "hub_weights": "weights", "initial_weights": "weights", "is_weight_name": "weights",
    "load_weights": "weights", "read_weights": "weights",
    "classifier_head": "finetune", "freeze": "finetune", "vit_depth": "finetune",
    "check_model": "check", "tensors_on_meta": "check",
}
__all__ = sorted(HOMES)


def __getattr__(name: str) -> Any:
    if name in HOMES:
        return getattr(import_module(f"ddp_cli.models.{HOMES[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
