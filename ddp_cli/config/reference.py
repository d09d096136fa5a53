"""The config reference of the docs site, from the sections themselves: every key with its type,
default and description. Not config validation: not mutation-tested."""

from __future__ import annotations

import json
import types
import typing
from typing import Annotated, Any, Literal

import tomli_w
from pydantic import BaseModel

from ddp_cli.config.errors import section_type
from ddp_cli.config.run import RunConfig


# pragma: no mutate start
def reference_markdown() -> str:
    """The config reference of the docs site (docs/hooks.py builds it into a page): per section, a
    table of its keys with their type, default and description, from the models themselves."""
    sections: dict[str, list[str]] = {}

    def rows(model: type[BaseModel], prefix: str) -> None:
        for name, field in model.model_fields.items():
            section = section_type(field.annotation)
            if section is not None:
                rows(section, f"{prefix}{name}.")
                continue
            default = field.get_default(call_default_factory=True)
            shown = ("required" if field.is_required() else "unset" if default is None
                     else json.dumps(default) if isinstance(default, list | dict)  # inline, as TOML allows
                     else tomli_w.dumps({"v": default})[4:].strip())
            meaning = (field.description or "").replace("|", "\\|")
            sections.setdefault(prefix.rstrip("."), []).append(
                f"| `{prefix}{name}` | {_type_name(field.annotation)} | `{shown}` | {meaning} |")

    rows(RunConfig, "")
    out = []
    for section, lines in sections.items():
        out += [f"## `[{section}]`" if section else "## Top level", "",
                "| key | type | default | meaning |", "| --- | --- | --- | --- |", *lines, ""]
    return "\n".join(out).strip()


def _type_name(annotation: Any) -> str:
    """A field's type as a reader writes it: `int`, `list of str`, `"sgd" \\| "adamw"`, `int \\| "auto"`."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is Annotated:
        return _type_name(args[0])
    if origin is Literal:
        return " \\| ".join(f'`"{value}"`' if isinstance(value, str) else f"`{value}`" for value in args)
    if origin in (typing.Union, types.UnionType):
        return " \\| ".join(_type_name(arg) for arg in args if arg is not type(None))
    if origin is list:
        return f"list of {_type_name(args[0])}"
    if origin is dict:
        return "table"
    return getattr(annotation, "__name__", str(annotation))
# pragma: no mutate end
