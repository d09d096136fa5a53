"""`ddp config show | schema` and `ddp init`: the run config resolved, its JSON schema, and a starter
run config (with its data.toml) written; none of them reads data.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ddp_cli.cli.config_view import render, schema
from ddp_cli.cli.starter import write_starter
from ddp_cli.config import load_config
from ddp_cli.errors import ConfigError
from ddp_cli.models.user_model import with_located_model


def init(folder: Path) -> dict[str, Any]:
    """`ddp init`: the starter run config and data.toml written into `folder`."""
    return write_starter(folder)


def config_show(config: Path, overrides: list[str], fmt: str) -> str:
    """The resolved run config as TOML (every default, unset keys commented) or one JSON line."""
    if fmt not in ("toml", "json"):
        raise ConfigError(f"--format {fmt}: use toml or json")
    source = " ".join([str(config), *(f"--set {item}" for item in overrides)])
    return render(with_located_model(load_config(config, overrides), config), fmt, source)


def config_schema() -> dict[str, Any]:
    """The run config's JSON schema."""
    return schema()
