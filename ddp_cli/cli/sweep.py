"""`ddp sweep ...`: the hyperparameter search's door, mounted on `ddp` by ddp_cli/cli/ddp.py.

`ddp sweep CONFIG --space SPACE.toml ...` is `ddp sweep run ...` (the group's default command);
`ddp sweep report` draws what a study found. The search itself is ddp_cli/sweep/.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from ddp_cli.cli import render
from ddp_cli.cli.clikit import DdpGroup, JsonOpt, RegistryOpt, command
from ddp_cli.cli.exits import emit
from ddp_cli.errors import ConfigError


class SweepGroup(DdpGroup):
    """`ddp sweep CONFIG ...` runs `ddp sweep run CONFIG ...`: a first word that names no command of
    the group is the config of a search."""

    default = "run"

    def parse_args(self, ctx: typer.Context, args: list[str]) -> list[str]:
        if args and args[0] not in self.commands and args[0] not in ("--help", "-h"):
            args = [self.default, *args]
        return super().parse_args(ctx, args)


sweep_app = typer.Typer(cls=SweepGroup, no_args_is_help=True, help=(
    "Hyperparameter search on Optuna, each trial a `ddp train` run: `ddp sweep CONFIG --space "
    "SPACE.toml` (= `ddp sweep run ...`), and `ddp sweep report`."))

StudyOpt = Annotated[str | None, typer.Option(metavar="NAME", help="Study name (an existing one resumes).")]
StorageOpt = Annotated[str | None, typer.Option(
    metavar="URL", help="Optuna storage URL, e.g. postgresql://user:pw@host/db (default: SQLite in the "
    "sweep dir).")]


@command(sweep_app, "run")
def run(
    config: Annotated[Path, typer.Argument(
        metavar="CONFIG", help="Run config (TOML) every trial starts from.")],
    space: Annotated[Path, typer.Option(metavar="SPACE.toml", help="The keys to search and their ranges.")],
    trials: Annotated[int, typer.Option(min=1, metavar="N", help="Finished trials the study should hold.")]
    = 20,
    timeout: Annotated[float | None, typer.Option(
        min=1, metavar="S", help="Start no trial after S seconds (the one running finishes).")] = None,
    study: StudyOpt = None,
    storage: StorageOpt = None,
    sweep_dir: Annotated[Path | None, typer.Option(
        metavar="DIR", help="The sweep's folder (default runs/sweep-NAME-YYYYmmdd-HHMMSS); an existing one "
        "resumes its study.")] = None,
    set_: Annotated[list[str] | None, typer.Option(
        "--set", metavar="KEY=VALUE", help="Override a config key in every trial.")] = None,
    registry: RegistryOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Search hyperparameters: each trial `ddp train` with the space's values, pruned at epoch ends.

    Examples:

    * `ddp sweep configs/demo.toml --space configs/demo-space.toml --trials 12`
    * `ddp sweep configs/demo.toml --space space.toml --study lr --sweep-dir runs/sweep-lr`
    * `ddp sweep cfg.toml --space space.toml --study big --storage postgresql://ddp:pw@db/optuna`
    """
    from ddp_cli.sweep.study import SweepOptions, sweep

    opts = SweepOptions(config, space, trials, timeout, study, storage, sweep_dir, set_ or [], registry)
    result = sweep(opts, render.print_sweep_trial)
    emit(result, as_json, lambda: render.print_sweep(result))


@command(sweep_app, "report")
def report(
    sweep_dir: Annotated[Path | None, typer.Argument(
        metavar="[DIR]", help="A sweep dir (else --study and --storage).", show_default=False)] = None,
    study: StudyOpt = None,
    storage: StorageOpt = None,
    out: Annotated[Path | None, typer.Option(
        metavar="DIR", help="Where the best config and the PNGs go (default: the sweep dir, else "
        "./sweep-report-NAME).")] = None,
    as_json: JsonOpt = False,
) -> None:
    """A study's trials as a table, its best config (best.toml) and its plots (PNG).

    Examples:

    * `ddp sweep report runs/sweep-demo-20261127-160000`
    * `ddp sweep report --study big --storage postgresql://ddp:pw@db/optuna --out big-report --json`
    """
    result = study_report(sweep_dir, study, storage, out)
    emit(result, as_json, lambda: render.print_sweep_report(result))


def study_report(sweep_dir: Path | None, study: str | None, storage: str | None,
                 out: Path | None) -> dict[str, Any]:
    import json

    from ddp_cli.sweep.report import report as write_report
    from ddp_cli.sweep.storage import masked, open_storage
    from ddp_cli.sweep.study import SWEEP_FILE

    if sweep_dir is not None:
        saved_file = sweep_dir / SWEEP_FILE
        if not saved_file.is_file():
            raise ConfigError(f"{sweep_dir}: no {SWEEP_FILE}; give a folder made by `ddp sweep`, or --study "
                              "and --storage")
        saved = json.loads(saved_file.read_text())
        study = study or saved["study"]
        storage = storage or (saved["storage"] if "***" not in saved["storage"] else None)
        if storage is None:
            raise ConfigError(f"{sweep_dir}: its study is in {saved['storage']}; give --storage URL")
    elif not (study and storage):
        raise ConfigError("ddp sweep report: give a sweep dir, or --study NAME and --storage URL")
    import optuna

    try:
        loaded = optuna.load_study(study_name=study, storage=open_storage(storage, heartbeat=False))
    except KeyError:
        raise ConfigError(f"--study {study}: no such study in {masked(storage)}") from None
    return write_report(loaded, masked(storage), out or sweep_dir or Path(f"sweep-report-{study}"))
