"""What a run trained with where its saved config predates a key: keys added since (within checkpoint
format 3) whose default now would train differently from what the run did. `train.checkpoint.migrate`
gives an old checkpoint's config these values, and `config.resolve.resume` keeps them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def _ramp_top(section: dict[str, Any]) -> int | None:
    """Progressive resizing rose to image_size (none: the run had no ramp)."""
    return section.get("image_size") if section.get("min_image_size") is not None else None


# "section.key": the value every run from before the key trained with, or a function of the saved
# section that gives it (None: the key stays unset)
TRAINED_BEFORE: dict[str, Any | Callable[[dict[str, Any]], Any]] = {
    "train.ema_bn_epochs": 0,  # the EMA's BatchNorm statistics were never recomputed
    "data.ramp_step": 32,  # progressive resizing grew its crops in 32 px steps
    "data.end_image_size": _ramp_top,  # ... up to image_size
}


def as_trained(raw: dict[str, Any]) -> dict[str, Any]:
    """`raw` (a saved config's dict) with each key it lacks set to what the run trained with."""
    out = dict(raw)
    for dotted, rule in TRAINED_BEFORE.items():
        section, key = dotted.split(".")
        saved = out.get(section, {})
        value = rule(saved) if callable(rule) else rule
        if key not in saved and value is not None:
            out[section] = {**saved, key: value}
    return out
