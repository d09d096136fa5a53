"""What is done with a trained checkpoint: `ddp validate` (the whole val split, exactly), `ddp predict`
(top-k classes of images or a data set's split), each a job of workers in a temporary folder, and
`ddp export` (its weights for other programs).
"""

from __future__ import annotations

import json
import shutil
import tempfile
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ddp_cli.cli.commands.run_dirs import local_checkpoint, owned, run_dir_of, run_location
from ddp_cli.config import RunConfig, load_config
from ddp_cli.data.fetch.storage import s3_filesystem
from ddp_cli.data.index_build import resolve_dataset
from ddp_cli.data.registry import DatasetEntry
from ddp_cli.data.sources.inputs import expand_inputs, input_root
from ddp_cli.data.sources.table import IndexTable
from ddp_cli.errors import INTERNAL, ConfigError, WorkerFailed
from ddp_cli.io import writing
from ddp_cli.models.user_model import with_located_model
from ddp_cli.run.jobs import Job, prepare_job, read_result
from ddp_cli.userfiles import user_path

if TYPE_CHECKING:
    from ddp_cli.run.launch import LaunchOptions
    from ddp_cli.train.checkpoint_model import Trained

__all__ = ["Job"]  # cli/ddp.py describes a validate or predict job with it


def validate(job: Job, config: Path | None, dataset: str | None, registry: str | None,
             nproc_per_node: int, batch_size: int | None, precision: str | None = None) -> dict[str, Any]:
    """Evaluate a checkpoint on the whole val split with any number of workers; the CSV files and the
    run's evaluation file (with --per-class) are written by rank 0."""
    from ddp_cli.preflight import resolved_for_inference, validation_workers
    from ddp_cli.run.launch import LaunchOptions, single_threaded
    from ddp_cli.train.checkpoint_model import load_trained, warn_if_changed

    opts = LaunchOptions(nproc_per_node)
    single_threaded()
    given, job.checkpoint = job.checkpoint, local_checkpoint(job.checkpoint)
    trained = load_trained(job.checkpoint, job.weights,
                           with_located_model(load_config(config), config) if config else None)
    job.weights = trained.weights  # "auto" made concrete: what the workers load and the files are named by
    warn_if_changed(trained.cfg.model, trained.path)
    cfg = inference_config(trained, batch_size, dataset, precision)
    workers, model = validation_workers(cfg, len(trained.classes), opts)
    stored = None if dataset or registry else DatasetEntry.model_validate(trained.dataset)
    entry, index = resolve_dataset(cfg, registry, trained.classes, ("val",), stored)
    cfg = resolved_for_inference(cfg, workers, entry, index, model, "val")
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
    from ddp_cli.preflight import resolved_for_inference, validation_workers
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
    cfg = resolved_for_inference(cfg, workers, entry, index, model, "val")
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


def export(checkpoint: Path, fmt: str, weights: str, out: Path) -> dict[str, Any]:
    """`ddp export`: the checkpoint's weights in `fmt`, with a model card beside them."""
    from ddp_cli.train.export import export_checkpoint

    return export_checkpoint(Path(local_checkpoint(checkpoint)), fmt, weights, out)
