"""What each command does, without Typer: resolve inputs, check them (preflight), launch workers.

Every `ddp` command but `bench` (a tool beside the product: ddp_cli/bench) comes through here from
cli.py, which parses flags and draws results. Imports: at the top only modules that leave torch
unimported; those that import it (run.launch, preflight, train, export, envinfo, ...) are imported
in the function that needs them, so `datasets list`, `config show`, `init` and `report` start
without paying torch's import (seconds), and `train` builds its index in a process forked before
torch is loaded (`indexing`). tests/unit/test_cli_startup.py checks.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shlex
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ddp_cli.cli.config_view import render, schema
from ddp_cli.cli.starter import write_starter
from ddp_cli.config import RunConfig, TrainConfig, load_config
from ddp_cli.data.fetch.storage import s3_filesystem
from ddp_cli.data.index_build import IndexBuild, resolve_dataset
from ddp_cli.data.registry import DatasetEntry, load_registry
from ddp_cli.data.sources.inputs import expand_inputs, input_root
from ddp_cli.data.sources.layouts import SHARDS, build_index
from ddp_cli.data.sources.shards import describe as describe_shards
from ddp_cli.data.sources.shards import read_index
from ddp_cli.data.sources.table import UNLABELED, IndexTable
from ddp_cli.errors import INTERNAL, PEER_LOST, ConfigError, DataError, DdpError, PeerLost, WorkerFailed
from ddp_cli.io import writing
from ddp_cli.observe import classes
from ddp_cli.observe.report import classes_png, plot, summarize
from ddp_cli.observe.startup import StartupClock
from ddp_cli.run.bucket import RunBucket, staging_folder
from ddp_cli.run.jobs import Job, prepare_job, read_result
from ddp_cli.userfiles import user_path

if TYPE_CHECKING:
    from ddp_cli.cli.preflight import Preflight
    from ddp_cli.run.launch import LaunchOptions
    from ddp_cli.train.checkpoint_model import Trained

log = logging.getLogger("ddp")

__all__ = ["Job"]  # cli.py describes a validate or predict job with it


@dataclass(frozen=True)
class LaunchFlags:
    """`ddp train`'s launch flags as given (torchrun's included), before the environment fills in."""

    nproc_per_node: int | None = None
    nnodes: str = "1"
    node_rank: int = 0
    rdzv_endpoint: str | None = None
    rdzv_id: str | None = None
    max_restarts: int | None = None
    standalone: bool = False
    master_addr: str | None = None
    master_port: int | None = None

    def options(self) -> LaunchOptions:
        """The launch options: --master-addr/--master-port as the endpoint; --standalone checked
        against the rest, else SLURM's or Kubeflow's settings fill in what the flags left open."""
        from ddp_cli.run.launch import LaunchOptions, master_endpoint, standalone_checked, with_environment

        endpoint = master_endpoint(self.master_addr, self.master_port, self.rdzv_endpoint)
        opts = LaunchOptions(self.nproc_per_node, node_rank=self.node_rank, rdzv_endpoint=endpoint,
                             rdzv_id=self.rdzv_id, max_restarts=self.max_restarts,
                             **LaunchOptions.nodes(self.nnodes))
        return standalone_checked(opts) if self.standalone else with_environment(opts)


@contextmanager
def indexed(config: Path, overrides: list[str],
            registry: str | None) -> Iterator[tuple[RunConfig, IndexBuild]]:
    """The run config and its index, building in a process of its own while this one imports torch
    (under an external torchrun only rank 0 needs it; a Kubeflow pod's RANK counts pods: each needs it)."""
    from ddp_cli.run.schedulers import under_agent

    cfg = load_config(config, overrides)
    fork = not under_agent(os.environ) or os.environ.get("RANK", "0") == "0"
    with IndexBuild.begin(cfg, registry, fork=fork) as build:
        yield cfg, build


def train(config: Path, overrides: list[str], registry: str | None, run_dir: Path | str | None,
          flags: LaunchFlags, resume: str, quiet: bool) -> dict[str, Any]:
    """`ddp train`: the result of the run (empty on the ranks but 0 of an external torchrun)."""
    resume = local_checkpoint(resume, "--resume") if resume.startswith("s3:/") else resume
    with indexed(config, overrides, registry) as (cfg, build):
        configured = Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else None
        run_dir = run_dir or run_location(configured, "checkpoint.dir")
        return launch_training(cfg, build, run_dir, flags.options(), resume, quiet)


def dry_run(config: Path, overrides: list[str], registry: str | None, flags: LaunchFlags,
            resume: str) -> dict[str, Any]:
    """`ddp train --dry-run`: the plan, after every check training makes before starting workers."""
    with indexed(config, overrides, registry) as (cfg, build):
        return plan(cfg, build, flags.options(), resume)


def run_location(path: Path | None, flag: str) -> Path | str | None:
    """`path`, or the s3:// URL it spells (a Path keeps `s3://bucket/x` as `s3:/bucket/x`): a run dir in
    object storage (run.bucket). Other URLs are refused: a run would land in a local folder named after
    them while its user believes it is remote."""
    text = str(path) if path is not None else ""
    if re.match(r"s3:/", text):
        return RunBucket(re.sub(r"^s3:/+", "s3://", text)).url  # checked: a bucket and a prefix
    if re.match(r"[A-Za-z][A-Za-z0-9+.-]*:/", text):
        url = re.sub(r"^([^:]+):/+", r"\1://", text)
        raise ConfigError(f"{flag} {url}: ddp writes runs to a folder or to s3://BUCKET/PREFIX/NAME; give "
                          "one of those (a volume the storage is mounted on works)")
    return path


def local_checkpoint(path: str | Path, flag: str = "--checkpoint") -> str:
    """`path`, or where the checkpoint its s3:// URL names was downloaded to (checked against its
    manifest: run.pull)."""
    url = run_location(Path(path), flag)
    if isinstance(url, str):
        from ddp_cli.run.pull import fetch_checkpoint

        return str(fetch_checkpoint(url, flag))
    return str(path)


def default_run_dir(cfg: RunConfig) -> Path:
    return Path("runs") / f"{cfg.name}-{datetime.now():%Y%m%d-%H%M%S}"


def prepare_run(run: Preflight, run_dir: Path | str | None, quiet: bool) -> Path:
    """The run directory, holding everything the workers need (`jobs.prepare_job`); for a run dir in a
    bucket, its staging folder, emptied and filled from the bucket (`pull.stage`)."""
    from ddp_cli.cli.preflight import warn_if_disk_short

    bucket = bucket_of(run_dir)
    if bucket:
        from ddp_cli.run.pull import stage

        run_dir = staging_folder(bucket)
        stage(RunBucket(bucket), run_dir, run.resume)
    folder = (run_dir or default_run_dir(run.cfg)).resolve()
    warn_if_disk_short(run, folder)
    prepare_job(folder, run.cfg, run.entry, run.index, Job("train", quiet, resume=run.resume, bucket=bucket))
    return folder


def published(result: dict[str, Any], run_dir: Path | str | None, folder: Path,
              node_rank: int = 0) -> dict[str, Any]:
    """`result` of a run dir in a bucket: its files uploaded a last time (rank logs, result.json: what
    the workers wrote after their last upload; from another node than rank 0's, its ranks' logs only),
    and its places named in the bucket."""
    bucket = bucket_of(run_dir)
    if not bucket:
        return result
    from ddp_cli.run.bucket import PER_RANK
    from ddp_cli.run.mirror import upload_files

    upload_files(RunBucket(bucket), folder, {}, PER_RANK if node_rank else ())
    return {**result, "run_dir": bucket, "checkpoint": f"{bucket}/checkpoints/last.pt"}


def upload_after_failure(run_dir: Path | str | None, folder: Path) -> None:
    """A failed run's logs and error records to its bucket, where they can be read; an upload that
    fails too is only warned of (the run's own error is the one to show)."""
    bucket = bucket_of(run_dir)
    if not bucket:
        return
    from ddp_cli.run.bucket import PER_RANK
    from ddp_cli.run.mirror import upload_files

    try:
        upload_files(RunBucket(bucket), folder, {}, PER_RANK)
    except DdpError as e:
        log.warning("warning: the run's logs are only in %s: %s", folder, e)


def launch_training(cfg: RunConfig, build: IndexBuild, run_dir: Path | str | None, opts: LaunchOptions,
                    resume: str, quiet: bool) -> dict[str, Any]:
    """Check, hand off, launch; the result with where start-up time went (`StartupClock`). The index
    builds beside (`build`): meanwhile this process imports what building the model needs."""
    from ddp_cli.cli.preflight import launch_workers, preflight
    from ddp_cli.models.zoo import import_builders
    from ddp_cli.run.launch import external_launcher, launch, single_threaded

    import_builders(cfg.model.name)
    startup = StartupClock()
    startup.mark("imports")
    if external_launcher():
        return train_under_torchrun(cfg, build, run_dir, resume, quiet, startup)
    single_threaded()
    run = preflight(cfg, build, launch_workers(cfg, opts), resume, startup)
    run_dir = run_dir or default_run_dir(cfg)
    with owned(run_dir, opts.node_rank == 0):
        folder = prepare_run(run, run_dir, quiet)
        startup.mark("hand_off")
        startup.hand_over()
        try:
            start = launch(folder, run.workers.nproc, opts, cfg.distributed)
        except WorkerFailed as e:
            upload_after_failure(run_dir, folder)
            if e.exit_code == PEER_LOST:
                raise PeerLost(f"{e}; {how_to_go_on(folder, bucket=bucket_of(run_dir))}") from None
            raise
        result = {**read_result(folder), "data_workers": run.loaders.as_dict(), "worker_start": start}
        return published(result, run_dir, folder, opts.node_rank)


def owned(run_dir: Path | str, owner: bool, flag: str = "--run-dir") -> AbstractContextManager:
    """The run dir (a folder or an s3:// URL) held by this process for the block (`run.owner`), before
    anything is written into it; `owner` is false on the nodes that join node 0's run."""
    from ddp_cli.run.owner import owning

    if not owner:
        return nullcontext()
    return owning(run_dir if isinstance(run_dir, str) else Path(run_dir).resolve(), flag)


def how_to_go_on(folder: Path, argv: list[str] | None = None, bucket: str | None = None) -> str:
    """What is safe after a lost node, and the command that resumes from it (from the `bucket`, for a
    run dir there: what this node staged may not all have reached it)."""
    from ddp_cli.train.checkpoint import CheckpointStore

    newest = None if bucket else CheckpointStore(folder / "checkpoints", 1).latest_valid()
    kept = f"{newest} is the newest valid checkpoint" if newest else "no checkpoint was written yet"
    kept = f"{bucket} holds every checkpoint uploaded whole" if bucket else kept
    return f"{kept}; to go on, run on every node (each with its own --node-rank): " + \
        resume_command(sys.argv[1:] if argv is None else argv, bucket or folder)


def bucket_of(run_dir: Path | str | None) -> str | None:
    """The s3:// URL of a run dir in a bucket (`run_location` gives those as strings), else None."""
    return run_dir if isinstance(run_dir, str) else None


def resume_command(argv: list[str], folder: Path | str) -> str:
    """This `ddp` command line, pointed at its run dir with --resume auto (a rerun without --run-dir
    would start a new run dir, and fresh)."""
    kept, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in ("--run-dir", "--resume"):
            skip = True
        elif not arg.startswith(("--run-dir=", "--resume=")):
            kept.append(arg)
    return shlex.join(["ddp", *kept, "--run-dir", str(folder), "--resume", "auto"])


def train_under_torchrun(cfg: RunConfig, build: IndexBuild, run_dir: Path | str | None,
                         resume: str, quiet: bool, startup: StartupClock) -> dict[str, Any]:
    """Started by an external torchrun: rank 0 checks and prepares the run dir, every rank trains."""
    import torch.distributed as dist

    from ddp_cli.cli.preflight import joined_workers, preflight
    from ddp_cli.distributed.setup import setup
    from ddp_cli.run.worker import run_job

    ctx = setup(cfg.distributed.backend, cfg.distributed.timeout_s)
    startup.mark("process_group")
    folder, run = [None], None
    with ExitStack() as held:
        if ctx.is_main:
            run = preflight(cfg, build, joined_workers(cfg, ctx), resume, startup)
            run_dir = run_dir or default_run_dir(cfg)
            held.enter_context(owned(run_dir, True))
            folder[0] = str(prepare_run(run, run_dir, quiet))
            startup.mark("hand_off")
        dist.broadcast_object_list(folder, src=0)
        code = run_job(Path(folder[0]), startup)
        if code:
            if run:
                upload_after_failure(run_dir, Path(folder[0]))
            raise WorkerFailed("", code)
        if not run:
            return {}
        result = {**read_result(Path(folder[0])), "data_workers": run.loaders.as_dict()}
        return published(result, run_dir, Path(folder[0]))


def plan(cfg: RunConfig, build: IndexBuild, opts: LaunchOptions, resume: str) -> dict[str, Any]:
    """--dry-run: the checks `train` makes before starting workers, the plan they computed, and the
    scheduler whose variables filled the launch (`schedulers`: which, and each variable read)."""
    from ddp_cli.cli.plan import describe
    from ddp_cli.cli.preflight import launch_workers, preflight
    from ddp_cli.run.schedulers import recognise

    return {**describe(preflight(cfg, build, launch_workers(cfg, opts), resume)),
            **recognise(os.environ).as_dict()}


def validate(job: Job, config: Path | None, dataset: str | None, registry: str | None,
             nproc_per_node: int, batch_size: int | None, precision: str | None = None) -> dict[str, Any]:
    """Evaluate a checkpoint on the whole val split with any number of workers; the CSV files and the
    run's evaluation file (with --per-class) are written by rank 0."""
    from ddp_cli.cli.preflight import choose_node_loaders, validation_workers
    from ddp_cli.run.launch import LaunchOptions, single_threaded
    from ddp_cli.train.checkpoint_model import load_trained, warn_if_changed

    opts = LaunchOptions(nproc_per_node)
    single_threaded()
    given, job.checkpoint = job.checkpoint, local_checkpoint(job.checkpoint)
    trained = load_trained(job.checkpoint, job.weights, load_config(config) if config else None)
    job.weights = trained.weights  # "auto" made concrete: what the workers load and the files are named by
    warn_if_changed(trained.cfg.model, trained.path)
    cfg = inference_config(trained, batch_size, dataset, precision)
    workers, model = validation_workers(cfg, len(trained.classes), opts)
    stored = None if dataset or registry else DatasetEntry.model_validate(trained.dataset)
    entry, index = resolve_dataset(cfg, registry, trained.classes, ("val",), stored)
    cfg = cfg.resolved(choose_node_loaders(cfg, workers, entry, index, model, "val").settings())
    job.checkpoint = str(Path(job.checkpoint).resolve())
    job.confusion, job.predictions = writable(job.confusion, "--confusion"), writable(job.predictions,
                                                                                    "--predictions")
    job.evaluation = evaluation_file(Path(job.checkpoint), job.weights) if job.per_class else None
    outputs = {"--predictions": job.predictions, "--confusion": job.confusion, "--per-class": job.evaluation}
    run_dirs: dict[Path, str] = {}  # a run dir that validate writes into is held as a run holds it
    for flag, path in outputs.items():
        if path and run_dir_of(Path(path)):
            run_dirs.setdefault(run_dir_of(Path(path)), f"{flag} into run dir")
    with ExitStack() as held:
        for folder, flag in run_dirs.items():
            held.enter_context(owned(folder, True, flag))
        result = run_inference(job, cfg, entry, index, workers.nproc, opts)
    files = {"confusion": job.confusion, "predictions": job.predictions, "evaluation": job.evaluation}
    named = {"checkpoint": run_location(Path(given), "--checkpoint")} if given.startswith("s3:/") else {}
    return {**result, **{key: path for key, path in files.items() if path}, **named}


def inference_config(trained: Trained, batch_size: int | None, dataset: str | None,
                     precision: str | None = None) -> RunConfig:
    """The checkpoint's config with the command's --batch-size, --dataset and --precision, chosen for
    the machine this command runs on, not the one that trained: backend "auto" (a run trained with
    nccl validates on a laptop) and the precision `inference_precision` picks."""
    chosen = inference_precision(precision, trained.cfg.train.precision)
    changes: dict[str, object] = {"distributed.backend": "auto", "train.precision": chosen}
    changes |= {"data.batch_size": batch_size} if batch_size else {}
    return trained.cfg.resolved(changes | ({"data.dataset": dataset} if dataset else {}), str(trained.path))


def inference_precision(requested: str | None, trained: str) -> str:
    """--precision, else the checkpoint's where this machine computes it natively (its numbers
    then match training's), else "auto": this machine's own choice (fp16 needs CUDA; bf16 where it
    is emulated is slower than fp32 and no closer to it)."""
    import torch

    from ddp_cli.distributed.setup import cuda_devices
    from ddp_cli.train.precision import runs_natively

    device = torch.device("cuda" if cuda_devices() else "cpu")
    if requested == "fp16" and device.type != "cuda":
        raise ConfigError('--precision fp16: needs a CUDA GPU and this machine has none; use "auto", '
                          '"fp32" or "bf16"')
    if requested:
        return requested
    return trained if runs_natively(trained, device) else "auto"


def run_inference(job: Job, cfg: RunConfig, entry: DatasetEntry, index: IndexTable, nproc: int,
                  opts: LaunchOptions, keep: str | None = None) -> dict[str, Any]:
    """Launch a validate or predict job in a temporary folder; its result (and the file `keep`). The
    folder is removed unless a bug stopped the job: its message names the traceback in the folder's logs."""
    from ddp_cli.run.launch import launch

    job_dir, bug = Path(tempfile.mkdtemp(prefix=f"ddp-{job.mode}-")), False
    try:
        prepare_job(job_dir, cfg, entry, index, job)
        launch(job_dir, nproc, opts, cfg.distributed)
        result = read_result(job_dir)
        if keep:
            result[keep] = (job_dir / keep).read_text()
        return result
    except WorkerFailed as e:
        bug = e.exit_code == INTERNAL
        raise
    finally:
        if not bug:
            shutil.rmtree(job_dir, ignore_errors=True)


def writable(path: str | None, flag: str) -> str | None:
    """`path` made absolute, its folder created: a bad path fails before any worker starts."""
    if not path:
        return None
    target = Path(user_path(path, flag)).resolve()
    try:
        with writing(target):  # a read-only disk, no permission: exit 6 as when the file is written
            target.parent.mkdir(parents=True, exist_ok=True)
        folder = target.is_dir()
    except OSError as e:  # a file where a folder must be, a name too long
        raise ConfigError(f"{flag} {path}: cannot write there ({e.strerror}); choose another file") from e
    if folder:
        raise ConfigError(f"{flag} {path}: is a folder; give a file name, e.g. {path}/out.csv")
    return str(target)


def run_dir_of(path: Path) -> Path | None:
    """The run dir a file written by a command lies in (its folder, or the folder above: `evaluations/`),
    known by its metrics.jsonl or its lock; None elsewhere."""
    from ddp_cli.run.owner import LOCK

    for folder in (path.parent, path.parent.parent):
        if (folder / "metrics.jsonl").is_file() or (folder / LOCK).is_file():
            return folder
    return None


def evaluation_file(checkpoint: Path, weights: str) -> str | None:
    """`<run>/evaluations/<checkpoint stem>-<weights>.json` when the checkpoint lies in a run dir
    (what `ddp report` draws); None for a checkpoint elsewhere."""
    run_dir = checkpoint.parent.parent
    if checkpoint.parent.name != "checkpoints" or not (run_dir / "metrics.jsonl").is_file():
        return None
    return writable(str(run_dir / "evaluations" / f"{checkpoint.stem}-{weights}.json"), "evaluation")


def predict(job: Job, inputs: list[str], dataset: str | None, split: str, registry: str | None,
            nproc_per_node: int, batch_size: int | None,
            precision: str | None = None) -> list[dict[str, Any]]:
    """Top-k classes for every input image (files, folders, S3 objects or a data set split), in order;
    a bad image is an entry with its error."""
    from ddp_cli.cli.preflight import choose_node_loaders, validation_workers
    from ddp_cli.run.launch import LaunchOptions, single_threaded
    from ddp_cli.train.checkpoint_model import load_trained, warn_if_changed

    opts = LaunchOptions(nproc_per_node)
    single_threaded()
    job.checkpoint = local_checkpoint(job.checkpoint)
    trained = load_trained(job.checkpoint, job.weights)
    job.weights = trained.weights
    warn_if_changed(trained.cfg.model, trained.path)
    cfg = inference_config(trained, batch_size, dataset, precision)
    workers, model = validation_workers(cfg, len(trained.classes), opts)
    entry, index = predict_inputs(cfg, trained, inputs, dataset, split, registry)
    cfg = cfg.resolved(choose_node_loaders(cfg, workers, entry, index, model, "val").settings())
    job.checkpoint = str(Path(job.checkpoint).resolve())
    result = run_inference(job, cfg, entry, index, workers.nproc, opts, keep="predictions.jsonl")
    return [json.loads(line) for line in result["predictions.jsonl"].splitlines()]


def predict_inputs(cfg: RunConfig, trained: Trained, inputs: list[str], dataset: str | None, split: str,
                   registry: str | None) -> tuple[DatasetEntry, IndexTable]:
    """The inputs as a one-split index ("val": what the job reads) with the checkpoint's classes."""
    if dataset:
        if inputs:
            raise ConfigError("INPUT and --dataset: give image files/folders or a data set split, not both")
        entry, index = resolve_dataset(cfg, registry, trained.classes, (split,))
        return entry, IndexTable(index.classes, index.descriptions, {"val": index.splits[split]})
    if not inputs:
        raise ConfigError("no INPUT: give image files, folders or s3:// URLs, or --dataset NAME --split val")
    root = input_root(inputs)
    driver = "S3" if root.startswith("s3://") else "FileSystem"
    entry = DatasetEntry(name="inputs", layout="imagefolder", storage={"driver": driver, "path": root})
    fs, fs_root = s3_filesystem(entry.storage, "check the INPUT URLs") if driver == "S3" else entry.open()
    split_rows = expand_inputs(fs, fs_root, inputs)
    return entry, IndexTable(trained.classes, trained.descriptions, {"val": split_rows})


def datasets_list(registry: str | None) -> list[dict[str, Any]]:
    return [
        {"name": d.name, "driver": d.storage.driver, "path": d.storage.path,
         "layout": d.layout, "description": d.description}
        for d in load_registry(registry).datasets
    ]


def datasets_show(name: str, registry: str | None) -> dict[str, Any]:
    """The registry entry (no credentials: the registry holds none) and what its index holds."""
    entry = load_registry(registry).get(name)
    fs, root = entry.open()
    index = build_index(fs, root, entry.layout, options=entry.layout_options)
    packed = {"packed": describe_shards(read_index(fs, root))} if entry.layout == SHARDS else {}
    return {
        **entry.model_dump(mode="json", exclude_none=True, exclude={"storage"}),
        "storage": entry.storage.model_dump(mode="json", exclude_defaults=True),
        **packed,
        "splits": index.counts(),
        "classes": [{"index": i, "synset": synset, "description": text}
                    for i, (synset, text) in enumerate(zip(index.classes, index.descriptions, strict=True))],
    }


def datasets_check(name: str, registry: str | None, split: str, workers: int | None,
                   progress: Callable[[int, int], None] | None = None) -> dict[str, Any]:
    """`check_dataset` on the registry entry; `split` is train, val or all."""
    from ddp_cli.data.pipeline.check import check_dataset

    splits = ("train", "val") if split == "all" else (split,)
    entry = load_registry(registry).get(name)
    fs, root = entry.open()
    return {"name": entry.name, "root": entry.storage.path,
            **check_dataset(fs, root, entry.layout, splits, workers, progress, entry.layout_options)}


def datasets_pack(name: str, to: str, registry: str | None, split: str, settings: dict[str, Any],
                  workers: int, progress: Callable[[int, int], None] | None = None) -> dict[str, Any]:
    """`pack` the registry entry `name` into `to` (`split`: train, val or all: both, and the entry's
    `unlabeled` split when it names one); `settings` are `PackOptions`' (max_side, quality, shard_mib,
    on_bad_image)."""
    from ddp_cli.data.pack.writer import PackOptions, Source, pack, pack_index

    opts = PackOptions(**settings)
    entry = load_registry(registry).get(name)
    splits = ("train", "val", *((UNLABELED,) if entry.unlabeled else ())) if split == "all" else (split,)
    fs, root = entry.open()
    if entry.layout == SHARDS:
        raise ConfigError(f"data set {name!r} is packed already (layout shards); pack its source instead")
    index = pack_index(fs, root, entry.layout, splits, opts.on_bad_image, entry.layout_options,
                       entry.unlabeled)
    source = Source(fs, root, entry.name, entry.layout, entry.storage.path)
    return pack(source, index, to, replace(opts, splits=splits), workers, progress)


def datasets_index(root: str, splits: dict[str, str], classes: str | None,
                   progress: Callable[[int, int], None] | None = None) -> dict[str, Any]:
    """Index tar shards written by the webdataset library, so `layout = "shards"` reads them."""
    from ddp_cli.data.pack.wds_index import index_shards

    return index_shards(root, splits, classes, progress)


def env() -> dict[str, Any]:
    """`ddp env`: this machine (`envinfo.machine`) and what "auto" picks on it."""
    from ddp_cli.cli.envinfo import machine

    return {**machine(), **auto_choices()}


def auto_choices() -> dict[str, Any]:
    """What `ddp train` with `precision`, `backend` and `nproc_per_node` "auto" (and no flags) starts
    here, through the function it calls (`launch_workers`), so the two agree by construction."""
    from ddp_cli.cli.preflight import launch_workers
    from ddp_cli.run.launch import LaunchOptions, with_environment

    cfg = RunConfig(train=TrainConfig(precision="auto"))  # distributed.* are "auto" by default
    try:
        workers = launch_workers(cfg, with_environment(LaunchOptions()))
    except ConfigError as e:  # e.g. SLURM promising more GPUs than this node shows
        return {"precision_auto": None, "backend_auto": None, "nproc_per_node_auto": None,
                "auto_refused": str(e)}
    return {"precision_auto": workers.precision, "backend_auto": workers.backend,
            "nproc_per_node_auto": workers.nproc}


def export(checkpoint: Path, fmt: str, weights: str, out: Path) -> dict[str, Any]:
    """`ddp export`: the checkpoint's weights in `fmt`, with a model card beside them."""
    from ddp_cli.models.export import export_checkpoint

    return export_checkpoint(Path(local_checkpoint(checkpoint)), fmt, weights, out)


def report(run_dir: Path, out: Path | None) -> dict[str, Any]:
    """`ddp report`: the run summarised, its curves drawn to `out` (and any per-class picture beside)."""
    url = run_location(run_dir, "RUN_DIR")
    if isinstance(url, str):
        return report_from_bucket(RunBucket(url), out)
    summary = summarize(run_dir)
    png = out or run_dir / "report.png"
    summary["plot"] = str(plot(run_dir, png))
    drawn = classes.plot(run_dir, classes_png(png))
    summary["classes_plot"] = str(drawn) if drawn else None
    return summary


def report_from_bucket(bucket: RunBucket, out: Path | None) -> dict[str, Any]:
    """`ddp report s3://...`: the run's files downloaded to a temporary folder and drawn there; the
    pictures uploaded beside the run (report.png, as a local run gets it), or written to `out`."""
    with tempfile.TemporaryDirectory(prefix="ddp-report-") as tmp:
        folder = Path(tmp) / "run"
        if not bucket.download_files(folder):
            raise DataError(f"{bucket.url}: no run there (no files under it); give the --run-dir of a run")
        summary = report(folder, out)
        if out is None:
            for picture in sorted(folder.glob("report*.png")):
                bucket.put(picture, picture.name)
        return json.loads(json.dumps(summary).replace(str(folder), bucket.url))


def init(folder: Path) -> dict[str, Any]:
    """`ddp init`: the starter run config and data.toml written into `folder`."""
    return write_starter(folder)


def config_show(config: Path, overrides: list[str], fmt: str) -> str:
    """The resolved run config as TOML (every default, unset keys commented) or one JSON line."""
    if fmt not in ("toml", "json"):
        raise ConfigError(f"--format {fmt}: use toml or json")
    source = " ".join([str(config), *(f"--set {item}" for item in overrides)])
    return render(load_config(config, overrides), fmt, source)


def config_schema() -> dict[str, Any]:
    """The run config's JSON schema."""
    return schema()
