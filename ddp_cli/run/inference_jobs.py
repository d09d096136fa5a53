"""The validate and predict jobs: a checkpoint's weights over a split on every rank (`train.inference`
does the passes), and what rank 0 writes of the answers."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ddp_cli.config import RunConfig
from ddp_cli.data.pipeline.loaders import build_loaders, eval_loader
from ddp_cli.data.pipeline.transforms import normalising
from ddp_cli.data.registry import DatasetEntry
from ddp_cli.data.sources.table import IndexTable
from ddp_cli.distributed.setup import DistContext
from ddp_cli.io import write_text
from ddp_cli.run.jobs import Job
from ddp_cli.train.checkpoint_model import load_trained
from ddp_cli.train.eval_outputs import evaluation_record, write_confusion, write_evaluation, write_predictions
from ddp_cli.train.inference import evaluate, predict
from ddp_cli.train.metrics import EvalTotals
from ddp_cli.train.precision import check_precision


def inference_setup(cfg: RunConfig, ctx: DistContext, job: Job) -> tuple[nn.Module, str]:
    """The checkpoint's chosen weights on this rank's device, and the precision to run them in."""
    model = load_trained(job.checkpoint, job.weights, cfg).build()
    model.to(ctx.device, memory_format=torch.channels_last if cfg.model.channels_last
             else torch.preserve_format)
    check_precision(cfg.train.precision, ctx.device)
    return model, cfg.train.precision


def validate_job(cfg: RunConfig, ctx: DistContext, entry: DatasetEntry, index: IndexTable,
                 job: Job) -> dict[str, Any]:
    """The checkpoint over the whole val split; rank 0 writes the files asked for."""
    model, precision = inference_setup(cfg, ctx, job)
    fs, root = entry.open()
    loaders = build_loaders(cfg.data, fs, root, index, ctx.rank, ctx.world_size, cfg.seed,
                            pin_memory=ctx.device.type == "cuda", train=False, augment=cfg.augment)
    totals = evaluate(model, loaders.val, ctx.device, precision, cfg.model.channels_last,
                      topk=tuple(job.topk), tta=job.tta, keep_topk=max(job.topk) if job.predictions else 0,
                      norm=normalising(cfg.data))
    about = {"checkpoint": job.checkpoint, "dataset": entry.name, "split": "val", "weights": job.weights}
    if ctx.is_main:
        write_validation_files(job, totals, entry, index, about)
    per_class = {"per_class": totals.per_class(index.classes, index.descriptions)} if job.per_class else {}
    return {**about, "world_size": ctx.world_size, **({"tta": "flip"} if job.tta else {}), **totals.metrics,
            **per_class}


def write_validation_files(job: Job, totals: EvalTotals, entry: DatasetEntry, index: IndexTable,
                           about: dict[str, Any]) -> None:
    if job.confusion:
        write_confusion(Path(job.confusion), totals, index.classes, index.descriptions)
    if job.predictions:
        write_predictions(Path(job.predictions), totals, entry.storage.path.rstrip("/"),
                          index.splits["val"].paths, index.classes)
    if job.evaluation:
        source = f"validate {Path(job.checkpoint).name} --weights {job.weights}"
        write_evaluation(Path(job.evaluation), evaluation_record(
            totals, index.classes, index.descriptions, source=source, **about))


def predict_job(cfg: RunConfig, ctx: DistContext, folder: Path, entry: DatasetEntry, index: IndexTable,
                job: Job, writes: bool) -> dict[str, Any]:
    """Top-k answers for every input (its error for a bad one); the job folder's writers (each node's
    first rank, `run.writers`) write them all to `predictions.jsonl` there, in input order."""
    model, precision = inference_setup(cfg, ctx, job)
    fs, root = entry.open()
    split = index.splits["val"]
    loader = eval_loader(cfg.data, fs, root, split, ctx.rank, ctx.world_size, cfg.seed,
                         pin_memory=ctx.device.type == "cuda", on_bad_image="report",
                         interpolation=cfg.augment.interpolation)
    rows = predict(model, loader, ctx.device, precision, cfg.model.channels_last, job.topk[0],
                   normalising(cfg.data))
    if writes:
        prefix = entry.storage.path.rstrip("/")
        lines = [json.dumps(answer(f"{prefix}/{split.paths[position]}", int(split.labels[position]), error,
                                   top, probs, index)) for position, error, top, probs in rows]
        write_text(folder / "predictions.jsonl", "".join(line + "\n" for line in lines))
    return {"images": len(rows), "errors": sum(1 for row in rows if row[1])}


def answer(path: str, label: int, error: str, top: list[int], probs: list[float],
           index: IndexTable) -> dict[str, Any]:
    """One input's line of `predict --json`: its path (and label, when it comes from a data set split),
    then its top-k classes or its error."""
    known = {"label": {"index": label, "synset": index.classes[label]}} if label >= 0 else {}
    if error:
        return {"path": path, **known, "error": error}
    return {"path": path, **known, "topk": [
        {"index": i, "synset": index.classes[i], "description": index.descriptions[i], "probability": p}
        for i, p in zip(top, probs, strict=True)]}
