"""The shipped configs validate, and README's config reference matches the code."""

from __future__ import annotations

import pytest
from conftest import REPO

from ddp_cli.config import REFERENCE_END, REFERENCE_START, load_config, reference_markdown
from ddp_cli.models import known_models


@pytest.mark.parametrize("path", sorted((REPO / "configs").glob("*.toml")), ids=lambda p: p.name)
def test_shipped_config_is_valid(path):
    cfg = load_config(path)
    assert cfg.model.name in known_models()


def test_readme_config_reference_is_current():
    text = (REPO / "README.md").read_text()
    generated = text.split(REFERENCE_START, 1)[1].split(REFERENCE_END, 1)[0].strip()
    assert generated == reference_markdown(), "README config reference is stale: run `make docs`"


def test_readme_starts_with_the_two_commands():
    text = (REPO / "README.md").read_text()
    quick = text.split("## Quick start", 1)[1].split("##", 1)[0]
    assert "make train" in quick and "make test" in quick
