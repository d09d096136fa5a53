"""The `ddp` command line: one small function per command; errors become exit codes here.

Results go to stdout (with --json: exactly one JSON document, the last line, and on
failure that document is the error); progress, tables and errors go to stderr.
"""

from __future__ import annotations

import functools
import inspect
import json
import logging
import os
import shlex
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Column, Table

try:  # typer >= 0.20 vendors its own click
    from typer._click.exceptions import NoArgsIsHelpError, UsageError
except ImportError:  # pragma: no cover - older typer on real click
    from click.exceptions import NoArgsIsHelpError, UsageError

from ddp_cli import __version__
from ddp_cli.errors import DATA, INTERNAL, SIGINT, USAGE, ConfigError, DataError, DdpError
from ddp_cli.fastexit import run_and_exit

app = typer.Typer(no_args_is_help=True, help="Train image classifiers data-parallel on "
                  "torch.distributed from one TOML file.", rich_markup_mode="markdown")
datasets_app = typer.Typer(no_args_is_help=True, help="Inspect the data set registry (data.toml).")
app.add_typer(datasets_app, name="datasets")
bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks (results and exact commands: BENCHMARKS.md).")
app.add_typer(bench_app, name="bench")
config_app = typer.Typer(no_args_is_help=True, help="The run config: resolved, or its JSON schema.")
app.add_typer(config_app, name="config")
err = Console(stderr=True)
log = logging.getLogger("ddp")

RegistryOpt = Annotated[str | None, typer.Option(
    "--registry", help="data.toml to use (else $DDP_DATA_TOML, else ./data.toml).")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON document on stdout.")]
VerboseOpt = Annotated[bool, typer.Option("-v", "--verbose", help="Debug logging.")]
SIGPIPE = 141  # 128 + 13, as a shell reports a process that wrote to a closed pipe


def exits(command: Callable) -> Callable:
    """Map DdpError to its exit code and one line on stderr; anything else is a bug (1).

    With JSON output the failure is also the last stdout line (`report_error`), so a script
    parses one thing whatever happened. Commands say they print JSON by `as_json` (or
    `fmt == "json"`), which Typer passes by keyword.
    """

    @functools.wraps(command)
    def wrapper(*args: Any, **kwargs: Any) -> None:
        as_json = kwargs.get("as_json") is True or kwargs.get("fmt") == "json"
        try:
            command(*args, **kwargs)
        except DdpError as e:
            fail(str(e), e.exit_code, as_json)
        except (typer.Exit, typer.Abort):
            raise
        except KeyboardInterrupt:
            fail("interrupted", SIGINT, as_json)
        except Exception as e:
            if os.environ.get("DDP_DEBUG") == "1":
                raise
            fail(f"{type(e).__name__}: {e}", INTERNAL, as_json,
                 label="internal error (a bug; DDP_DEBUG=1 shows the traceback):")

    return wrapper


def report_error(message: str, code: int, as_json: bool, result: dict[str, Any] | None = None,
                 label: str = "error:") -> None:
    """One line on stderr; with JSON output also `{"error", "exit_code"}` as the last stdout line,
    after the keys of what the command found before failing (`result`), if anything.

    An empty message is a worker's failure that the worker printed itself (under torchrun)."""
    if message:
        err.print(f"[red]{label}[/red] {escape(message)}", highlight=False, soft_wrap=True)
    if as_json:
        text = message or f"a worker failed with exit code {code} (its message is on stderr)"
        text = text if label == "error:" else f"{label} {text}"
        sys.stdout.write(json.dumps({**(result or {}), "error": text, "exit_code": code}) + "\n")


def fail(message: str, code: int, as_json: bool, result: dict[str, Any] | None = None,
         label: str = "error:") -> NoReturn:
    """`report_error`, then exit with `code`."""
    report_error(message, code, as_json, result, label)
    raise typer.Exit(code)


def takes_verbose(command: Callable) -> Callable:
    """Give a command `-v/--verbose` of its own, so `ddp train ... -v` works as `ddp -v train ...`."""

    @functools.wraps(command)
    def wrapper(*args: Any, verbose: bool = False, **kwargs: Any) -> None:
        if verbose:
            configure_logging(True)
        command(*args, **kwargs)

    # Typer reads the options from the signature: the command's own, and this one
    signature = inspect.signature(command, eval_str=True)
    verbose = inspect.Parameter("verbose", inspect.Parameter.KEYWORD_ONLY, default=False,
                                annotation=VerboseOpt)
    wrapper.__signature__ = signature.replace(parameters=[*signature.parameters.values(), verbose])
    return wrapper


def command(group: typer.Typer, name: str | None = None) -> Callable[[Callable], Callable]:
    """Register a ddp command on `group`: its errors become exit codes (`exits`) and it takes
    -v/--verbose after its name (`takes_verbose`)."""
    return lambda function: group.command(name)(takes_verbose(exits(function)))


def emit(result: Any, as_json: bool, human: Callable[[], None]) -> None:
    with stdout_may_close():
        if as_json:
            sys.stdout.write(json.dumps(result) + "\n")
        else:
            human()


@contextmanager
def stdout_may_close() -> Iterator[None]:
    """A reader that leaves early (`ddp config schema | head`) has all it wanted: exit quietly."""
    try:
        yield
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
        raise typer.Exit(SIGPIPE) from None


def version_callback(value: bool) -> None:
    if value:
        print(f"ddp {__version__}")
        raise typer.Exit()


# the levels -v sets, and those without it; $LOGLEVEL: torch.distributed.elastic sets its loggers'
# levels from it when imported, so its chatter (and C++ stack dumps of errors we report in one
# line) shows only with --verbose
LOG_ENV = {"DDP_LOG_LEVEL": ("INFO", "DEBUG"), "LOGLEVEL": ("CRITICAL", "DEBUG"),
           "TORCH_CPP_LOG_LEVEL": ("FATAL", "INFO")}


def configure_logging(verbose: bool) -> None:
    """Debug logging with -v (before or after the command's name: both call this); -v wins over
    the environment, and without it a level the user exported stays."""
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO, format="%(message)s",
                        stream=sys.stderr)
    if verbose:
        logging.getLogger().setLevel(logging.DEBUG)  # after the command's name: basicConfig already ran
    for name, (quiet, loud) in LOG_ENV.items():
        if verbose:
            os.environ[name] = loud
        else:
            os.environ.setdefault(name, quiet)


@app.callback()
def root(
    version: Annotated[bool, typer.Option("--version", callback=version_callback, is_eager=True,
                                          help="Print the version and exit.")] = False,
    verbose: VerboseOpt = False,
) -> None:
    configure_logging(verbose)


@command(app)
def train(
    config: Annotated[Path, typer.Argument(help="Run config (TOML), e.g. configs/demo.toml.")],
    set_: Annotated[list[str] | None, typer.Option(
        "--set", help="Override a config key: --set optim.lr=0.2 (TOML value syntax).")] = None,
    registry: RegistryOpt = None,
    run_dir: Annotated[Path | None, typer.Option(
        help="Run directory (else runs/NAME-YYYYmmdd-HHMMSS).")] = None,
    nproc_per_node: Annotated[int | None, typer.Option(
        "--nproc-per-node", "--nproc_per_node", min=1, help="Workers on this node.")] = None,
    nnodes: Annotated[str, typer.Option(
        help="Nodes in the job: N, or MIN:MAX to go on with fewer after a node is lost.")] = "1",
    node_rank: Annotated[int, typer.Option("--node-rank", "--node_rank", min=0,
                                           help="This node's rank.")] = 0,
    rdzv_endpoint: Annotated[str | None, typer.Option(
        "--rdzv-endpoint", "--rdzv_endpoint", help="HOST:PORT of the rendezvous.")] = None,
    rdzv_id: Annotated[str | None, typer.Option("--rdzv-id", "--rdzv_id",
                                                help="Job id shared by all nodes.")] = None,
    max_restarts: Annotated[int | None, typer.Option(
        "--max-restarts", "--max_restarts", min=0, help="Elastic restarts on failure.")] = None,
    standalone: Annotated[bool, typer.Option(
        "--standalone", help="torchrun's spelling of one node with a local rendezvous (the default; "
        "SLURM's node settings are then ignored).")] = False,
    master_addr: Annotated[str | None, typer.Option(
        "--master-addr", "--master_addr", help="torchrun's spelling: with --master-port, the same as "
        "--rdzv-endpoint ADDR:PORT.")] = None,
    master_port: Annotated[int | None, typer.Option(
        "--master-port", "--master_port", min=1, max=65535, help="See --master-addr.")] = None,
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
    * `ddp train cfg.toml --nnodes 1:2 --max-restarts 3 --rdzv-endpoint node0:29400 --rdzv-id job1`
    * `ddp train cfg.toml --nproc_per_node 4 --standalone` (torchrun's spellings work too)
    """
    from ddp_cli.config import load_config
    from ddp_cli.index_build import IndexBuild

    cfg = load_config(config, set_ or [])
    # the index builds in a process of its own while this one imports torch (under an external
    # torchrun only rank 0 needs it)
    with IndexBuild.begin(cfg, registry, fork=os.environ.get("RANK", "0") == "0") as build:
        from ddp_cli import commands
        from ddp_cli.run.launch import LaunchOptions, master_endpoint, standalone_checked, with_environment

        endpoint = master_endpoint(master_addr, master_port, rdzv_endpoint)
        opts = LaunchOptions(nproc_per_node, node_rank=node_rank, rdzv_endpoint=endpoint, rdzv_id=rdzv_id,
                             max_restarts=max_restarts, **LaunchOptions.nodes(nnodes))
        opts = standalone_checked(opts) if standalone else with_environment(opts)
        if dry_run:
            plan = commands.plan(cfg, build, opts, resume)
            emit(plan, as_json, lambda: print_mapping("plan", plan))
            return
        result = commands.train(cfg, build, run_dir, opts, resume, quiet or as_json)
    if result:
        emit(result, as_json, lambda: print_train_summary(result))


WeightsOpt = Annotated[str, typer.Option(
    "--weights", help="The checkpoint's trained weights (model) or their moving average (ema).")]
NprocOpt = Annotated[int, typer.Option("--nproc-per-node", "--nproc_per_node", min=1,
                                       help="Workers on this node.")]
BatchOpt = Annotated[int | None, typer.Option(min=1, help="Images per worker per batch.")]


@command(app)
def validate(
    checkpoint: Annotated[Path, typer.Option(help="A checkpoint from <run>/checkpoints/.")],
    config: Annotated[Path | None, typer.Option(
        help="Use this run config instead of the checkpoint's.")] = None,
    dataset: Annotated[str | None, typer.Option(help="Validate on this registry data set.")] = None,
    registry: RegistryOpt = None,
    nproc_per_node: NprocOpt = 1,
    batch_size: BatchOpt = None,
    weights: WeightsOpt = "model",
    topk: Annotated[str, typer.Option(help="Accuracies to report, e.g. 1,5,10 (top1 and top5 always).")]
    = "1,5",
    per_class: Annotated[bool, typer.Option(
        "--per-class", help="Each class's accuracy and count, worst first (and per_class in JSON).")] = False,
    confusion: Annotated[Path | None, typer.Option(
        help="Write the confusion matrix here (CSV: rows true class, columns predicted).")] = None,
    predictions: Annotated[Path | None, typer.Option(
        help="Write every image's path, label, top-k classes and probabilities here (CSV).")] = None,
    tta: Annotated[str | None, typer.Option(
        help="Test-time augmentation: flip (average with the mirrored image).")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Evaluate a checkpoint on the whole validation split (each image counted once).

    Examples:

    * `ddp validate --checkpoint runs/demo-20261122-023101/checkpoints/last.pt`
    * `ddp validate --checkpoint best.pt --nproc-per-node 3 --json`
    * `ddp validate --checkpoint best.pt --weights ema --topk 1,5,10 --per-class --confusion cm.csv`
    * `ddp validate --checkpoint best.pt --dataset imagenet_s3 --registry data.toml`
    """
    from ddp_cli import commands
    from ddp_cli.run.jobs import Job
    from ddp_cli.run.launch import LaunchOptions

    job = Job("validate", as_json, str(checkpoint), weights=one_of(weights, ("model", "ema"), "--weights"),
              topk=topk_list(topk), tta=one_of(tta, ("flip",), "--tta") == "flip" if tta else False,
              per_class=per_class, confusion=str(confusion) if confusion else None,
              predictions=str(predictions) if predictions else None)
    result = commands.validate(job, config, dataset, registry, LaunchOptions(nproc_per_node), batch_size)
    emit(result, as_json, lambda: print_validation(result))


@command(app)
def predict(
    checkpoint: Annotated[Path, typer.Option(help="A checkpoint from <run>/checkpoints/.")],
    inputs: Annotated[list[str] | None, typer.Argument(
        help="Image files, folders (walked for images) or s3://bucket/key URLs.", show_default=False)] = None,
    dataset: Annotated[str | None, typer.Option(help="Predict a registry data set's split instead.")] = None,
    split: Annotated[str, typer.Option(help="With --dataset: train or val.")] = "val",
    registry: RegistryOpt = None,
    topk: Annotated[int, typer.Option(min=1, help="Classes per image, best first.")] = 5,
    weights: WeightsOpt = "model",
    batch_size: BatchOpt = None,
    nproc_per_node: NprocOpt = 1,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object per input, one per line.")] = False,
) -> None:
    """The top-k classes of each image, with the checkpoint's own validation preprocessing.

    A bad image gets an error entry and the others are still predicted; the exit code is then 3.

    Examples:

    * `ddp predict --checkpoint best.pt photos/ cat.jpg`
    * `ddp predict --checkpoint best.pt --dataset demo --split val --topk 1 --json > preds.jsonl`
    * `ddp predict --checkpoint best.pt s3://my-bucket/new-images/ --weights ema`
    """
    from ddp_cli import commands
    from ddp_cli.run.jobs import Job
    from ddp_cli.run.launch import LaunchOptions

    job = Job("predict", as_json, str(checkpoint), weights=one_of(weights, ("model", "ema"), "--weights"),
              topk=[topk])
    answers = commands.predict(job, inputs or [], dataset, one_of(split, ("train", "val"), "--split"),
                               registry, LaunchOptions(nproc_per_node), batch_size)
    if as_json:
        for item in answers:
            print(json.dumps(item))
    else:
        print_predictions(answers)
    failed = [a for a in answers if "error" in a]
    if failed:
        raise DataError(f"{len(failed)} of {len(answers)} images could not be predicted, the first "
                        f"{failed[0]['path']}: {failed[0]['error']}")


@command(app)
def export(
    checkpoint: Annotated[Path, typer.Option(help="A checkpoint, e.g. RUN_DIR/checkpoints/best.pt.")],
    format_: Annotated[str, typer.Option(
        "--format", help="state_dict | safetensors | torchscript | onnx.", show_default=False)],
    out: Annotated[Path, typer.Option(help="File to write; its model card goes beside it, FILE.card.json.")],
    weights: WeightsOpt = "model",
    as_json: JsonOpt = False,
) -> None:
    """Write a checkpoint's weights for use without ddp, and a model card beside them (FILE.card.json).

    state_dict and safetensors load strictly into the builder the card names (torchvision's);
    torchscript and onnx (batch dimension dynamic) run without it. On the CPU, in fp32, eval mode.

    Examples:

    * `ddp export --checkpoint runs/demo-20261122-023101/checkpoints/last.pt --format state_dict --out m.pt`
    * `ddp export --checkpoint best.pt --format onnx --weights ema --out model.onnx --json`
    * `ddp export --checkpoint best.pt --format safetensors --out model.safetensors`
    """
    from ddp_cli.export import export_checkpoint

    result = export_checkpoint(checkpoint, format_, weights, out)

    def human() -> None:
        err.print(f"wrote {result['out']} ({result['format']}, {result['weights']} weights, "
                  f"{result['bytes'] / 2**20:.1f} MiB)\nsha256 {result['sha256']}\ncard   {result['card']}",
                  markup=False, highlight=False, soft_wrap=True)

    emit(result, as_json, human)


@command(datasets_app, "list")
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


DatasetArg = Annotated[str, typer.Argument(help="A data set name in the registry.")]


@command(datasets_app, "show")
def datasets_show(name: DatasetArg, registry: RegistryOpt = None, as_json: JsonOpt = False) -> None:
    """Show a data set: its registry entry, split sizes and classes.

    Examples:

    * `ddp datasets show demo`
    * `ddp datasets show imagenet_s3 --json | jq .splits`
    """
    from ddp_cli import commands

    result = commands.datasets_show(name, registry)

    def human() -> None:
        entry = {k: v for k, v in result.items() if k not in ("splits", "classes", "storage")}
        print_mapping(name, entry | {f"storage.{k}": v for k, v in result["storage"].items()})
        print_splits(result["splits"])
        classes = Table("label", "synset", "description", title=f"{len(result['classes'])} classes",
                        title_justify="left")
        for row in result["classes"][:10]:
            classes.add_row(str(row["index"]), row["synset"], row["description"])
        if len(result["classes"]) > 10:
            classes.add_row("...", f"{len(result['classes']) - 10} more", "(--json lists all)")
        Console().print(classes)

    emit(result, as_json, human)


@command(datasets_app, "check")
def datasets_check(
    name: DatasetArg,
    split: Annotated[str, typer.Option(help="train | val | all")] = "all",
    workers: Annotated[int | None, typer.Option(min=1, help="Threads reading and decoding "
                                                "(default 4 per CPU, at most 32).")] = None,
    registry: RegistryOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Read and decode every image of a split; list every bad file and why. Exit 3 if any.

    Reasons: missing file (named in the listing/CSV), unreadable, not an image, truncated,
    corrupt, unknown synset.

    Examples:

    * `ddp datasets check demo`
    * `ddp datasets check imagenet_s3 --split val --workers 32 --json`
    """
    from ddp_cli import commands

    if split not in ("train", "val", "all"):
        raise ConfigError(f"--split {split}: use train, val or all")
    with progress_bar(err.is_terminal and not as_json, f"checking {name}") as progress:
        result = commands.datasets_check(name, registry, split, workers, progress)

    def human() -> None:
        print_splits(result["splits"])
        if result["bad_files"]:
            table = Table(title=f"{len(result['bad_files'])} bad files under {result['root']}",
                          title_justify="left")
            table.add_column("path", overflow="fold")  # whole paths, wrapped, never cut
            table.add_column("reason", overflow="fold")
            for bad in result["bad_files"]:
                table.add_row(bad["path"], bad["reason"])
            Console().print(table)
        else:
            Console().print(f"[green]no bad files[/] ({result['seconds']:.1f} s)")

    if not (as_json and result["bad_files"]):  # with --json the error object carries the findings
        emit(result, as_json, human)
    if result["bad_files"]:
        fail(f"{len(result['bad_files'])} bad file(s) in data set {name!r}; fix or remove them, or "
             'train with data.on_bad_image = "skip"', DATA, as_json, result)



@command(datasets_app, "pack")
def datasets_pack(
    name: DatasetArg,
    to: Annotated[str, typer.Option("--to", help="A local folder or s3://BUCKET/PREFIX (endpoint from "
                                    "AWS_ENDPOINT_URL).")],
    split: Annotated[str, typer.Option(help="train | val | all")] = "all",
    max_side: Annotated[int | None, typer.Option(min=8, help="Shrink images whose longer side is above "
                                                 "this (aspect kept).")] = None,
    quality: Annotated[int, typer.Option(min=1, max=100, help="JPEG quality of re-encoded images.")] = 90,
    shard_size: Annotated[float, typer.Option(min=0.01, help="Largest shard, MiB.")] = 256,
    workers: Annotated[int | None, typer.Option(min=1, help="Threads reading and encoding "
                                                "(default: one per CPU).")] = None,
    on_bad_image: Annotated[str, typer.Option(help="error: stop (exit 3) naming the file; skip: leave "
                                              "it out and list it in the index.")] = "error",
    registry: RegistryOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Pack a data set into tar shards (WebDataset convention) + an index: `layout = "shards"`.

    Every image becomes an RGB JPEG (quirk files re-encoded, plain ones copied unless --max-side
    shrinks them). A killed pack resumes when run again with the same options; a shard is never
    visible half-written, and the data set exists once index.json is written (last).

    Examples:

    * `ddp datasets pack imagenet_local --to /data/imagenet-256 --max-side 256`
    * `ddp datasets pack imagenet_local --to s3://my-bucket/imagenet-shards --json`
    """
    from ddp_cli import commands
    from ddp_cli.data.pack.writer import PackOptions

    split = one_of(split, ("train", "val", "all"), "--split")
    on_bad_image = one_of(on_bad_image, ("error", "skip"), "--on-bad-image")
    opts = PackOptions(max_side=max_side, quality=quality, shard_mib=shard_size, on_bad_image=on_bad_image)
    with progress_bar(err.is_terminal and not as_json, f"packing {name}") as progress:
        result = commands.datasets_pack(name, to, registry, split, opts, workers or os.cpu_count() or 1,
                                        progress)

    def human() -> None:
        table = Table("split", "images", "shards", "MiB", "skipped", title=f"packed into {result['to']}",
                      title_justify="left")
        for split_name, row in result["splits"].items():
            table.add_row(split_name, str(row["images"]), str(row["shards"]), f"{row['bytes'] / 2**20:.1f}",
                          str(row["skipped"]))
        Console().print(table)
        Console().print(f"index: {result['index']} ({result['seconds']:.1f} s)")

    emit(result, as_json, human)


@command(datasets_app, "index")
def datasets_index(
    root: Annotated[str, typer.Argument(help="A folder or s3://BUCKET/PREFIX of tar shards; the index "
                                        "is written there.")],
    split: Annotated[list[str] | None, typer.Option(help="SPLIT=GLOB, e.g. train='train-*.tar' (default: "
                                                    "train=*train*.tar and val=*val*.tar).")] = None,
    classes: Annotated[str | None, typer.Option(help="A text file naming the classes, one per line, "
                                                "in label order (default: the labels as names).")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Index tar shards written by the webdataset library (`.jpg` + `.cls`), so ddp trains on them.

    Writes index.json and per split <split>-samples.npz (every image's shard, offset, size and
    label; each shard's sha256). Point a registry entry with `layout = "shards"` at the folder.

    Examples:

    * `ddp datasets index /data/wds --split train='shard-train-*.tar' --split val='shard-val-*.tar'`
    """
    from ddp_cli import commands

    if split and not all("=" in item for item in split):
        raise ConfigError("--split: write SPLIT=GLOB, e.g. --split train='train-*.tar'")
    splits = dict(item.split("=", 1) for item in split) if split else {"train": "*train*.tar",
                                                                       "val": "*val*.tar"}
    with progress_bar(err.is_terminal and not as_json, f"indexing {root}") as progress:
        result = commands.datasets_index(root, splits, classes, progress)

    def human() -> None:
        print_splits({name: {"images": row["images"], "shards": row["shards"]}
                      for name, row in result["splits"].items()})
        Console().print(f"index: {result['index']}")

    emit(result, as_json, human)


RoundsOpt = Annotated[int, typer.Option(min=1, help="Alternating rounds (noise hits every variant).")]


@command(bench_app, "data")
def bench_data(
    names: Annotated[list[str], typer.Argument(help="A data set in the registry; several: the same images "
                                               "on other storages, a row each against the first.")],
    latency_ms: Annotated[float, typer.Option(min=0, help="Storage rows: added first-byte latency of every "
                                              "S3 request (a proxy in front of the endpoint).")] = 0,
    split: Annotated[str, typer.Option(help="train | val: whose files to read.")] = "train",
    workers: Annotated[int, typer.Option(min=0, help="DataLoader processes, for both pipelines.")] = 4,
    seconds: Annotated[float, typer.Option(min=1, help="Timed seconds, split over all pipelines.")] = 20,
    batch_size: Annotated[int, typer.Option(min=1, help="Images per batch.")] = 32,
    image_size: Annotated[int, typer.Option(min=8, help="Training crop side.")] = 224,
    policy: Annotated[str, typer.Option(
        help="Augmentation policy both pipelines run after the flip: none | trivialaugment | randaugment | "
             "autoaugment, several comma-separated, or all (a row each, and each against none).")] = "none",
    rounds: RoundsOpt = 3,
    registry: RegistryOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Images/s of the training input pipeline vs a plain torchvision loader, same files, workers and policy;
    with several data sets (or --latency-ms), of the pipeline over each one's storage.

    Storage rows: local files, local shards, S3 files (serial: one GET per image; batched:
    data.io_concurrency GETs at once), S3 shards; each with its ratio to the first row.

    Examples:

    * `ddp bench data demo --workers 2 --seconds 10`
    * `ddp bench data imagenet_local --workers 8 --json`
    * `ddp bench data imagenet_local --workers 2 --policy all --seconds 120`
    * `ddp bench data jpegs jpegs_shards jpegs_s3 jpegs_s3_shards --latency-ms 50 --workers 2`
    """
    from ddp_cli.bench.data import POLICIES
    from ddp_cli.bench.data import bench_data as run

    if len(names) > 1 or latency_ms:
        from ddp_cli.bench.storage import bench_storage

        result = bench_storage(names, registry, latency_ms, workers, seconds, batch_size, image_size, rounds)
        emit(result, as_json, lambda: print_bench(result))
        return
    name = names[0]
    if split not in ("train", "val"):
        raise ConfigError(f"--split {split}: use train or val")
    policies = POLICIES if policy == "all" else tuple(dict.fromkeys(policy.split(",")))
    if unknown := [p for p in policies if p not in POLICIES]:
        raise ConfigError(f"--policy {unknown[0]}: use {', '.join(POLICIES)} or all")
    result = run(name, registry, split, workers, seconds, batch_size, image_size, policies, rounds)
    emit(result, as_json, lambda: print_bench(result))


ModelOpt = Annotated[str, typer.Option(help="Model name (torchvision or resnet_tiny).")]
BatchOpt = Annotated[int, typer.Option(min=1, help="Images per worker per step.")]
SizeOpt = Annotated[int, typer.Option(min=8, help="Image side, pixels.")]
WorldOpt = Annotated[int, typer.Option(min=1, help="Worker processes (gloo on loopback).")]
ThreadsOpt = Annotated[int, typer.Option(min=1, help="Intra-op threads per worker.")]
StepsOpt = Annotated[int, typer.Option(min=1, help="Timed steps per variant and round.")]


def step_spec(model: str, batch_size: int, image_size: int, steps: int, rounds: int):
    from ddp_cli.bench.step import StepSpec
    from ddp_cli.models import known_models

    if model not in known_models():
        from ddp_cli.errors import did_you_mean

        raise ConfigError(f"--model {model}: unknown model{did_you_mean(model, known_models())}")
    return StepSpec(model=model, batch_size=batch_size, image_size=image_size, steps=steps, rounds=rounds)


@command(bench_app, "step")
def bench_step(
    model: ModelOpt = "resnet_tiny",
    batch_size: BatchOpt = 32,
    image_size: SizeOpt = 32,
    world_size: WorldOpt = 2,
    threads: ThreadsOpt = 1,
    steps: StepsOpt = 10,
    rounds: RoundsOpt = 4,
    as_json: JsonOpt = False,
) -> None:
    """Training images/s of ddp's train_step vs the PyTorch DDP tutorial's loop, and where a step's time goes.

    Examples:

    * `ddp bench step`
    * `ddp bench step --model resnet18 --image-size 112 --steps 10 --json`
    """
    from ddp_cli.bench.step import bench_step as run

    result = run(step_spec(model, batch_size, image_size, steps, rounds), world_size, threads)
    emit(result, as_json, lambda: print_bench(result))


@command(bench_app, "scaling")
def bench_scaling(
    model: ModelOpt = "resnet_tiny",
    batch_size: BatchOpt = 32,
    image_size: SizeOpt = 32,
    world_size: Annotated[int, typer.Option(min=2, help="Workers to compare with one.")] = 2,
    threads: ThreadsOpt = 1,
    steps: StepsOpt = 20,
    rounds: RoundsOpt = 3,
    as_json: JsonOpt = False,
) -> None:
    """Images/s at world size 1 and N (same per-worker batch and threads), efficiency, exposed all-reduce.

    Examples:

    * `ddp bench scaling`
    * `ddp bench scaling --model resnet18 --image-size 112 --json`
    """
    from ddp_cli.bench.scaling import bench_scaling as run

    result = run(step_spec(model, batch_size, image_size, steps, rounds), world_size, threads)
    emit(result, as_json, lambda: print_bench(result))


@command(bench_app, "options")
def bench_options(
    model: ModelOpt = "resnet_tiny",
    batch_size: BatchOpt = 32,
    image_size: SizeOpt = 32,
    world_size: WorldOpt = 2,
    threads: ThreadsOpt = 1,
    steps: StepsOpt = 10,
    rounds: RoundsOpt = 3,
    only: Annotated[str | None, typer.Option(help="Variants to run, comma-separated (default: all).")] = None,
    as_json: JsonOpt = False,
) -> None:
    """ddp's step with one DDP/compile setting changed at a time, against ddp's defaults.

    Examples:

    * `ddp bench options`
    * `ddp bench options --model resnet18 --image-size 112 --only defaults,static_graph=true`
    """
    from ddp_cli.bench.options import VARIANTS
    from ddp_cli.bench.options import bench_options as run

    names = only.split(",") if only else None
    unknown = sorted(set(names or []) - set(VARIANTS))
    if unknown:
        raise ConfigError(f"--only {only}: unknown variant {unknown[0]!r}; known: {', '.join(VARIANTS)}")
    result = run(step_spec(model, batch_size, image_size, steps, rounds), world_size, threads, names)
    emit(result, as_json, lambda: print_bench(result))


@command(bench_app, "checkpoint")
def bench_checkpoint(
    model: ModelOpt = "resnet50",
    batch_size: BatchOpt = 8,
    image_size: SizeOpt = 224,
    world_size: WorldOpt = 2,
    threads: ThreadsOpt = 1,
    rounds: RoundsOpt = 2,
    as_json: JsonOpt = False,
) -> None:
    """What a checkpoint costs the step it follows: none vs written in the step vs in the background.

    Examples:

    * `ddp bench checkpoint`
    * `ddp bench checkpoint --model resnet_tiny --image-size 32 --json`
    """
    from ddp_cli.bench.checkpoint import bench_checkpoint as run

    result = run(step_spec(model, batch_size, image_size, 1, rounds), world_size, threads)
    emit(result, as_json, lambda: print_bench(result))


@command(bench_app, "allreduce")
def bench_allreduce(
    sizes: Annotated[str, typer.Option(help="Buffer sizes, MiB, comma-separated.")] = "1,4,16,64",
    world_size: WorldOpt = 2,
    budget: Annotated[float, typer.Option(min=1, help="MiB reduced per size (repeats = budget/size).")] = 512,
    as_json: JsonOpt = False,
) -> None:
    """gloo all-reduce bandwidth for gradient-sized buffers vs a local memory copy of the same size.

    Examples:

    * `ddp bench allreduce`
    * `ddp bench allreduce --sizes 0.25,1,4 --json`
    """
    from ddp_cli.bench.allreduce import bench_allreduce as run

    try:
        sizes_mb = [float(s) for s in sizes.split(",")]
    except ValueError:
        raise ConfigError(f"--sizes {sizes}: expected MiB numbers separated by commas, e.g. 1,4,16") from None
    if not sizes_mb or min(sizes_mb) <= 0:
        raise ConfigError(f"--sizes {sizes}: sizes must be positive")
    result = run(sizes_mb, world_size, 1, budget)
    emit(result, as_json, lambda: print_bench(result))


@command(bench_app, "memory")
def bench_memory(
    rows: Annotated[int, typer.Option(min=1000, help="Train rows of the index (ImageNet: 1,281,167).")]
    = 1_281_167,
    workers: Annotated[int, typer.Option(min=1, help="DataLoader processes walking the index.")] = 4,
    as_json: JsonOpt = False,
) -> None:
    """Private memory the index costs a rank and each loader process over one pass, vs Python lists.

    Examples:

    * `ddp bench memory`
    * `ddp bench memory --rows 100000 --workers 2 --json`
    """
    from ddp_cli.bench.memory import bench_memory as run

    result = run(rows, workers)
    emit(result, as_json, lambda: print_bench(result, table="forms"))


DEMO_CONFIG = Path("configs/demo.toml")


@command(bench_app, "e2e")
def bench_e2e(
    config: Annotated[Path, typer.Argument(help="Run config with a local data set.")] = DEMO_CONFIG,
    target: Annotated[float, typer.Option(min=0, max=1, help="Val top-1 to reach.")] = 0.95,
    rounds: Annotated[int, typer.Option(min=1, help="Alternating rounds of both runs.")] = 1,
    epochs: Annotated[int | None, typer.Option(min=1, help="Epochs (default: the config's).")] = None,
    registry: RegistryOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Wall time to reach a val top-1 target: `ddp train` vs a hand-written torchrun script, same recipe.

    Examples:

    * `ddp bench e2e`
    * `ddp bench e2e configs/demo.toml --rounds 3 --json`
    """
    from ddp_cli.bench.e2e import bench_e2e as run

    result = run(config, registry, target, rounds, epochs)
    emit(result, as_json, lambda: print_bench(result))


@command(app)
def report(
    run_dir: Annotated[Path, typer.Argument(help="A run directory made by `ddp train`.")],
    out: Annotated[Path | None, typer.Option(
        help="PNG to write (default RUN_DIR/report.png); any per-class one goes beside it, STEM-classes.png.",
    )] = None,
    as_json: JsonOpt = False,
) -> None:
    """Plot a run's loss, accuracy, LR and images/s, and summarise it (works mid-run).

    When training or `ddp validate --per-class` left an evaluation in the run dir, a second PNG
    shows its per-class top-1 and, up to 50 classes, its confusion matrix.

    Examples:

    * `ddp report runs/demo-20261122-023101`
    * `ddp report runs/demo-20261122-023101 --out curves.png --json`
    """
    from ddp_cli.observe import classes
    from ddp_cli.observe.report import classes_png, plot, summarize

    summary = summarize(run_dir)
    png = out or run_dir / "report.png"
    summary["plot"] = str(plot(run_dir, png))
    drawn = classes.plot(run_dir, classes_png(png))
    summary["classes_plot"] = str(drawn) if drawn else None
    human = {**summary, "worst_classes": classes.describe(summary["worst_classes"])} \
        if "worst_classes" in summary else summary
    emit(summary, as_json, lambda: print_mapping("report", human))


@command(app)
def env(as_json: JsonOpt = False) -> None:
    """This machine as a bug report needs it: versions, GPUs, CPU and bf16, what "auto" picks here.

    Examples:

    * `ddp env`
    * `ddp env --json | jq .precision_auto`
    """
    from ddp_cli import commands

    info = commands.env()
    emit(info, as_json, lambda: print_env(info))


FormatOpt = Annotated[str, typer.Option(
    "--format", help="toml (commented, every default) | json (one line).")]


@command(config_app, "show")
def config_show(
    config: Annotated[Path, typer.Argument(help="Run config (TOML).")],
    set_: Annotated[list[str] | None, typer.Option(
        "--set", help="Override a config key: --set optim.lr=0.2 (TOML value syntax).")] = None,
    fmt: FormatOpt = "toml",
) -> None:
    """The resolved run config, every default written out (unset keys commented); reads no data.

    Its TOML, saved to a file, trains the same run as CONFIG with those --set.

    Examples:

    * `ddp config show configs/resnet34.toml`
    * `ddp config show configs/demo.toml --set train.epochs=2 > two-epochs.toml`
    * `ddp config show configs/demo.toml --format json | jq .optim`
    """
    from ddp_cli.config import load_config
    from ddp_cli.config_view import render

    if fmt not in ("toml", "json"):
        raise ConfigError(f"--format {fmt}: use toml or json")
    overrides = set_ or []
    source = " ".join([str(config), *(f"--set {item}" for item in overrides)])
    text = render(load_config(config, overrides), fmt, source)
    with stdout_may_close():
        print(text)


@command(config_app, "schema")
def config_schema() -> None:
    """The run config's JSON schema (for editors: completion, and unknown keys flagged as you type).

    Examples:

    * `ddp config schema > ddp-config.schema.json`
    """
    from ddp_cli.config_view import schema

    with stdout_may_close():
        print(json.dumps(schema(), indent=2))


@command(app)
def init(
    folder: Annotated[Path, typer.Argument(help="Folder to write into (made if missing).")],
    as_json: JsonOpt = False,
) -> None:
    """Write a starter run config and data.toml (the demo) into FOLDER; never overwrites a file.

    Examples:

    * `ddp init mywork && cd mywork && ddp train demo.toml`
    """
    from ddp_cli.starter import write_starter

    result = write_starter(folder)

    def human() -> None:
        names = [Path(path).name for path in result["files"]]
        configs = [name for name in names if name != "data.toml"]  # the registry: ./data.toml there
        lines = [f"wrote {', '.join(names)} to {result['dir']}"]
        lines += [f"train: cd {shlex.quote(result['dir'])} && ddp train {configs[0]}"] if configs else []
        Console().print("\n".join(lines), highlight=False, soft_wrap=True)

    emit(result, as_json, human)


def print_env(info: dict[str, Any]) -> None:
    """`ddp env` as one two-column table, a fact a row."""
    cpu, backends = info["cpu"], info["backends"]
    bf16 = (f"native ({', '.join(cpu['bf16_flags'])})" if cpu["bf16_native"] else
            "not native (no AVX-512 BF16 / AMX): emulated, slower than fp32")
    gpus = [f"{g['index']}: {g['name']}, {g['memory_gib']} GiB, compute {g['capability']}"
            for g in info["gpus"]]
    refused = f"refused: {info.get('auto_refused')}"
    rows = {
        "ddp": info["ddp"], "python": f"{info['python']} ({info['platform']})",
        "torch": info["torch"], "torchvision": info["torchvision"],
        "CUDA": f"{info['cuda'] or 'none (CPU build)'}; available: {_yes(info['cuda_available'])}",
        "cuDNN": info["cudnn"] or "none", "NCCL": info["nccl"] or "none",
        "GPUs": "\n".join(gpus) or "none",
        "CPU": f"{cpu['model']}, {cpu['count']} CPUs ({cpu['usable']} usable by this process)",
        "CPU bf16": bf16,
        "memory": f"{info['memory_gib']} GiB",
        "backends": ", ".join(f"{name} {_yes(ok)}" for name, ok in backends.items()),
        'precision = "auto"': info["precision_auto"] or refused,
        'backend = "auto"': info["backend_auto"] or refused,
        'nproc_per_node = "auto"': str(info["nproc_per_node_auto"] or refused),
        "settings": " ".join(f"{k}={v}" for k, v in info["settings"].items()) or "none set",
    }
    table = Table(title="ddp env", title_justify="left", show_header=False)
    for key, value in rows.items():
        table.add_row(key, value)
    Console().print(table, highlight=False)


def one_of(value: str, allowed: tuple[str, ...], flag: str) -> str:
    if value not in allowed:
        raise ConfigError(f"{flag} {value}: use {' or '.join(allowed)}")
    return value


def topk_list(text: str) -> list[int]:
    """`--topk 1,5,10` as sorted distinct positive integers."""
    try:
        ks = [int(k) for k in text.split(",") if k.strip()]
    except ValueError:
        ks = []
    if not ks or min(ks) < 1:
        raise ConfigError(f"--topk {text}: give positive whole numbers separated by commas, e.g. 1,5,10")
    return sorted(set(ks))


def print_validation(result: dict[str, Any]) -> None:
    """The numbers; with --per-class, a table of every class, worst first."""
    print_mapping("validation", {k: v for k, v in result.items() if k != "per_class"})
    if "per_class" not in result:
        return
    table = Table("class", "synset", "description", "images", "top-1", title="per class, worst first",
                  title_justify="left")
    for row in sorted(result["per_class"], key=lambda r: (r["top1"] is None, r["top1"] or 0.0, r["index"])):
        top1 = "-" if row["top1"] is None else f"{row['top1']:.4f}"
        table.add_row(str(row["index"]), escape(row["synset"]), escape(row["description"]),
                      str(row["images"]), top1)
    Console().print(table)


def print_predictions(answers: list[dict[str, Any]]) -> None:
    """One row per input: its best class and probability, then the rest of its top-k (or its error)."""
    table = Table(Column("input", overflow="fold"), "class", "probability", "then", title="predictions",
                  title_justify="left")
    here = os.getcwd() + os.sep
    for item in answers:
        path = escape(item["path"].removeprefix(here))
        if "error" in item:
            table.add_row(path, "[red]error[/red]", "", escape(item["error"]))
            continue
        best, *rest = item["topk"]
        table.add_row(path, escape(f"{best['synset']} {best['description']}"),
                      f"{best['probability']:.3f}",
                      escape(", ".join(f"{r['description']} {r['probability']:.3f}" for r in rest)))
    Console().print(table)


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"


def print_mapping(title: str, result: dict[str, Any]) -> None:
    table = Table(title=title, title_justify="left", show_header=False)
    for key, value in result.items():
        table.add_row(key, _cell(value))
    Console().print(table)


def _cell(value: Any) -> str:
    """A mapping's value: a list of strings one per line (a pipeline's steps, in order), other
    containers as JSON."""
    if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        return "\n".join(value)
    return json.dumps(value) if isinstance(value, dict | list) else _fmt(value)


def print_splits(splits: dict[str, dict[str, int]]) -> None:
    table = Table("split", "images", "classes")
    for split, counts in splits.items():
        table.add_row(split, str(counts["images"]), str(counts["classes"]))
    Console().print(table)


def print_bench(result: dict[str, Any], table: str = "rows") -> None:
    """Every bench the same way: its `table` (`rows`) as a table, then the other keys (see ddp_cli/bench)."""
    rows = result[table]
    out = Table(*rows[0], title=f"bench {result['bench']}", title_justify="left")
    for row in rows:
        out.add_row(*(_fmt(v) for v in row.values()))
    Console().print(out)
    print_mapping("set-up and result", {k: v for k, v in result.items() if k not in ("bench", table)})


@contextmanager
def progress_bar(enabled: bool, label: str) -> Iterator[Callable[[int, int], None] | None]:
    """A rich bar on stderr (TTY only); yields `update(done, total)`, or None when disabled."""
    if not enabled:
        yield None
        return
    with Progress(TextColumn(label), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                  console=err, transient=True) as bar:
        task = bar.add_task(label, total=None)
        yield lambda done, total: bar.update(task, completed=done, total=total)


def print_train_summary(result: dict[str, Any]) -> None:
    final = result["final"]
    Console().print(
        f"[bold green]done[/] top-1 {final['top1']:.4f}  top-5 {final['top5']:.4f}  "
        f"loss {final['loss']:.4f} on {final['images']} val images  "
        f"({result['images_per_second']:.0f} img/s)\n"
        f"run:        {result['run_dir']}\ncheckpoint: {result['checkpoint']}",
        highlight=False,
    )
    if result.get("io_retries"):
        Console().print(f"storage:    {result['io_retries']} transient error(s) retried (data.io_retries)",
                        highlight=False)


def _fmt(value: Any) -> str:
    if isinstance(value, list):
        return " ".join(_fmt(v) for v in value)
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def run() -> None:
    """The `ddp` executable: `main()`, then exit without the interpreter's slow teardown."""
    run_and_exit(main)


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
        report_error(f"{e.format_message()} (see `{command} --help`)", USAGE, asks_for_json(sys.argv[1:]))
        code = USAGE
    except (typer.Abort, KeyboardInterrupt):
        code = SIGINT
    sys.exit(code or 0)


def asks_for_json(args: list[str]) -> bool:
    """Whether a command line that failed to parse asked for JSON output (`exits` knows it from
    the parsed arguments; a usage error comes before them)."""
    args = args[:args.index("--")] if "--" in args else args
    pairs = zip(args, [*args[1:], ""], strict=True)
    return "--json" in args or "--format=json" in args or ("--format", "json") in pairs
