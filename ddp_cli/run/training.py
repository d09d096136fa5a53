"""A training job, assembled: an identical model on every rank, this rank's loaders, the Trainer with
what ties it to the run dir (checkpoints, metrics, stop signals), the checkpoint it resumes from, and
a check that the replicas hold the same weights before and after `Trainer.fit`."""

from __future__ import annotations

import importlib.util
import logging
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ddp_cli.config import RunConfig
from ddp_cli.data.fetch.retry import IoPolicy
from ddp_cli.data.pipeline.semi import build_semi_loaders
from ddp_cli.data.registry import DatasetEntry
from ddp_cli.data.sources.table import IndexTable
from ddp_cli.distributed.setup import ROUNDS, DistContext, seed_everything
from ddp_cli.distributed.signals import StopRequest, control_group
from ddp_cli.errors import DdpError, WriteError
from ddp_cli.io import write_text
from ddp_cli.models.check import tensors_on_meta
from ddp_cli.models.finetune import freeze
from ddp_cli.models.projection import add_projection
from ddp_cli.models.weights import load_weights
from ddp_cli.models.zoo import build_model
from ddp_cli.observe.console import RunConsole
from ddp_cli.observe.mfu import Utilisation, measure
from ddp_cli.observe.report import plot
from ddp_cli.observe.sinks import build_sinks
from ddp_cli.observe.startup import StartupClock
from ddp_cli.run.as_trained import as_trained
from ddp_cli.run.bucket import RunBucket
from ddp_cli.run.decode_choice import decode_path
from ddp_cli.run.jobs import Job
from ddp_cli.run.mirror import BucketMirror
from ddp_cli.sweep.pruning import epoch_gate
from ddp_cli.train.checkpoint import Checkpointer, CheckpointStore
from ddp_cli.train.eval_outputs import evaluation_record, write_evaluation
from ddp_cli.train.export import export_checkpoint
from ddp_cli.train.trainer import Trainer, count_steps

log = logging.getLogger("ddp")


def weights_fingerprint(model: nn.Module) -> torch.Tensor:
    """Per tensor, the sum and a position-weighted sum of its bits read as integers.

    Integer sums are exact in any order, so any thread count on any node gives
    the same numbers for the same weights, and one flipped bit changes them; no
    float64 copy of the model is made (25 M weights: 0.1 s, not 1 s).
    """
    sums = []
    for tensor in model.state_dict().values():
        if tensor.is_floating_point():
            bits = tensor.detach().contiguous().flatten()
            bits = bits.view(torch.int16 if bits.element_size() == 2 else torch.int32).long()
            position = torch.arange(bits.numel(), device=bits.device).remainder_(97).add_(1)
            sums += [bits.sum(), (bits * position).sum()]
    return torch.stack(sums)


def assert_identical_across_ranks(model: nn.Module, when: str) -> None:
    """All replicas must hold the same weights; a divergence is a bug, not bad luck."""
    mine = weights_fingerprint(model)
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    if any(not torch.equal(everyone[0], other) for other in everyone[1:]):
        raise RuntimeError(f"replicas hold different weights {when}")


def resume_point(job: Job, folder: Path, ctx: DistContext) -> Path | None:
    """Where training continues from, the same on every rank.

    After an elastic restart always the newest valid checkpoint of the run
    (that is the point of restarting); otherwise as --resume says. Rank 0
    decides; others open the same file name in their own node's run dir (shared or a copy,
    `run.writers`).
    """
    choice: list[str | None] = [None]
    restarted = restarted_anywhere(ctx)
    if ctx.rank == 0:
        resume = "auto" if restarted else job.resume
        chosen = chosen_checkpoint(resume, folder)  # auto: by name, in each node's run dir
        choice[0] = None if chosen is None else chosen.name if resume == "auto" else str(chosen)
    dist.broadcast_object_list(choice, src=0)
    if choice[0] is None:
        return None
    path = Path(choice[0])
    return path if path.is_absolute() else folder / "checkpoints" / path


def restarted_anywhere(ctx: DistContext) -> bool:
    """Whether any rank's launcher has restarted its workers. After a node is lost, a node restarts for
    the membership change without raising torch's restart count: a rank's own count is not the group's,
    and the rendezvous its launcher completed (`run.rendezvous`: more than one is a restart) count too."""
    mine = max(int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)), int(os.environ.get(ROUNDS, 1)) - 1)
    counts: list[int | None] = [None] * ctx.world_size
    dist.all_gather_object(counts, mine)
    return max(count or 0 for count in counts) > 0


def chosen_checkpoint(resume: str, folder: Path) -> Path | None:
    """The checkpoint `--resume` names in run dir `folder`: auto, its newest valid one (None where it has
    none); never, None; else the path given. `train --dry-run` shows it."""
    if resume == "auto":
        return CheckpointStore(folder / "checkpoints", 1).latest_valid()
    return None if resume == "never" else Path(resume)


def model_utilisation(cfg: RunConfig, ctx: DistContext, classes: int) -> Utilisation | None:
    """MFU's facts (observe/mfu.py): the model's FLOPs per labelled image at every train crop the run
    takes, counted on a meta-device copy (no memory, nothing computed), and the device's peak. FixMatch
    passes each labelled image through the model with semi.mu unlabelled ones in two views: 1 + 2 mu
    images (its EMA teacher's forward, where on, is not counted); SimCLR each image's two views."""
    with tensors_on_meta():
        model = build_model(cfg.model, classes, cfg.data.image_size)
    freeze(model, cfg.model)  # frozen layers have no weight gradients to count
    sizes = {cfg.data.train_size(epoch) for epoch in range(cfg.train.epochs)}
    images = 1 + 2 * cfg.semi.mu if cfg.semi.on() else 2 if cfg.pretrain.on() else 1
    return measure(model.train(), sizes, ctx.device, cfg.train.precision, ctx.world_size, images)


def build_trainer(cfg: RunConfig, ctx: DistContext, folder: Path, entry: DatasetEntry,
                  index: IndexTable, job: Job, startup: StartupClock, writes: bool) -> Trainer:
    """The worker's Trainer: an identical model on every rank, this rank's loaders, and what ties
    the run to its process (stop signals, checkpoints in the run dir if this rank `writes` them,
    `run.writers`; metrics on rank 0)."""
    seed_everything(cfg.seed, cfg.deterministic)
    model = build_model(cfg.model, len(index.classes), cfg.data.image_size)  # same seed: same weights
    if cfg.model.weights:
        load_weights(model, cfg.model, len(index.classes))
    freeze(model, cfg.model)  # fine-tuning: before DDP wraps it
    if cfg.pretrain.on():  # SimCLR's projection on the features, the classifier frozen
        add_projection(model, cfg.pretrain)
    utilisation = model_utilisation(cfg, ctx, len(index.classes)) if ctx.is_main else None
    startup.mark("model")
    fs, root = entry.open()
    loaders = build_semi_loaders(cfg, fs, root, index, ctx.rank, ctx.world_size,
                                 pin_memory=ctx.device.type == "cuda")
    startup.mark("loaders")
    meta = {"config": cfg.model_dump(mode="json"), "dataset": entry.model_dump(mode="json"),
            "classes": index.classes, "descriptions": index.descriptions}
    mirror = BucketMirror(RunBucket(job.bucket, IoPolicy.of(cfg.data)), folder) \
        if job.bucket and ctx.is_main else None  # the bucket's copy is rank 0's alone
    checkpointer = Checkpointer(CheckpointStore(folder / "checkpoints", cfg.checkpoint.keep_last, mirror),
                                writes=writes, every_steps=cfg.checkpoint.every_steps,
                                stop=StopRequest(control_group(ctx.backend)), meta=meta,
                                background=cfg.checkpoint.background,
                                stop_every=cfg.distributed.stop_check_steps)
    if checkpointer.writes and not ctx.is_main:
        log.info(f"rank {ctx.rank}: the run dir here is not rank 0's (not shared): this node keeps its own "
                 f"copy of the checkpoints in {folder / 'checkpoints'}")
    metrics = build_sinks(cfg.logging, folder, cfg.model_dump(mode="json")) if ctx.is_main else None
    console = RunConsole(ctx.is_main and not job.quiet, cfg.logging.every_steps)
    on_validation = (lambda totals, epoch: write_evaluation(
        folder / "evaluation.json", evaluation_record(
            totals, index.classes, index.descriptions, source=f"train epoch {epoch}", checkpoint=None,
            weights="model", dataset=entry.name, split="val"))) if ctx.is_main else None
    trainer = Trainer(cfg, ctx, model, loaders, count_steps(len(loaders.train), cfg.train),
                      checkpointer, metrics, console, startup,
                      on_validation=on_validation, stop_after_epoch=epoch_gate(ctx), utilisation=utilisation)
    startup.mark("ddp")
    return trainer


def train_job(cfg: RunConfig, ctx: DistContext, folder: Path, entry: DatasetEntry,
              index: IndexTable, job: Job, startup: StartupClock, writes: bool) -> dict[str, Any] | None:
    """Train (None: a finished run, its result.json left as it was); a write the storage refused on the
    way (a checkpoint, metrics) names the checkpoint to resume from."""
    try:
        return train(cfg, ctx, folder, entry, index, job, startup, writes)
    except WriteError as e:
        raise CheckpointStore(folder / "checkpoints", cfg.checkpoint.keep_last).refused(e) from e


def train(cfg: RunConfig, ctx: DistContext, folder: Path, entry: DatasetEntry,
          index: IndexTable, job: Job, startup: StartupClock, writes: bool) -> dict[str, Any] | None:
    """Train from scratch or from the resume point; a resume says what it changes (`Resumed.line`, even
    with --quiet/--json: a run that did not start fresh must say so). A run that has trained every epoch
    asked ends here, training nothing: None, its result.json left as it was (where it has none, one is
    written: the run's figures, no throughput)."""
    checkpoint = resume_point(job, folder, ctx)
    if checkpoint and (kept := as_trained(cfg, ctx, checkpoint)) != cfg:  # before the loaders read it
        cfg = kept
        if writes:
            write_text(folder / "config.toml", cfg.to_toml())
    cfg = decode_path(cfg, ctx, folder, entry, index, writes)  # data.decode "auto": measured
    startup.mark("decode")
    trainer = build_trainer(cfg, ctx, folder, entry, index, job, startup, writes)
    resumed = trainer.resume(checkpoint) if checkpoint else None
    if resumed and ctx.is_main:
        log.info(resumed.line())
    if resumed and resumed.finished:  # every rank alike: no collective follows
        trainer.close()
        return None if (folder / "result.json").is_file() else trainer.summary(0.0)
    try:
        assert_identical_across_ranks(trainer.model.module, "at the start")
        startup.mark("replica_check")
        result = trainer.fit()
        assert_identical_across_ranks(trainer.model.module, "at the end")
        if ctx.is_main:
            attach_artefacts(cfg, folder, trainer)
    finally:
        trainer.close()
    return {
        "run_dir": str(folder),
        "checkpoint": str(folder / "checkpoints" / "last.pt"),
        "restarts": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)),
        **result,
    }


def attach_artefacts(cfg: RunConfig, folder: Path, trainer: Trainer) -> None:
    """[logging.mlflow]'s artefacts, once the last checkpoint is on disk: the exported model (its
    state_dict and card, in `model/`) and the report picture (where matplotlib is installed). One that
    cannot be made is warned of: the run itself succeeded."""
    sink = trainer.metrics.mlflow() if trainer.metrics else None
    if not (sink and cfg.logging.mlflow and cfg.logging.mlflow.log_model):
        return
    trainer.checkpointer.wait()
    try:
        export_checkpoint(folder / "checkpoints" / "last.pt", "state_dict", "model",
                          folder / "model" / "model.pt")
        sink.attach(folder / "model", "model")
        sink.register()
        if importlib.util.find_spec("matplotlib"):
            sink.attach(plot(folder, folder / "report.png"))
    except DdpError as e:
        log.warning(f"warning: logging.mlflow: the run's artefacts were not all made: {e}")
