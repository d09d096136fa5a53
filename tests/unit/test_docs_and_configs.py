"""The shipped configs (configs/ and the benchmarks') validate, and README opens with the two commands."""

from __future__ import annotations

import pytest
from conftest import REPO

from ddp_cli.config import load_config
from ddp_cli.models import known_models
from ddp_cli.sweep.space import load_space

SPACES = sorted((REPO / "configs").rglob("*-space.toml"))  # a sweep's space beside its config


@pytest.mark.parametrize("path", [*sorted(set((REPO / "configs").rglob("*.toml")) - set(SPACES)),
                                  *sorted((REPO / "benchmarks").glob("*.toml"))], ids=lambda p: p.name)
def test_shipped_config_is_valid(path):
    cfg = load_config(path)
    assert cfg.model.name in known_models()


@pytest.mark.parametrize("path", SPACES, ids=lambda p: p.name)
def test_shipped_space_is_valid_for_its_config(path):
    assert load_space(path, load_config(path.with_name(path.name.replace("-space", "")))).params


def test_readme_starts_with_the_two_commands():
    text = (REPO / "README.md").read_text()
    quick = text.split("## Quick start", 1)[1].split("##", 1)[0]
    assert "make train" in quick and "make test" in quick


def test_readme_is_a_landing_page():
    """README stays short; the rest is in docs/ (tests/unit/test_docs_commands.py checks the site)."""
    text = (REPO / "README.md").read_text()
    assert len(text.splitlines()) <= 250
    assert "docs/getting-started.md" in text and "docs/reference/scripting.md" in text
