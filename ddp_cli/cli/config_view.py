"""`ddp config show | schema`: the run config as a person reads it, and its JSON schema.

The TOML is the whole config as given, every default written out and each unset key as a
comment (TOML has no null); the keys ddp derives when a run starts (`config.resolve`: the
progressive ramp, the val resize, best.pt's metric, the smoothing, the semi statistics' momentum) are
commented as such, so a file saved from it derives them again for its own epochs, sizes and method,
and feeding it back to `load_config` gives the same
config. Nothing here touches the data or the registry.
"""

from __future__ import annotations

import json
from typing import Any

import tomli_w
from pydantic import BaseModel

from ddp_cli.config import RunConfig
from ddp_cli.config.resolve import DERIVED_KEYS

# left unset here, filled by the run's resolve pass
DERIVED = {*DERIVED_KEYS, "data.min_image_size", "data.end_image_size", "semi.stats_momentum"}
SCHEMA_DIALECT = "https://json-schema.org/draft/2020-12/schema"


def render(cfg: RunConfig, fmt: str, source: str = "") -> str:
    """`fmt` "toml" (commented, for people) or "json" (one line: every key, unset ones null)."""
    if fmt == "json":
        return json.dumps(cfg.model_dump(mode="json"))
    header = [f"# {source}: every default written out, unset keys commented; the keys marked \"derived\" are "
              "set when the run starts (ddp train --dry-run shows them)"] if source else []
    return "\n".join([*header, *toml_lines(cfg, [])])


def toml_lines(section: BaseModel, path: list[str]) -> list[str]:
    """A section's own keys (unset ones as `# key = unset`), then its sub-sections as tables."""
    lines = [f"[{'.'.join(path)}]"] if path else []
    subsections = []
    for name in type(section).model_fields:
        value = getattr(section, name)
        if isinstance(value, BaseModel):
            subsections.append((name, value))
        elif value is None and ".".join([*path, name]) in DERIVED:
            lines.append(f"# {name} = derived when the run starts")
        elif value is None:
            lines.append(f"# {name} = unset")
        else:
            lines.append(f"{name} = {toml_value(value)}")
    for name, value in subsections:
        lines += ["", *toml_lines(value, [*path, name])]
    return lines


def toml_value(value: Any) -> str:
    """One TOML value; arrays and tables inline (`[0.9, 0.999]`, `{dropout = 0.2}`), as the config
    files write them."""
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(item) for item in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{tomli_w.dumps({k: 0}).split(' = ')[0]} = {toml_value(v)}"
                               for k, v in value.items()) + "}"
    return tomli_w.dumps({"v": value})[len("v = "):].strip()


def schema() -> dict[str, Any]:
    """RunConfig's JSON schema (pydantic's), for editors: unknown keys are refused there too."""
    return {"$schema": SCHEMA_DIALECT, **RunConfig.model_json_schema()}
