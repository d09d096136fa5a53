"""`ddp init DIR` (ddp_cli.cli.starter): the shipped starter files (a wheel user's run:
tests/e2e/test_wheel.py)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from conftest import REPO

from ddp_cli.cli.starter import TEMPLATES, template, write_starter
from ddp_cli.config import load_config
from ddp_cli.data.registry import load_registry
from ddp_cli.errors import USAGE, ConfigError


def test_the_shipped_templates_are_the_checkouts_demo_config_and_registry():
    """But for the command the config names: `ddp train demo.toml` where init put it."""
    assert template("demo.toml") == (REPO / "configs/demo.toml").read_text().replace("configs/demo.toml",
                                                                                   "demo.toml")
    assert template("data.toml") == (REPO / "data.toml").read_text()


# A relative path or a file name in a template's text (not a URL, an absolute path, a key or a number)
NAMED = re.compile(r"(?<![\w/:.-])(?:\.?[\w-]+(?:/[\w.-]+)+|[\w-]+\.(?:md|toml|py|json|csv|txt|sh|yaml))"
                   r"(?![\w/])")
UNITS = {"steps/s", "images/s"}


def test_every_file_the_init_files_name_is_in_the_init_folder(tmp_path):
    """A new folder has no configs/, docs/ or BENCHMARKS.md: what its files point at must be there
    (the demo's data is built there on first use: the registry's own test above)."""
    write_starter(tmp_path)
    demo_data = load_registry(tmp_path / "data.toml").get("demo").storage.path
    for name in TEMPLATES:
        named = set(NAMED.findall((tmp_path / name).read_text())) - UNITS
        assert named, f"{name}: the pattern finds nothing: the test would pass on anything"
        missing = [n for n in named if not (tmp_path / n).exists() and tmp_path / n != Path(demo_data)]
        assert missing == [], f"{name} names what ddp init does not write: {missing}"


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
