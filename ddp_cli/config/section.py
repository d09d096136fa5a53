"""The base of every config section: unknown keys refused, values frozen."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    """A config section: unknown keys refused, and frozen. A run's config is resolved once
    (`config.resolve`); nothing edits it afterwards."""

    model_config = ConfigDict(extra="forbid", frozen=True)
