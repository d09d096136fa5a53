"""The `ddp` command line: one small function per command, which parses its flags, calls
`commands` and draws the result (`render`); errors become exit codes (`exits`).

Results go to stdout (with --json: exactly one JSON document, the last line, and on failure that
document is the error); progress, tables and errors go to stderr. The sub-apps are mounted from their
own modules: `ddp datasets` (cli/datasets.py), `ddp config` (cli/config.py), `ddp sweep` (cli/sweep.py)
and `ddp bench`, from its door, cli/bench.py (its measurements, ddp_cli/bench/, are a tool beside the
product).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

try:  # typer >= 0.20 vendors its own click
    from typer._click.exceptions import NoArgsIsHelpError, UsageError
except ImportError:  # pragma: no cover - older typer on real click
    from click.exceptions import NoArgsIsHelpError, UsageError

from ddp_cli import __version__
from ddp_cli.cli import render
from ddp_cli.cli.bench import bench_app
from ddp_cli.cli.clikit import (
    JsonOpt,
    RegistryOpt,
    SetOpt,
    VerboseOpt,
    command,
    configure_logging,
    group,
    lazy_module,
    one_of,
)
from ddp_cli.cli.config import config_app
from ddp_cli.cli.datasets import datasets_app
from ddp_cli.cli.exits import SIGPIPE, emit, report_error, stdout_is_devnull
from ddp_cli.cli.sweep import sweep_app
from ddp_cli.errors import SIGINT, USAGE, ConfigError, DataError
from ddp_cli.fastexit import run_and_exit

if TYPE_CHECKING:
    from ddp_cli.cli.commands import checkpoints, machine, reports, run_config, run_dirs, training
else:  # the commands load pydantic and numpy (and torch, in the commands that train): on first use,
    training = lazy_module("ddp_cli.cli.commands.training")  # so `ddp --help` and `ddp --version` start
    run_dirs = lazy_module("ddp_cli.cli.commands.run_dirs")  # at once
    checkpoints = lazy_module("ddp_cli.cli.commands.checkpoints")
    reports = lazy_module("ddp_cli.cli.commands.reports")
    machine = lazy_module("ddp_cli.cli.commands.machine")
    run_config = lazy_module("ddp_cli.cli.commands.run_config")

app = group("Train image classifiers data-parallel on torch.distributed from one TOML file.",
            rich_markup_mode="markdown")
app.add_typer(datasets_app, name="datasets")
app.add_typer(bench_app, name="bench")
app.add_typer(sweep_app, name="sweep")
app.add_typer(config_app, name="config")

CheckpointOpt = Annotated[Path, typer.Option(
    metavar="PATH", help="A checkpoint, e.g. RUN_DIR/checkpoints/best.pt.")]
NprocOpt = Annotated[int, typer.Option("--nproc-per-node", min=1, metavar="N", help="Workers on this node.")]
BatchOpt = Annotated[int | None, typer.Option(min=1, metavar="B", help="Images per worker per batch.")]
PRECISIONS = ("auto", "fp32", "bf16", "fp16")
PrecisionOpt = Annotated[str | None, typer.Option(
    metavar="PRECISION", help="auto, fp32, bf16 or fp16 on this machine (default: the checkpoint's where "
    "this machine computes it natively, else auto).")]
WeightsOpt = Annotated[str, typer.Option(
    "--weights", metavar="auto|model|ema",
    help="The checkpoint's trained weights (model) or their moving average (ema); auto = those the run "
    "judged its best by (checkpoint.best_metric: the EMA's where it had one).")]
WEIGHTS = ("auto", "model", "ema")


def version_callback(value: bool) -> None:
    if value:
        print(f"ddp {__version__}")
        raise typer.Exit()


@app.callback()
def root(
    version: Annotated[bool, typer.Option("--version", callback=version_callback, is_eager=True,
                                          help="Print the version and exit.")] = False,
    verbose: VerboseOpt = False,
) -> None:
    configure_logging(verbose)


@command(app)
def train(
    config: Annotated[Path, typer.Argument(
        metavar="CONFIG", help="Run config (TOML), e.g. configs/demo.toml.")],
    set_: SetOpt = None,
    registry: RegistryOpt = None,
    run_dir: Annotated[Path | None, typer.Option(
        metavar="DIR", help="Run directory, or s3://BUCKET/PREFIX/NAME (else runs/NAME-YYYYmmdd-HHMMSS).")]
    = None,
    nproc_per_node: Annotated[int | None, typer.Option(
        "--nproc-per-node", min=1, metavar="N", help="Workers on this node.")] = None,
    nnodes: Annotated[str, typer.Option(
        metavar="N|MIN:MAX", help="Nodes in the job: N, or MIN:MAX to go on with fewer after a node is "
        "lost.")] = "1",
    node_rank: Annotated[int, typer.Option(min=0, metavar="R", help="This node's rank.")] = 0,
    rdzv_endpoint: Annotated[str | None, typer.Option(
        metavar="HOST:PORT", help="Where the rendezvous is (the same on every node).")] = None,
    rdzv_id: Annotated[str | None, typer.Option(metavar="ID", help="Job id shared by all nodes.")] = None,
    max_restarts: Annotated[int | None, typer.Option(
        min=0, metavar="K", help="Elastic restarts on failure.")] = None,
    standalone: Annotated[bool, typer.Option(
        "--standalone", help="torchrun's spelling of one node with a local rendezvous (the default; "
        "SLURM's node settings are then ignored).")] = False,
    master_addr: Annotated[str | None, typer.Option(
        metavar="HOST", help="torchrun's spelling: with --master-port, the same as "
        "--rdzv-endpoint HOST:PORT.")] = None,
    master_port: Annotated[int | None, typer.Option(
        min=1, max=65535, metavar="PORT", help="See --master-addr.")] = None,
    resume: Annotated[str, typer.Option(
        metavar="auto|never|PATH", help="auto | never | PATH to a checkpoint.")] = "auto",
    dry_run: Annotated[bool, typer.Option(help="Validate and print the plan; do not train.")] = False,
    as_json: JsonOpt = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress output.")] = False,
) -> None:
    """Train a model data-parallel on this node's workers (and other nodes').

    torchrun's spellings (--nproc_per_node, --node_rank, --rdzv_endpoint, --rdzv_id, --max_restarts,
    --master_addr, --master_port) are accepted too.

    Examples:

    * `ddp train configs/demo.toml`
    * `ddp train configs/demo.toml --set optim.lr_per_256=0.2 --set train.epochs=4`
    * `ddp train configs/resnet34.toml --dry-run`
    * `ddp train configs/demo.toml --json --quiet | tail -1`
    * `ddp train cfg.toml --nnodes 2 --node-rank 0 --rdzv-endpoint node0:29400 --rdzv-id job1`
    * `ddp train cfg.toml --nnodes 1:2 --max-restarts 3 --rdzv-endpoint node0:29400 --rdzv-id job1`
    * `ddp train cfg.toml --nproc_per_node 4 --standalone`
    """
    flags = training.LaunchFlags(nproc_per_node, nnodes, node_rank, rdzv_endpoint, rdzv_id, max_restarts,
                                 standalone, master_addr, master_port)
    run_dir = run_dirs.run_location(run_dir, "--run-dir")
    if dry_run:
        plan = training.dry_run(config, set_ or [], registry, run_dir, flags, resume)
        emit(plan, as_json, lambda: render.print_mapping("plan", plan))
        return
    result = training.train(config, set_ or [], registry, run_dir, flags, resume, quiet or as_json)
    if result:
        emit(result, as_json, lambda: render.print_train_summary(result))


@command(app)
def validate(
    checkpoint: CheckpointOpt,
    config: Annotated[Path | None, typer.Option(
        metavar="CONFIG", help="Use this run config instead of the checkpoint's.")] = None,
    dataset: Annotated[str | None, typer.Option(metavar="NAME", help="Validate on this registry data set.")]
    = None,
    registry: RegistryOpt = None,
    nproc_per_node: NprocOpt = 1,
    batch_size: BatchOpt = None,
    weights: WeightsOpt = "auto",
    topk: Annotated[str, typer.Option(
        metavar="K,K,...", help="Accuracies to report, e.g. 1,5,10 (top1 and top5 always).")] = "1,5",
    per_class: Annotated[bool, typer.Option(
        "--per-class", help="Each class's accuracy and count, worst first (and per_class in JSON).")] = False,
    confusion: Annotated[Path | None, typer.Option(
        metavar="FILE", help="Write the confusion matrix here (CSV: rows true class, columns predicted).")]
    = None,
    predictions: Annotated[Path | None, typer.Option(
        metavar="FILE", help="Write every image's path, label, top-k classes and probabilities here (CSV).")]
    = None,
    tta: Annotated[str | None, typer.Option(
        metavar="flip", help="Test-time augmentation: flip (average with the mirrored image).")] = None,
    precision: PrecisionOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Evaluate a checkpoint on the whole validation split (each image counted once).

    Examples:

    * `ddp validate --checkpoint runs/demo-YYYYMMDD-HHMMSS/checkpoints/last.pt`
    * `ddp validate --checkpoint best.pt --nproc-per-node 3 --json`
    * `ddp validate --checkpoint best.pt --weights ema --topk 1,5,10 --per-class --confusion cm.csv`
    * `ddp validate --checkpoint best.pt --dataset imagenet_s3 --registry data.toml`
    """
    job = checkpoints.Job("validate", as_json, str(checkpoint), weights=one_of(weights, WEIGHTS, "--weights"),
                       topk=topk_list(topk), tta=one_of(tta, ("flip",), "--tta") == "flip" if tta else False,
                       per_class=per_class, confusion=str(confusion) if confusion else None,
                       predictions=str(predictions) if predictions else None)
    result = checkpoints.validate(job, config, dataset, registry, nproc_per_node, batch_size,
                               one_of(precision, PRECISIONS, "--precision") if precision else None)
    emit(result, as_json, lambda: render.print_validation(result))


@command(app)
def predict(
    checkpoint: CheckpointOpt,
    inputs: Annotated[list[str] | None, typer.Argument(
        metavar="INPUT", help="Image files, folders (walked for images) or s3://bucket/key URLs.",
        show_default=False)] = None,
    dataset: Annotated[str | None, typer.Option(
        metavar="NAME", help="Predict a registry data set's split instead.")] = None,
    split: Annotated[str, typer.Option(metavar="train|val", help="With --dataset: train or val.")] = "val",
    registry: RegistryOpt = None,
    topk: Annotated[int, typer.Option(min=1, metavar="K", help="Classes per image, best first.")] = 5,
    weights: WeightsOpt = "auto",
    batch_size: BatchOpt = None,
    nproc_per_node: NprocOpt = 1,
    precision: PrecisionOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object per input, one per line.")] = False,
) -> None:
    """The top-k classes of each image, with the checkpoint's own validation preprocessing.

    A bad image gets an error entry and the others are still predicted; the exit code is then 3.

    Examples:

    * `ddp predict --checkpoint best.pt photos/ cat.jpg`
    * `ddp predict --checkpoint best.pt --dataset demo --split val --topk 1 --json > preds.jsonl`
    * `ddp predict --checkpoint best.pt s3://my-bucket/new-images/ --weights ema`
    """
    job = checkpoints.Job("predict", as_json, str(checkpoint), weights=one_of(weights, WEIGHTS, "--weights"),
                       topk=[topk])
    answers = checkpoints.predict(job, inputs or [], dataset, one_of(split, ("train", "val"), "--split"),
                               registry, nproc_per_node, batch_size,
                               one_of(precision, PRECISIONS, "--precision") if precision else None)
    if as_json:
        for item in answers:
            print(json.dumps(item))
    else:
        render.print_predictions(answers)
    failed = [a for a in answers if "error" in a]
    if failed:
        raise DataError(f"{len(failed)} of {len(answers)} images could not be predicted, the first "
                        f"{failed[0]['path']}: {failed[0]['error']}")


@command(app)
def export(
    checkpoint: CheckpointOpt,
    format_: Annotated[str, typer.Option(
        "--format", metavar="FORMAT", help="state_dict | safetensors | torchscript | onnx.",
        show_default=False)],
    out: Annotated[Path, typer.Option(
        metavar="FILE", help="File to write; its model card goes beside it, FILE.card.json.")],
    weights: WeightsOpt = "auto",
    as_json: JsonOpt = False,
) -> None:
    """Write a checkpoint's weights for use without ddp, and a model card beside them (FILE.card.json).

    state_dict and safetensors load strictly into the builder the card names (torchvision's);
    torchscript and onnx (batch dimension dynamic) run without it. On the CPU, in fp32, eval mode.

    Examples:

    * `ddp export --checkpoint runs/demo-YYYYMMDD-HHMMSS/checkpoints/last.pt --format state_dict --out m.pt`
    * `ddp export --checkpoint best.pt --format onnx --weights ema --out model.onnx --json`
    * `ddp export --checkpoint best.pt --format safetensors --out model.safetensors`
    """
    result = checkpoints.export(checkpoint, format_, weights, out)
    emit(result, as_json, lambda: render.print_export(result))


@command(app)
def report(
    run_dir: Annotated[Path, typer.Argument(
        metavar="RUN_DIR", help="A run directory made by `ddp train` (or its s3://BUCKET/PREFIX/NAME).")],
    out: Annotated[Path | None, typer.Option(
        metavar="FILE.png",
        help="PNG to write (default RUN_DIR/report.png); any per-class one goes beside it, STEM-classes.png.",
    )] = None,
    html: Annotated[Path | None, typer.Option(
        metavar="FILE.html", help="Also write the whole run as one self-contained HTML page (no network).",
    )] = None,
    predictions: Annotated[Path | None, typer.Option(
        metavar="FILE.csv", help="The page's gallery of mistakes from this `ddp validate --predictions` CSV "
        "(default: the newest in RUN_DIR).")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Plot a run's loss, accuracy, LR and images/s, and summarise it (works mid-run).

    When training or `ddp validate --per-class` left an evaluation in the run dir, a second PNG
    shows its per-class top-1 and, up to 50 classes, its confusion matrix.

    Examples:

    * `ddp report runs/demo-YYYYMMDD-HHMMSS`
    * `ddp report runs/demo-YYYYMMDD-HHMMSS --out curves.png --json`
    * `ddp report s3://my-bucket/runs/demo` (report.png uploaded beside the run)
    * `ddp report runs/demo-YYYYMMDD-HHMMSS --html demo.html` (curves, classes, the images it gets wrong)
    """
    summary = reports.report(run_dir, out, html, predictions)
    emit(summary, as_json, lambda: render.print_report(summary))


@command(app)
def env(as_json: JsonOpt = False) -> None:
    """This machine as a bug report needs it: versions, GPUs, CPU and bf16, what "auto" picks here.

    Examples:

    * `ddp env`
    * `ddp env --json | jq .precision_auto`
    """
    info = machine.env()
    emit(info, as_json, lambda: render.print_env(info))


@command(app)
def init(
    folder: Annotated[Path, typer.Argument(metavar="DIR", help="Folder to write into (made if missing).")],
    as_json: JsonOpt = False,
) -> None:
    """Write a starter run config and data.toml (the demo) into DIR; never overwrites a file.

    Examples:

    * `ddp init mywork && cd mywork && ddp train demo.toml`
    """
    result = run_config.init(folder)
    emit(result, as_json, lambda: render.print_starter(result))


def topk_list(text: str) -> list[int]:
    """`--topk 1,5,10` as sorted distinct positive integers."""
    try:
        ks = [int(k) for k in text.split(",") if k.strip()]
    except ValueError:
        ks = []
    if not ks or min(ks) < 1:
        raise ConfigError(f"--topk {text}: give positive whole numbers separated by commas, e.g. 1,5,10")
    return sorted(set(ks))


def entry_point() -> None:
    """The `ddp` executable (pyproject's console script): `main()`, then exit without the
    interpreter's slow teardown."""
    run_and_exit(main)


def main() -> None:
    """Run the CLI; a usage mistake (bad flag or value) is one line and exit 2, like any other. Output
    whose reader left early (`ddp train --help | head -1`) is no error: help exits 0, a command's
    output SIGPIPE's 141 (as `exits.emit` has it). Rich, which draws help and tables, answers a
    closed stdout by pointing it at /dev/null and exiting 1: that is how it is told from a failure."""
    quiet_already = stdout_is_devnull()
    try:
        code = run_app()
    except SystemExit as e:
        if e.code != 1 or quiet_already or not stdout_is_devnull():
            raise
        code = 0 if shows_help(sys.argv[1:]) else SIGPIPE
    sys.exit(code or 0)


def run_app() -> int:
    """The app's exit code, with Typer's usage errors and interrupts as ddp reports them."""
    try:
        return app(standalone_mode=False) or 0
    except NoArgsIsHelpError as e:
        text = e.ctx.get_help()  # typer's rich help prints itself and returns ""
        if text:
            print(text)
        return 0
    except UsageError as e:
        command = e.ctx.command_path if e.ctx else "ddp"
        report_error(f"{e.format_message()} (see `{command} --help`)", USAGE, asks_for_json(sys.argv[1:]))
        return USAGE
    except (typer.Abort, KeyboardInterrupt):
        return SIGINT


def own_args(args: list[str]) -> list[str]:
    """The arguments before a `--` (those after it are passed on, never ddp's own)."""
    return args[:args.index("--")] if "--" in args else args


def asks_for_json(args: list[str]) -> bool:
    """Whether a command line that failed to parse asked for JSON output (`exits` knows it from
    the parsed arguments; a usage error comes before them)."""
    args = own_args(args)
    pairs = zip(args, [*args[1:], ""], strict=True)
    return "--json" in args or "--format=json" in args or ("--format", "json") in pairs


def shows_help(args: list[str]) -> bool:
    """Whether the command line shows help: `--help`, or a group without a command (`ddp datasets`)."""
    args = own_args(args)
    command = typer.main.get_command(app)
    for arg in args:
        command = getattr(command, "commands", {}).get(arg)
        if command is None:
            break
    return "--help" in args or hasattr(command, "commands")
