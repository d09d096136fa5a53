"""What a run trained with where its saved config predates a key: keys added since (within checkpoint
format 3) whose default now would train differently from what the run did. `train.checkpoint.migrate`
gives an old checkpoint's config these values, and `config.resolve.resume` keeps them."""

from __future__ import annotations

from typing import Any

# "section.key": the value every run from before the key trained with
TRAINED_BEFORE = {
    "train.ema_bn_epochs": 0,  # the EMA's BatchNorm statistics were never recomputed
    "data.ramp_step": 32,  # progressive resizing grew its crops in 32 px steps
}


def as_trained(raw: dict[str, Any]) -> dict[str, Any]:
    """`raw` (a saved config's dict) with each key it lacks set to what the run trained with."""
    out = dict(raw)
    for dotted, value in TRAINED_BEFORE.items():
        section, key = dotted.split(".")
        if key not in out.get(section, {}):
            out[section] = {**out.get(section, {}), key: value}
    return out
