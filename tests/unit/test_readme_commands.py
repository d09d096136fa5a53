"""Every command is in README's list and takes -v after its name; the migration tables (docs/migrating.md)
name real keys."""

from __future__ import annotations

import re

import typer
from conftest import REPO

from ddp_cli.cli import app
from ddp_cli.config import RunConfig

README = (REPO / "README.md").read_text()
SECTIONS = "|".join(name for name in RunConfig.model_fields if name not in ("name", "seed", "deterministic"))


def section(title: str) -> str:
    return README.split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]


def leaf_commands(group, path=()):
    """(`datasets check`, its click command) for every command under `group`; a group's default command
    as the group's name (`sweep`, for `ddp sweep CONFIG` = `ddp sweep run CONFIG`)."""
    for name, command in group.commands.items():
        if hasattr(command, "commands"):
            yield from leaf_commands(command, (*path, name))
        else:
            yield " ".join(path if name == getattr(group, "default", None) else (*path, name)), command


COMMANDS = dict(leaf_commands(typer.main.get_command(app)))


def test_readme_lists_every_command():
    listing = section("Commands").split("```", 2)[1]
    assert {"train", "report", "env", "config show", "config schema", "init"} <= COMMANDS.keys()
    missing = [name for name in COMMANDS if not re.search(rf"^ddp {name}\b", listing, re.MULTILINE)]
    assert missing == []


def test_every_command_takes_verbose_after_its_name():
    for name, command in COMMANDS.items():
        assert any({"-v", "--verbose"} <= set(param.opts) for param in command.params), name


def test_the_migration_tables_name_only_real_config_keys():
    text = (REPO / "docs" / "migrating.md").read_text()
    keys = {key for key in re.findall(rf"`((?:{SECTIONS})\.[a-z_0-9]+)", text)
            if not key.endswith((".py", ".toml"))}  # files: timm's train.py, the registry's data.toml
    assert len(keys) > 30
    for key in sorted(keys):
        model = RunConfig
        *parents, leaf = key.split(".")
        for part in parents:
            model = model.model_fields[part].annotation
        assert leaf in model.model_fields, key
    assert "`seed = 42`" in text and "`deterministic = true`" in text
