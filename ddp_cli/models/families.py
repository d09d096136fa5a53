"""What ddp knows of a model from its name alone, without building it or importing torchvision: which
names take one input size only, and which take any (so that the config's recipe defaults can choose)."""

from __future__ import annotations

from ddp_cli.config.model_names import is_timm_model, is_user_model

TINY = "resnet_tiny"


def fixed_size(name: str) -> bool:
    """ViT and MaxViT are built for one input size (position embeddings, attention windows)."""
    return name.startswith(("vit_", "maxvit_"))


def takes_any_size(name: str) -> bool:
    """A torchvision CNN or resnet_tiny: the models whose input size ddp may vary on its own (progressive
    resizing by default). A model of your own or timm's may be built for one size; ddp leaves them be."""
    return not (fixed_size(name) or is_user_model(name) or is_timm_model(name))
