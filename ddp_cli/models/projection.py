"""SimCLR's projection head on any classifier ddp builds (pretrain.method).

The model keeps its structure and names: the projection MLP is registered inside
its classifier (`PROJECTION`, a child that a Linear's forward never calls, and
that no nn.Sequential runs in its sequence) and, while the classifier is in
training mode, takes the place of its output through a forward hook. So DDP
wraps one module, the optimiser and the checkpoint see the projection as the
model's own, and in eval mode the model is the classifier it was. The classifier
itself is frozen as initialised (NT-Xent never reads it); `model.weights` leaves
the projection's tensors out, so a later run on labels starts from the features
alone.
"""

from __future__ import annotations

import torch
from torch import nn

from ddp_cli.config import PretrainConfig
from ddp_cli.errors import ConfigError
from ddp_cli.models.finetune import classifier_head

PROJECTION = "simclr_projection"  # the head's name in the classifier, and in its tensors' keys


class Projection(nn.Module):
    """The MLP of SimCLR: features -> 2 x features -> ReLU -> `dim`."""

    def __init__(self, width: int, dim: int) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(width, 2 * width), nn.ReLU(), nn.Linear(2 * width, dim))

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.mlp(features)

    def replace_output(self, classifier: nn.Module, inputs: tuple[torch.Tensor, ...],
                       logits: torch.Tensor) -> torch.Tensor | None:
        """The classifier's forward hook: in train mode the projection of its input, else its logits."""
        return self(inputs[0]) if classifier.training else None


def add_projection(model: nn.Module, cfg: PretrainConfig) -> nn.Module:
    """`model` (in place) with SimCLR's projection on its classifier's input and the classifier frozen."""
    name = classifier_head(model, "pretrain.method")
    classifier = model.get_submodule(name)
    if not isinstance(classifier, nn.Linear):
        raise ConfigError(f"pretrain.method: the model's classifier (module {name!r}) is a "
                          f"{type(classifier).__name__}, not an nn.Linear whose input is the features; give "
                          "the model a Linear head")
    classifier.requires_grad_(False)  # before the projection joins it
    projection = Projection(classifier.in_features, cfg.projection_dim)
    classifier.add_module(PROJECTION, projection)
    classifier.register_forward_hook(projection.replace_output)
    return model


def projected_classifier(model: nn.Module) -> nn.Module:
    """The classifier `add_projection` put the projection in (validation reads its input)."""
    return next(module for module in model.modules() if PROJECTION in module._modules)


def without_projection(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A checkpoint's model tensors less the projection's: the features and the classifier."""
    return {k: v for k, v in tensors.items() if f".{PROJECTION}." not in f".{k}"}
