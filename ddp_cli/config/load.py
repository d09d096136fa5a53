"""Reading a run config: the TOML file, `--set` overrides, validation; and what names a key."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from ddp_cli.config.errors import section_type
from ddp_cli.config.run import RunConfig, config_from_dict
from ddp_cli.errors import ConfigError, did_you_mean
from ddp_cli.userfiles import parse_toml, read_text


def load_config(path: str | Path, overrides: list[str] = ()) -> RunConfig:
    """Read a TOML run config, apply `--set key=value` overrides, validate. Keys left unset stay unset
    until the run's facts are known (`config.resolve`)."""
    path = Path(path)
    raw = parse_toml(read_text(path, ConfigError), str(path), ConfigError)
    for item in overrides:
        apply_override(raw, item)
    return config_from_dict(raw, source=str(path))


def unknown_key(dotted: str) -> str | None:
    """Why `dotted` (`optim.lr_per_256`) names no key of the run config, with a did-you-mean; None
    for a key. A section (`optim`) is not a key."""
    model: type[BaseModel] | None = RunConfig
    parts = dotted.split(".")
    for depth, part in enumerate(parts):
        known = list(model.model_fields) if model else []
        if part not in known:
            where = ".".join(parts[:depth]) or "the run config"
            return f"{dotted}: unknown key: {where} has no {part!r}{did_you_mean(part, known)}"
        model = section_type(model.model_fields[part].annotation)
    if model is not None:
        keys = ", ".join(list(model.model_fields)[:6])
        return f"{dotted}: a section, not a key; name one of its keys ({keys})"
    return None


def apply_override(raw: dict[str, Any], item: str) -> None:
    """`a.b=v`: v in TOML value syntax, or a bare string when it is not TOML."""
    key, sep, value = item.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"--set {item!r}: expected KEY=VALUE, e.g. --set optim.lr=0.2")
    try:
        parsed = tomllib.loads(f"v = {value}")["v"]
    except tomllib.TOMLDecodeError:
        parsed = value
    *parents, leaf = key.strip().split(".")
    node = raw
    for part in parents:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"--set {item!r}: {part!r} is a value, not a section")
    node[leaf] = parsed


