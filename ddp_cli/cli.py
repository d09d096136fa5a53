"""The `ddp` command line: one small function per command; errors become exit codes here.

Results go to stdout (with --json: exactly one JSON document, the last line);
progress, tables and errors go to stderr.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

try:  # typer >= 0.20 vendors its own click
    from typer._click.exceptions import NoArgsIsHelpError, UsageError
except ImportError:  # pragma: no cover - older typer on real click
    from click.exceptions import NoArgsIsHelpError, UsageError

from ddp_cli import __version__
from ddp_cli.errors import INTERNAL, SIGINT, USAGE, DdpError

app = typer.Typer(no_args_is_help=True, help="Train image classifiers data-parallel on "
                  "torch.distributed from one TOML file.", rich_markup_mode="markdown")
datasets_app = typer.Typer(no_args_is_help=True, help="Inspect the data set registry (data.toml).")
app.add_typer(datasets_app, name="datasets")
err = Console(stderr=True)
log = logging.getLogger("ddp")

RegistryOpt = Annotated[str | None, typer.Option(
    "--registry", help="data.toml to use (else $DDP_DATA_TOML, else ./data.toml).")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON document on stdout.")]


def exits(command: Callable) -> Callable:
    """Map DdpError to its exit code and one line on stderr; anything else is a bug (1)."""

    @functools.wraps(command)
    def wrapper(*args: Any, **kwargs: Any) -> None:
        try:
            command(*args, **kwargs)
        except DdpError as e:
            if str(e):
                err.print(f"[red]error:[/red] {e}", highlight=False, soft_wrap=True)
            raise typer.Exit(e.exit_code) from None
        except (typer.Exit, typer.Abort, KeyboardInterrupt):
            raise
        except Exception as e:
            if os.environ.get("DDP_DEBUG") == "1":
                raise
            err.print(f"[red]internal error (a bug; DDP_DEBUG=1 shows the traceback):[/red] "
                      f"{type(e).__name__}: {e}", highlight=False, soft_wrap=True)
            raise typer.Exit(INTERNAL) from None

    return wrapper


def emit(result: Any, as_json: bool, human: Callable[[], None]) -> None:
    if as_json:
        sys.stdout.write(json.dumps(result) + "\n")
    else:
        human()


def version_callback(value: bool) -> None:
    if value:
        print(f"ddp {__version__}")
        raise typer.Exit()


@app.callback()
def root(
    version: Annotated[bool, typer.Option("--version", callback=version_callback, is_eager=True,
                                          help="Print the version and exit.")] = False,
    verbose: Annotated[bool, typer.Option("-v", "--verbose", help="Debug logging.")] = False,
) -> None:
    level = logging.DEBUG if verbose else logging.INFO
    logging.basicConfig(level=level, format="%(message)s", stream=sys.stderr)
    os.environ.setdefault("DDP_LOG_LEVEL", logging.getLevelName(level))


@app.command()
@exits
def train(
    config: Annotated[Path, typer.Argument(help="Run config (TOML), e.g. configs/demo.toml.")],
    set_: Annotated[list[str] | None, typer.Option(
        "--set", help="Override a config key: --set optim.lr=0.2 (TOML value syntax).")] = None,
    registry: RegistryOpt = None,
    run_dir: Annotated[Path | None, typer.Option(
        help="Run directory (else runs/NAME-YYYYmmdd-HHMMSS).")] = None,
    nproc_per_node: Annotated[int | None, typer.Option(min=1, help="Workers on this node.")] = None,
    nnodes: Annotated[int, typer.Option(min=1, help="Nodes in the job.")] = 1,
    node_rank: Annotated[int, typer.Option(min=0, help="This node's rank.")] = 0,
    rdzv_endpoint: Annotated[str | None, typer.Option(help="HOST:PORT of the rendezvous.")] = None,
    rdzv_id: Annotated[str | None, typer.Option(help="Job id shared by all nodes.")] = None,
    max_restarts: Annotated[int | None, typer.Option(min=0, help="Elastic restarts on failure.")] = None,
    resume: Annotated[str, typer.Option(help="auto | never | PATH to a checkpoint.")] = "auto",
    dry_run: Annotated[bool, typer.Option(help="Validate and print the plan; do not train.")] = False,
    as_json: JsonOpt = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress output.")] = False,
) -> None:
    """Train a model data-parallel on this node's workers (and other nodes').

    Examples:

    * `ddp train configs/demo.toml`
    * `ddp train configs/demo.toml --set optim.lr_per_256=0.2 --set train.epochs=4`
    * `ddp train configs/resnet34.toml --dry-run`
    * `ddp train configs/demo.toml --json --quiet | tail -1`
    * `ddp train cfg.toml --nnodes 2 --node-rank 0 --rdzv-endpoint node0:29400 --rdzv-id job1`
    """
    from ddp_cli import commands
    from ddp_cli.distributed.launch import LaunchOptions

    opts = LaunchOptions(nproc_per_node, nnodes, node_rank, rdzv_endpoint, rdzv_id, max_restarts,
                         verbose=logging.getLogger().level <= logging.DEBUG)
    if dry_run:
        result = commands.plan(config, set_ or [], registry, opts)
        emit(result, as_json, lambda: print_mapping("plan", result))
        return
    result = commands.train(config, set_ or [], registry, run_dir, opts, resume, quiet or as_json)
    if result:
        emit(result, as_json, lambda: print_train_summary(result))


@app.command()
@exits
def validate(
    checkpoint: Annotated[Path, typer.Option(help="A checkpoint from <run>/checkpoints/.")],
    config: Annotated[Path | None, typer.Option(
        help="Use this run config instead of the checkpoint's.")] = None,
    dataset: Annotated[str | None, typer.Option(help="Validate on this registry data set.")] = None,
    registry: RegistryOpt = None,
    nproc_per_node: Annotated[int, typer.Option(min=1, help="Workers on this node.")] = 1,
    batch_size: Annotated[int | None, typer.Option(min=1, help="Images per worker per batch.")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Evaluate a checkpoint on the whole validation split (each image counted once).

    Examples:

    * `ddp validate --checkpoint runs/demo-20261122-023101/checkpoints/last.pt`
    * `ddp validate --checkpoint best.pt --nproc-per-node 3 --json`
    * `ddp validate --checkpoint best.pt --dataset imagenet_s3 --registry data.toml`
    """
    from ddp_cli import commands
    from ddp_cli.distributed.launch import LaunchOptions

    result = commands.validate(checkpoint, config, dataset, registry, LaunchOptions(nproc_per_node),
                               batch_size, as_json)
    emit(result, as_json, lambda: print_mapping("validation", result))


@datasets_app.command("list")
@exits
def datasets_list(registry: RegistryOpt = None, as_json: JsonOpt = False) -> None:
    """List the data sets in the registry.

    Examples:

    * `ddp datasets list`
    * `ddp datasets list --registry /shared/data.toml --json`
    """
    from ddp_cli import commands

    rows = commands.datasets_list(registry)

    def human() -> None:
        table = Table("name", "driver", "layout", "path", "description")
        for row in rows:
            table.add_row(row["name"], row["driver"], row["layout"], row["path"], row["description"])
        Console().print(table)

    emit(rows, as_json, human)


@app.command()
@exits
def report(
    run_dir: Annotated[Path, typer.Argument(help="A run directory made by `ddp train`.")],
    out: Annotated[Path | None, typer.Option(help="PNG to write (default RUN_DIR/report.png).")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Plot a run's loss, accuracy, LR and images/s, and summarise it (works mid-run).

    Examples:

    * `ddp report runs/demo-20261122-023101`
    * `ddp report runs/demo-20261122-023101 --out curves.png --json`
    """
    from ddp_cli.observe.report import plot, summarize

    summary = summarize(run_dir)
    summary["plot"] = str(plot(run_dir, out or run_dir / "report.png"))
    emit(summary, as_json, lambda: print_mapping("report", summary))


def print_mapping(title: str, result: dict[str, Any]) -> None:
    table = Table(title=title, title_justify="left", show_header=False)
    for key, value in result.items():
        table.add_row(key, json.dumps(value) if isinstance(value, dict) else _fmt(value))
    Console().print(table)


def print_train_summary(result: dict[str, Any]) -> None:
    final = result["final"]
    Console().print(
        f"[bold green]done[/] top-1 {final['top1']:.4f}  top-5 {final['top5']:.4f}  "
        f"loss {final['loss']:.4f} on {final['images']} val images  "
        f"({result['images_per_second']:.0f} img/s)\n"
        f"run:        {result['run_dir']}\ncheckpoint: {result['checkpoint']}",
        highlight=False,
    )


def _fmt(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def main() -> None:
    """Run the CLI; a usage mistake (bad flag or value) is one line and exit 2, like any other."""
    try:
        code = app(standalone_mode=False)
    except NoArgsIsHelpError as e:
        text = e.ctx.get_help()  # typer's rich help prints itself and returns ""
        if text:
            print(text)
        code = 0
    except UsageError as e:
        command = e.ctx.command_path if e.ctx else "ddp"
        err.print(f"[red]error:[/red] {e.format_message()} (see `{command} --help`)",
                  highlight=False, soft_wrap=True)
        code = USAGE
    except (typer.Abort, KeyboardInterrupt):
        code = SIGINT
    sys.exit(code or 0)
