"""`ddp config show | schema`: the run config's sub-app, mounted on `ddp` by ddp_cli/cli/ddp.py; what
each command does is ddp_cli/cli/commands/run_config.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from ddp_cli.cli.clikit import SetOpt, command, group, lazy_module
from ddp_cli.cli.exits import stdout_may_close

if TYPE_CHECKING:
    from ddp_cli.cli.commands import run_config
else:  # on first use: see cli/ddp.py
    run_config = lazy_module("ddp_cli.cli.commands.run_config")

config_app = group("The run config: resolved, or its JSON schema.")


@command(config_app, "show")
def config_show(
    config: Annotated[Path, typer.Argument(metavar="CONFIG", help="Run config (TOML).")],
    set_: SetOpt = None,
    fmt: Annotated[str, typer.Option(
        "--format", metavar="toml|json", help="toml (commented, every default) | json (one line).")] = "toml",
) -> None:
    """The resolved run config, every default written out (unset keys commented); reads no data.

    Its TOML, saved to a file, trains the same run as CONFIG with those --set.

    Examples:

    * `ddp config show configs/resnet34.toml`
    * `ddp config show configs/demo.toml --set train.epochs=2 > two-epochs.toml`
    * `ddp config show configs/demo.toml --format json | jq .optim`
    """
    text = run_config.config_show(config, set_ or [], fmt)
    with stdout_may_close():
        print(text)


@command(config_app, "schema")
def config_schema() -> None:
    """The run config's JSON schema (for editors: completion, and unknown keys flagged as you type).

    Examples:

    * `ddp config schema > ddp-config.schema.json`
    """
    with stdout_may_close():
        print(json.dumps(run_config.config_schema(), indent=2))
