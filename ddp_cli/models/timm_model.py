"""timm's models: `model.name = "timm/<architecture>[.<pretrained tag>]"`, weights from the local hub cache.

timm is imported here only, lazily (seconds to import), and only for a timm
model, with the Hugging Face hub forced offline first: ddp never downloads at
run time. `model.weights = "pretrained"` means the tag's weights as the
Hugging Face cache holds them (`$HF_HUB_CACHE`, else `$HF_HOME/hub`, else
`~/.cache/huggingface/hub`, huggingface_hub's own rule); they are found by
path (`models--<org>--<name>/refs/main` -> `snapshots/<revision>/<file>`),
never fetched; missing ones are exit 3 naming the path and the `hf download`
that fills it. The weights' data config (the `pretrained_cfg` of the
snapshot's config.json: mean, std, interpolation, crop_pct, input_size) is
read when the run config is (`data_config`), so it lands in the resolved
config and every checkpoint: validate, predict and export never need the cache.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ddp_cli.config.model_names import TIMM_PREFIX as PREFIX
from ddp_cli.config.model_names import TimmName
from ddp_cli.config.model_names import parse_timm as parse
from ddp_cli.errors import ConfigError, DataError, did_you_mean, require_extra

PRETRAINED = "pretrained"  # model.weights: the tag's weights, from the local hub cache
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")  # what timm reads from a hub repo, in its order


@dataclass(frozen=True)
class CachedWeights:
    repo_id: str  # "timm/resnet50.a1_in1k"
    snapshot: Path  # <cache>/models--timm--resnet50.a1_in1k/snapshots/<revision>
    file: Path  # the weights in it
    revision: str


def import_timm(name: str) -> Any:
    """timm, imported with the hub offline (huggingface_hub reads HF_HUB_OFFLINE once, at its import)."""
    require_extra("timm", f"model.name = {name!r}")
    os.environ["HF_HUB_OFFLINE"] = "1"
    import huggingface_hub.constants
    import timm

    huggingface_hub.constants.HF_HUB_OFFLINE = True  # and where huggingface_hub was imported before
    logging.getLogger("timm").setLevel(logging.WARNING)  # its per-rank "Missing keys (fc...)": ddp checks
    return timm


def architecture(name: str) -> TimmName:
    """`name` parsed, its architecture and tag ones timm has (else a ConfigError with timm's close names)."""
    parsed = parse(name)
    timm = import_timm(name)
    if not timm.is_model(parsed.architecture):
        raise ConfigError(f"model.name: timm has no architecture {parsed.architecture!r}"
                          f"{did_you_mean(parsed.architecture, timm.list_models())}")
    tags = timm.list_pretrained(f"{parsed.architecture}.*")
    if parsed.tag and parsed.timm_name not in tags:
        raise ConfigError(f"model.name: timm has no pretrained tag {parsed.tag!r} for {parsed.architecture}"
                          f"{did_you_mean(parsed.timm_name, tags) or f' (it has {len(tags)} tags)'}")
    return parsed


def pretrained_cfg(name: str) -> Any:
    """timm's pretrained config of `name`'s tag (its default tag when none is given)."""
    parsed = architecture(name)
    timm = import_timm(name)
    if not timm.list_pretrained(f"{parsed.architecture}.*"):
        raise ConfigError(f"model.weights: timm has no pretrained weights for {parsed.architecture}; unset "
                          "model.weights to train it from scratch")
    return timm.models.get_pretrained_cfg(parsed.timm_name)


def with_tag(name: str) -> str:
    """`name` with the tag whose weights "pretrained" means (timm's default tag when none is given), so the
    run config and its checkpoints record exactly which weights the run started from."""
    cfg = pretrained_cfg(name)
    return f"{PREFIX}{cfg.architecture}.{cfg.tag}"


def hub_cache() -> Path:
    """The Hugging Face hub cache folder, by huggingface_hub's rule, read from the environment now."""
    if os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE"):
        return Path(os.environ.get("HF_HUB_CACHE") or os.environ["HUGGINGFACE_HUB_CACHE"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME") or "~/.cache"
    return Path(os.environ.get("HF_HOME") or Path(xdg) / "huggingface").expanduser() / "hub"


def repo_folder(repo_id: str) -> Path:
    return hub_cache() / f"models--{repo_id.replace('/', '--')}"


def cached_weights(name: str) -> CachedWeights:
    """The pretrained weights of `name` (tagged) in the local cache; DataError (exit 3) naming the path
    expected and the command that fills it on a connected machine when they are not there."""
    cfg = pretrained_cfg(name)
    repo_id, _, revision = (cfg.hf_hub_id or "").partition("@")
    if not repo_id:
        raise ConfigError(f"model.weights: timm's weights for {name} are not on the Hugging Face hub (only "
                          f"at {cfg.url or 'no URL'}); give model.weights a file of them")
    folder = repo_folder(repo_id)
    ref = folder / "refs" / (revision or "main")
    revision = ref.read_text().strip() if ref.is_file() else revision
    snapshot = folder / "snapshots" / (revision or "<revision>")
    files = [snapshot / f for f in ((cfg.hf_hub_filename,) if cfg.hf_hub_filename else WEIGHT_FILES)]
    found = next((f for f in files if f.is_file()), None)
    if found is None:
        raise DataError(f"model.weights: pretrained weights of {PREFIX}{cfg.architecture}.{cfg.tag} are "
                        f"not in the local Hugging Face cache: no {files[0]} (nothing is downloaded at run "
                        f"time); fill {hub_cache()} on a machine with internet with `hf download {repo_id}` "
                        "(HF_HOME or HF_HUB_CACHE pointing there) and copy it here")
    return CachedWeights(repo_id, snapshot, found, revision or "")


def data_config(weights: CachedWeights) -> dict[str, Any]:
    """The data config the weights carry (`pretrained_cfg` of the snapshot's config.json), {} if none."""
    path = weights.snapshot / "config.json"
    try:
        cfg = json.loads(path.read_text()).get("pretrained_cfg") if path.is_file() else None
    except (OSError, ValueError) as e:
        raise DataError(f"model.weights: {path}: unreadable ({e}); fetch the weights again") from e
    return cfg if isinstance(cfg, dict) else {}


def build(name: str) -> Any:
    """timm's `create_model` for `name`'s architecture and tag, without weights (to call with num_classes
    and model.kwargs)."""
    parsed = architecture(name)
    timm = import_timm(name)
    return lambda **kwargs: timm.create_model(parsed.timm_name, pretrained=False, **kwargs)


def build_pretrained(name: str) -> Any:
    """timm's `create_model` for `name` with its cached weights loaded by timm (its per-model checkpoint
    filters; a fresh classifier where num_classes is not the weights' class count), from the file alone."""
    weights = cached_weights(name)
    timm = import_timm(name)
    return lambda **kwargs: timm.create_model(parse(name).timm_name, pretrained=True,
                                              pretrained_cfg_overlay={"file": str(weights.file)}, **kwargs)
