"""A model's starting weights (`model.weights`): a state dict or ddp checkpoint file (a pretrain run's
without its projection head), a torchvision weight name (its file in the torch hub cache, never
downloaded) or a timm model's "pretrained" (from the local Hugging Face cache), matched name by name
and shape by shape against the model ddp builds.

`load_weights` copies them into a freshly built model in a worker; `select_weights` is the match, which
`check.check_model` runs on the meta device in the launcher, so weights that do not fit fail before any
worker starts.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlparse

import torch
from torch import nn

from ddp_cli.config import ModelConfig
from ddp_cli.config.model_names import is_timm_model
from ddp_cli.errors import ConfigError, DataError, did_you_mean
from ddp_cli.io import is_checkpoint, load_plain
from ddp_cli.models.families import TINY
from ddp_cli.models.projection import without_projection
from ddp_cli.models.timm_model import PRETRAINED, build_pretrained
from ddp_cli.models.user_model import call, is_user_model

WRAPPER_PREFIXES = ("module.", "_orig_mod.")  # DDP and torch.compile wrap names this way
# "DEFAULT", "IMAGENET1K_V2" or "ResNet50_Weights.IMAGENET1K_V2": a torchvision weight name, not a file
WEIGHT_NAME = re.compile(r"(?:\w+_Weights\.)?[A-Z][A-Z0-9_]*")
# torchvision's DenseNet files predate its module names (torchvision renames them on load, as here)
OLD_DENSENET = re.compile(
    r"^(.*denselayer\d+\.(?:norm|relu|conv))\.([12]\.(?:weight|bias|running_mean|running_var))$")
AUX_HEADS = ("AuxLogits.", "aux1.", "aux2.")  # inception_v3's and googlenet's; ddp builds them without


def is_weight_name(weights: str) -> bool:
    """A torchvision weight name or timm's "pretrained" rather than a file (a file so named is given as
    "./DEFAULT")."""
    return weights == PRETRAINED or WEIGHT_NAME.fullmatch(weights) is not None


def is_timm_pretrained(cfg: ModelConfig) -> bool:
    return is_timm_model(cfg.name) and cfg.weights == PRETRAINED


def hub_weights(cfg: ModelConfig) -> tuple[Path, str]:
    """The file torchvision would download for the weights `cfg.weights` names (in torch's hub cache,
    $TORCH_HOME/hub/checkpoints) and its URL; nothing is downloaded."""
    if cfg.weights == PRETRAINED:
        raise ConfigError(f"model.weights: \"{PRETRAINED}\" is for timm models (\"timm/<architecture>\"); "
                          f"for {cfg.name} give a file or a torchvision weight name (\"DEFAULT\")")
    if cfg.name == TINY or is_user_model(cfg.name) or is_timm_model(cfg.name):
        other = f' or "{PRETRAINED}"' if is_timm_model(cfg.name) else ""
        raise ConfigError(f"model.weights: {cfg.weights} is a torchvision weight name and {cfg.name} has "
                          f"none; give a file{other}")
    import torchvision

    enum = torchvision.models.get_model_weights(cfg.name)
    prefix, _, member = cfg.weights.rpartition(".")
    if prefix and prefix != enum.__name__:
        raise ConfigError(f"model.weights: {cfg.weights} are not {cfg.name}'s weights ({enum.__name__})")
    if member not in enum.__members__:
        raise ConfigError(f"model.weights: {cfg.name} has no weights {member!r}"
                          f"{did_you_mean(member, list(enum.__members__))}")
    url = enum[member].url
    return Path(torch.hub.get_dir()) / "checkpoints" / Path(urlparse(url).path).name, url


def weights_file(cfg: ModelConfig) -> str:
    """`model.weights` as a local file: the path given, or a torchvision weight name's file in the hub
    cache, which must be there (exit 3 naming the file and where to fetch it)."""
    if not is_weight_name(cfg.weights):
        return cfg.weights
    path, url = hub_weights(cfg)
    if not path.is_file():
        raise DataError(f"model.weights: {cfg.weights} for {cfg.name} is not in the torch hub cache: no "
                        f"{path} (nothing is downloaded here); fetch {url} to that path on a machine with "
                        "internet, or point $TORCH_HOME at a cache that has it")
    return str(path)


def initial_weights(cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The tensors `model.weights` names, in the names of the model ddp builds."""
    tensors = without_projection(read_weights(weights_file(cfg)))  # a pretrain run's: its features
    return {OLD_DENSENET.sub(r"\1\2", k): v for k, v in tensors.items() if not k.startswith(AUX_HEADS)}


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
    """Copy `model.weights` into a freshly built model (in place, on every rank); a timm model's
    "pretrained" as timm loads them from the local cache."""
    if is_timm_pretrained(cfg):
        model.load_state_dict(timm_pretrained(cfg, num_classes).state_dict())
        return
    model.load_state_dict(select_weights(model.state_dict(), initial_weights(cfg), cfg, num_classes),
                          strict=False)


def timm_pretrained(cfg: ModelConfig, num_classes: int) -> nn.Module:
    """A timm model built with its cached pretrained weights, every tensor loaded but a classifier for
    another class count: timm loads those non-strictly, so a file missing part of the body would otherwise
    leave it silently random (DataError naming what is missing)."""
    with load_results() as results:
        model = call(cfg.name, build_pretrained(cfg.name), num_classes, cfg.kwargs)
    head, weights = model.pretrained_cfg.get("classifier") or (), model.pretrained_cfg.get("num_classes")
    fresh = {f"{c}.{p}" for c in ((head,) if isinstance(head, str) else head) for p in ("weight", "bias")
             if num_classes != weights}  # the keys timm leaves out on purpose
    missing = [k for r in results for k in r.missing_keys if k not in fresh]
    unexpected = [k for r in results for k in r.unexpected_keys]
    if missing or unexpected:
        raise DataError(f"model.weights: the cached pretrained weights of {cfg.name} do not fit it: "
                        f"{_names('missing', missing)}{_names('unexpected', unexpected)}fetch them again "
                        "(`hf download`) or unset model.weights")
    return model


@contextmanager
def load_results() -> Iterator[list]:
    """Every `load_state_dict` result while inside: what a non-strict load (timm's) left out."""
    results, original = [], nn.Module.load_state_dict

    def recording(module: nn.Module, state_dict: Mapping, strict: bool = True, assign: bool = False):
        result = original(module, state_dict, strict=strict, assign=assign)
        results.append(result)
        return result

    nn.Module.load_state_dict = recording
    try:
        yield results
    finally:
        nn.Module.load_state_dict = original


def _other_class_count(model_tensor: torch.Tensor, file_tensor: torch.Tensor, num_classes: int) -> bool:
    return (model_tensor.shape[0] == num_classes and file_tensor.shape[0] != num_classes
            and model_tensor.shape[1:] == file_tensor.shape[1:])


def _names(kind: str, keys: list[str]) -> str:
    if not keys:
        return ""
    more = f" and {len(keys) - 3} more" if len(keys) > 3 else ""
    return f"{kind} {', '.join(keys[:3])}{more}; "
