"""`ddp init DIR` (ddp_cli.cli.starter): the shipped starter files (a wheel user's run:
tests/e2e/test_wheel.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import REPO

from ddp_cli.cli.starter import template, write_starter
from ddp_cli.config import load_config
from ddp_cli.data.registry import load_registry
from ddp_cli.errors import USAGE, ConfigError


def test_the_shipped_templates_are_the_checkouts_demo_config_and_registry():
    assert template("demo.toml") == (REPO / "configs/demo.toml").read_text()
    assert template("data.toml") == (REPO / "data.toml").read_text()


def test_init_writes_a_config_and_a_registry_whose_demo_lives_under_dir(tmp_path):
    result = write_starter(tmp_path / "new" / "starter")
    folder = tmp_path / "new" / "starter"
    assert result == {"dir": str(folder), "files": [str(folder / "demo.toml"), str(folder / "data.toml")]}
    assert load_config(folder / "demo.toml").data.dataset == "demo"
    demo = load_registry(folder / "data.toml").get("demo")
    assert Path(demo.storage.path) == folder / ".data" / "demo" and demo.generator == "sklearn-digits"


def test_init_never_overwrites_and_writes_nothing_when_it_refuses(tmp_path):
    (tmp_path / "data.toml").write_text("mine")
    with pytest.raises(ConfigError) as err:
        write_starter(tmp_path)
    assert err.value.exit_code == USAGE
    assert str(err.value).startswith(f"{tmp_path / 'data.toml'}: already exists")
    assert (tmp_path / "data.toml").read_text() == "mine" and not (tmp_path / "demo.toml").exists()


def test_init_into_a_path_that_is_a_file_is_refused(tmp_path):
    (tmp_path / "taken").write_text("")
    with pytest.raises(ConfigError, match="taken: already exists"):
        write_starter(tmp_path / "taken")
