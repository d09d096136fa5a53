"""A checkpoint as a classifier: its config, its classes and the weights asked for (live or EMA).

What `validate`, `predict` and `export` start from. A checkpoint is a training
state (optimiser, RNGs, progress); these commands need only the network, the
class list with its descriptions, the preprocessing of validation and the
final accuracy of the chosen weights, so they all read it here, once.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from ddp_cli.config import ModelConfig, RunConfig, config_from_dict
from ddp_cli.errors import ConfigError, DataError
from ddp_cli.models.user_model import changed
from ddp_cli.models.zoo import build_model
from ddp_cli.train.checkpoint import load_checkpoint

log = logging.getLogger("ddp")

Weights = Literal["model", "ema"]


@dataclass
class Trained:
    path: Path
    cfg: RunConfig
    classes: list[str]  # synsets (or class folder names), in label order
    descriptions: list[str]  # one per class (the synsets again in checkpoints written before them)
    weights: Weights
    state_dict: dict[str, torch.Tensor] | None  # None: the file has none (refused when built)
    final: dict[str, Any]  # the last validation of these weights during training ({} if none)
    dataset: dict[str, Any]  # the registry entry it was trained on

    def build(self) -> nn.Module:
        """The network in eval mode with these weights, loaded strictly."""
        if self.state_dict is None:
            raise DataError(f"{self.path}: holds no model weights; give a checkpoint from <run>/checkpoints/")
        model = build_model(self.cfg.model, len(self.classes), self.cfg.data.image_size)
        try:
            model.load_state_dict(self.state_dict)
        except RuntimeError as e:
            raise ConfigError(f"{self.path}: weights do not fit model {self.cfg.model.name!r} with "
                              f"{len(self.classes)} classes; pass the run's own --config") from e
        return model.eval()


def load_trained(path: str | Path, weights: Weights | Literal["auto"] = "auto",
                 cfg: RunConfig | None = None) -> Trained:
    """Read `path` (safely and in the current format, `load_checkpoint`); `cfg` replaces the checkpoint's
    own config. `weights` "auto" are those the run judged its best by (checkpoint.best_metric): the EMA's
    where it tracked ema_top1 and the file holds them, else the trained ones."""
    state = load_checkpoint(path)
    missing = next((key for key in ("config", "classes", "descriptions") if key not in state), None)
    if missing or not all(isinstance(name, str) for name in [*state["classes"], *state["descriptions"]]):
        raise DataError(f"{path}: holds {f'no {missing}' if missing else 'classes that are not names'}; give "
                        "a checkpoint from <run>/checkpoints/")
    own = config_from_dict(state["config"], str(path))
    if own.pretrain.on():
        raise ConfigError(f"{path}: a pretrain.method = \"{own.pretrain.method}\" run's, whose classifier is "
                          "untrained (its val top-1 is the features' nearest class mean); train from it on "
                          "labels (model.weights = this file), then validate, predict or export that run")
    if weights == "auto":
        has_ema = isinstance((state.get("ema") or {}).get("module"), dict)
        weights = "ema" if own.checkpoint.best_metric == "ema_top1" and has_ema else "model"
    cfg = (cfg or own).resolved({"model.weights": None}, str(path))  # the checkpoint's weights, not the start
    if weights == "ema":
        if not state.get("ema") or not isinstance(state["ema"].get("module"), dict):
            raise ConfigError(f"--weights ema: {path} holds no EMA weights (the run had "
                              "train.ema_decay = 0); use --weights model, or train with train.ema_decay")
        tensors, final = state["ema"]["module"], state.get("final_ema") or {}
    else:
        tensors, final = state.get("model"), state.get("final") or {}
    classes = list(state["classes"])
    return Trained(Path(path), cfg, classes, list(state["descriptions"]), weights,
                   tensors, dict(final), dict(state.get("dataset") or {}))


def warn_if_changed(model: ModelConfig, checkpoint: str | Path) -> None:
    """Say so when the file of a model of the user's own (`model`, as `checkpoint` records it) is no
    longer the one the run was checked with: once per command (the launcher's side of validate, predict
    and export; rank 0 on resuming), not once per worker."""
    message = changed(model.name, model.source.sha256 if model.source else None)
    if message:
        log.warning("warning: %s (checkpoint %s)", message, checkpoint)
