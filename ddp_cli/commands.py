"""What each command does, without Typer: resolve inputs, launch workers, return results."""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch import nn

from ddp_cli.config import RunConfig, config_from_dict, load_config
from ddp_cli.data.layouts import IndexTable, build_index
from ddp_cli.distributed.setup import setup
from ddp_cli.errors import ConfigError, WorkerFailed
from ddp_cli.models import check_model
from ddp_cli.plan import describe
from ddp_cli.registry import DatasetEntry, load_registry
from ddp_cli.run.jobs import Job, prepare_job, read_result
from ddp_cli.run.launch import LaunchOptions, external_launcher, launch, resolve_nproc
from ddp_cli.run.worker import run_job
from ddp_cli.train.checkpoint import load_checkpoint


def resolve_dataset(
    cfg: RunConfig, registry: str | None, classes: list[str] | None = None, splits=("train", "val")
) -> tuple[DatasetEntry, IndexTable]:
    """Registry entry and index table (built once per run, here in the launcher: a row naming an
    unsafe path stops the run here under on_bad_image = "error", before any worker starts)."""
    entry = load_registry(registry).get(cfg.data.dataset)
    fs, root = entry.open()
    index = build_index(fs, root, entry.layout, classes or cfg.data.classes, splits, cfg.data.on_bad_image)
    for split, frame in index.splits.items():
        if frame.empty:
            raise ConfigError(f"data set {entry.name!r}: the {split} split has no images "
                              "(check data.classes and the root)")
    return entry, index


def checked_model(cfg: RunConfig, index: IndexTable) -> nn.Module:
    """Prove the model fits the run before any worker starts (`models.check_model`).

    `model.weights` becomes absolute: workers and later resumes may start elsewhere.
    """
    if cfg.model.weights:
        cfg.model.weights = str(Path(cfg.model.weights).expanduser().resolve())
    return check_model(cfg, len(index.classes))


def default_run_dir(cfg: RunConfig) -> Path:
    return Path("runs") / f"{cfg.name}-{datetime.now():%Y%m%d-%H%M%S}"


def checked_resume(resume: str) -> str:
    """auto | never | an existing checkpoint (made absolute); the workers resolve `auto`."""
    if resume in ("auto", "never"):
        return resume
    if not Path(resume).is_file():
        raise ConfigError(f"--resume {resume}: no such checkpoint; use auto, never or a .pt path")
    return str(Path(resume).resolve())


def train(config: Path, overrides: list[str], registry: str | None, run_dir: Path | None,
          opts: LaunchOptions, resume: str, quiet: bool) -> dict[str, Any]:
    cfg = load_config(config, overrides)
    if external_launcher():
        return train_under_torchrun(cfg, registry, run_dir, resume, quiet)
    entry, index = resolve_dataset(cfg, registry)
    checked_model(cfg, index)
    run_dir = (run_dir or default_run_dir(cfg)).resolve()
    nproc = resolve_nproc(opts, cfg.distributed)
    prepare_job(run_dir, cfg, entry, index, Job("train", quiet, resume=checked_resume(resume)))
    launch(run_dir, nproc, opts, cfg.distributed)
    return read_result(run_dir)


def train_under_torchrun(cfg: RunConfig, registry: str | None, run_dir: Path | None,
                         resume: str, quiet: bool) -> dict[str, Any]:
    """Started by an external torchrun: rank 0 prepares the run dir, every rank trains."""
    ctx = setup(cfg.distributed.backend, cfg.distributed.timeout_s)
    folder = [None]
    if ctx.is_main:
        entry, index = resolve_dataset(cfg, registry)
        checked_model(cfg, index)
        folder[0] = str((run_dir or default_run_dir(cfg)).resolve())
        prepare_job(Path(folder[0]), cfg, entry, index, Job("train", quiet, resume=checked_resume(resume)))
    dist.broadcast_object_list(folder, src=0)
    code = run_job(Path(folder[0]))
    if code:
        raise WorkerFailed("", code)
    return read_result(Path(folder[0])) if ctx.is_main else {}


def plan(config: Path, overrides: list[str], registry: str | None,
         opts: LaunchOptions) -> dict[str, Any]:
    """--dry-run: everything `train` would do up to starting workers."""
    cfg = load_config(config, overrides)
    _, index = resolve_dataset(cfg, registry)
    model = checked_model(cfg, index)
    nproc = resolve_nproc(opts, cfg.distributed)
    return describe(cfg, model, {s: len(f) for s, f in index.splits.items()}, len(index.classes),
                    nproc, opts.nnodes)


def validate(checkpoint: Path, config: Path | None, dataset: str | None, registry: str | None,
             opts: LaunchOptions, batch_size: int | None, quiet: bool) -> dict[str, Any]:
    """Evaluate a checkpoint on the whole val split with any number of workers."""
    state = load_checkpoint(checkpoint)
    cfg = load_config(config) if config else config_from_dict(state["config"], str(checkpoint))
    if batch_size:
        cfg.data.batch_size = batch_size
    if dataset or registry:
        cfg.data.dataset = dataset or cfg.data.dataset
        entry, index = resolve_dataset(cfg, registry, state["classes"], splits=("val",))
    else:
        entry = DatasetEntry.model_validate(state["dataset"])
        fs, root = entry.open()
        index = build_index(fs, root, entry.layout, state["classes"], splits=("val",))
    with tempfile.TemporaryDirectory(prefix="ddp-validate-") as tmp:
        job_dir = Path(tmp)
        prepare_job(job_dir, cfg, entry, index, Job("validate", quiet, str(Path(checkpoint).resolve())))
        launch(job_dir, resolve_nproc(opts, cfg.distributed), opts, cfg.distributed)
        return read_result(job_dir)


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
    index = build_index(fs, root, entry.layout)
    return {
        **entry.model_dump(mode="json", exclude_none=True, exclude={"storage"}),
        "storage": entry.storage.model_dump(mode="json", exclude_defaults=True),
        "splits": {split: {"images": len(frame), "classes": int(frame["label"].nunique())}
                   for split, frame in index.splits.items()},
        "classes": [{"index": i, "synset": synset, "description": text}
                    for i, (synset, text) in enumerate(zip(index.classes, index.descriptions, strict=True))],
    }


def datasets_check(name: str, registry: str | None, split: str, workers: int | None,
                   progress: Callable[[int, int], None] | None = None) -> dict[str, Any]:
    """`check_dataset` on the registry entry; `split` is train, val or all."""
    from ddp_cli.data.check import check_dataset

    splits = ("train", "val") if split == "all" else (split,)
    entry = load_registry(registry).get(name)
    fs, root = entry.open()
    return {"name": entry.name, "root": entry.storage.path,
            **check_dataset(fs, root, entry.layout, splits, workers, progress)}
