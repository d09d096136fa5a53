"""Pydantic's validation errors as one line a user can act on: `section.key: message`, with a
did-you-mean for an unknown key."""

from __future__ import annotations

import typing
from typing import Any

from pydantic import BaseModel, ValidationError

from ddp_cli.errors import did_you_mean


def describe_validation_error(err: ValidationError, model: type[BaseModel]) -> str:
    """First error as `section.key: message`, with a did-you-mean for unknown keys."""
    first = err.errors()[0]
    loc = _field_path(model, [str(p) for p in first["loc"]])
    key = ".".join(loc)
    if first["type"] == "extra_forbidden":
        owner = _model_at(model, loc[:-1])
        hint = did_you_mean(loc[-1], list(owner.model_fields)) if owner else ""
        message = f"{key}: unknown key{hint}"
    else:
        text = first["msg"].removeprefix("Value error, ")  # our validators' own words, as written
        message = f"{key}: {text}" if key else text
    more = len(err.errors()) - 1
    return message + (f" (and {more} more problem{'s' * (more > 1)})" if more else "")


def _field_path(model: type[BaseModel], loc: list[str]) -> list[str]:
    """The part of a pydantic error location that names keys (drops union tags)."""
    path: list[str] = []
    for part in loc:
        if _model_at(model, path) is None:
            break
        path.append(part)
    return path


def _model_at(model: type[BaseModel], path: list[str]) -> type[BaseModel] | None:
    for part in path:
        field = model.model_fields.get(part)
        model = section_type(field.annotation) if field else None
        if model is None:
            return None
    return model


def section_type(annotation: Any) -> type[BaseModel] | None:
    """The section model behind `Section` or `Section | None`, else None."""
    for candidate in (annotation, *typing.get_args(annotation)):
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None


