"""One worker process, started by the elastic agent: forked from the launcher (`forked`) or
spawned as `python -m ddp_cli.run.worker JOB_DIR` (`main`); see `run.launch.worker_start`.

The three ideas of the seeds, in order: prepare (join the group, build loaders
and an identical model on every rank), train (Trainer.fit), and the gradient
averaging that DDP does inside every step.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import signal
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ddp_cli.config import RunConfig
from ddp_cli.data.pipeline.loaders import build_loaders, eval_loader
from ddp_cli.data.sources.table import IndexTable
from ddp_cli.distributed.heartbeat import Heartbeat, describe_loss
from ddp_cli.distributed.setup import DistContext, seed_everything, setup, teardown
from ddp_cli.distributed.signals import StopRequest, control_group
from ddp_cli.errors import INTERNAL, PEER_LOST, SIGINT, DdpError
from ddp_cli.fastexit import exit_if_stuck, exit_now
from ddp_cli.io import write_text
from ddp_cli.models import build_model, freeze, load_weights
from ddp_cli.observe.console import RunConsole
from ddp_cli.observe.sinks import build_sinks
from ddp_cli.observe.startup import StartupClock
from ddp_cli.registry import DatasetEntry
from ddp_cli.run.jobs import Job, read_job, record_error, write_result
from ddp_cli.train.checkpoint import Checkpointer, CheckpointStore
from ddp_cli.train.eval_outputs import evaluation_record, write_confusion, write_evaluation, write_predictions
from ddp_cli.train.inference import evaluate, predict
from ddp_cli.train.metrics import EvalTotals
from ddp_cli.train.precision import resolve_precision
from ddp_cli.train.trained import load_trained
from ddp_cli.train.trainer import Trainer, count_steps

log = logging.getLogger("ddp")
LAUNCHED = "DDP_LAUNCHED"  # set by our launcher for its workers


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
    decides; others open the same file name in their own node's run dir.
    """
    choice: list[str | None] = [None]
    if ctx.rank == 0:
        restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)) > 0
        if restarted or job.resume == "auto":
            latest = CheckpointStore(folder / "checkpoints", 1).latest_valid()
            choice[0] = latest.name if latest else None
        elif job.resume != "never":
            choice[0] = job.resume
    dist.broadcast_object_list(choice, src=0)
    if choice[0] is None:
        return None
    path = Path(choice[0])
    return path if path.is_absolute() else folder / "checkpoints" / path


def build_trainer(cfg: RunConfig, ctx: DistContext, folder: Path, entry: DatasetEntry,
                  index: IndexTable, job: Job, startup: StartupClock) -> Trainer:
    """The worker's Trainer: an identical model on every rank, this rank's loaders, and what ties
    the run to its process (stop signals, checkpoints in the run dir, metrics on rank 0)."""
    seed_everything(cfg.seed, cfg.deterministic)
    model = build_model(cfg.model, len(index.classes), cfg.data.image_size)  # same seed: same weights
    if cfg.model.weights:
        load_weights(model, cfg.model, len(index.classes))
    freeze(model, cfg.model)  # fine-tuning: before DDP wraps it
    startup.mark("model")
    fs, root = entry.open()
    loaders = build_loaders(cfg.data, fs, root, index, ctx.rank, ctx.world_size, cfg.seed,
                            pin_memory=ctx.device.type == "cuda", augment=cfg.augment)
    startup.mark("loaders")
    meta = {"config": cfg.model_dump(mode="json"), "dataset": entry.model_dump(mode="json"),
            "classes": index.classes, "descriptions": index.descriptions}
    checkpointer = Checkpointer(CheckpointStore(folder / "checkpoints", cfg.checkpoint.keep_last),
                                writes=ctx.local_rank == 0, every_steps=cfg.checkpoint.every_steps,
                                stop=StopRequest(control_group(ctx.backend)), meta=meta,
                                background=cfg.checkpoint.background)
    metrics = build_sinks(cfg.logging, folder, cfg.model_dump(mode="json")) if ctx.is_main else None
    console = RunConsole(ctx.is_main and not job.quiet, cfg.logging.every_steps)
    trainer = Trainer(cfg, ctx, model, loaders, count_steps(len(loaders.train), cfg.train),
                      checkpointer, metrics, console, startup)
    if ctx.is_main:
        trainer.on_validation = lambda totals, epoch: write_evaluation(
            folder / "evaluation.json", evaluation_record(
                totals, index.classes, index.descriptions, source=f"train epoch {epoch}", checkpoint=None,
                weights="model", dataset=entry.name, split="val"))
    startup.mark("ddp")
    return trainer


def train_job(cfg: RunConfig, ctx: DistContext, folder: Path, entry: DatasetEntry,
              index: IndexTable, job: Job, startup: StartupClock) -> dict[str, Any]:
    trainer = build_trainer(cfg, ctx, folder, entry, index, job, startup)
    checkpoint = resume_point(job, folder, ctx)
    if checkpoint:
        trainer.resume(checkpoint)
        if ctx.is_main:  # said even with --quiet/--json: a run that did not start fresh must say so
            log.info(f"resumed from {checkpoint} (epoch {trainer.state.epoch + 1}, "
                     f"step {trainer.state.step})")
    try:
        assert_identical_across_ranks(trainer.model.module, "at the start")
        startup.mark("replica_check")
        result = trainer.fit()
        assert_identical_across_ranks(trainer.model.module, "at the end")
    finally:
        trainer.close()
    return {
        "run_dir": str(folder),
        "checkpoint": str(folder / "checkpoints" / "last.pt"),
        "restarts": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)),
        **result,
    }


def inference_setup(cfg: RunConfig, ctx: DistContext, job: Job) -> tuple[nn.Module, str]:
    """The checkpoint's chosen weights on this rank's device, and the precision to run them in."""
    model = load_trained(job.checkpoint, job.weights, cfg).build()
    model.to(ctx.device, memory_format=torch.channels_last if cfg.model.channels_last
             else torch.preserve_format)
    return model, resolve_precision(cfg.train.precision, ctx.device)


def validate_job(cfg: RunConfig, ctx: DistContext, entry: DatasetEntry, index: IndexTable,
                 job: Job) -> dict[str, Any]:
    """The checkpoint over the whole val split; rank 0 writes the files asked for."""
    model, precision = inference_setup(cfg, ctx, job)
    fs, root = entry.open()
    loaders = build_loaders(cfg.data, fs, root, index, ctx.rank, ctx.world_size, cfg.seed,
                            pin_memory=ctx.device.type == "cuda", train=False, augment=cfg.augment)
    totals = evaluate(model, loaders.val, ctx.device, precision, cfg.model.channels_last,
                      topk=tuple(job.topk), tta=job.tta, keep_topk=max(job.topk) if job.predictions else 0)
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
                job: Job) -> dict[str, Any]:
    """Top-k answers for every input (its error for a bad one); each node's first rank writes them all
    to `predictions.jsonl` in the job folder, in input order."""
    model, precision = inference_setup(cfg, ctx, job)
    fs, root = entry.open()
    split = index.splits["val"]
    loader = eval_loader(cfg.data, fs, root, split, ctx.rank, ctx.world_size, cfg.seed,
                         pin_memory=ctx.device.type == "cuda", on_bad_image="report",
                         interpolation=cfg.augment.interpolation)
    rows = predict(model, loader, ctx.device, precision, cfg.model.channels_last, job.topk[0])
    if ctx.local_rank == 0:
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


TEARDOWN_S = 30  # destroying the process group may wait on peers; the results are saved by then


def run_job(folder: Path, startup: StartupClock) -> int:
    """Run the job in this process (already inside a torchrun-style environment); its exit code.
    `startup` times a training job's phases up to its first step."""
    code = job_outcome(folder, startup)
    with exit_if_stuck(code, TEARDOWN_S):
        teardown()
    return code


def job_outcome(folder: Path, startup: StartupClock) -> int:
    """Run the job; its exit code, any failure recorded for the launcher."""
    rank, ctx, pulse = int(os.environ.get("RANK", 0)), None, None
    try:
        cfg, entry, index, job = read_job(folder)
        startup.mark("read_job")
        ctx = setup(cfg.distributed.backend, cfg.distributed.timeout_s)
        pulse = Heartbeat.start(ctx)
        startup.mark("process_group")
        if job.mode == "train":
            result = train_job(cfg, ctx, folder, entry, index, job, startup)
        elif job.mode == "predict":
            result = predict_job(cfg, ctx, folder, entry, index, job)
        else:
            result = validate_job(cfg, ctx, entry, index, job)
        if ctx.local_rank == 0:  # every node's launcher reports (results are reduced, the same)
            write_result(folder, result)
        return 0
    except DdpError as e:
        return fail(folder, rank, e.exit_code, str(e), original=True)
    except KeyboardInterrupt:
        return SIGINT
    except Exception as e:
        if lost_a_peer(e):  # not original: a failure recorded elsewhere comes first
            log.debug("rank %d: lost a peer: %s", rank, e)
            message = (describe_loss(e, pulse.silent() if pulse else [], ctx, cfg.distributed.timeout_s)
                       if ctx else f"rank {rank} lost a peer while joining the process group "
                       f"({str(e).splitlines()[0]})")
            return fail(folder, rank, PEER_LOST, message, original=False)
        if os.environ.get("DDP_DEBUG") == "1":
            traceback.print_exc()
        return fail(folder, rank, INTERNAL, f"internal error on rank {rank} (a bug; DDP_DEBUG=1 "
                    f"shows the traceback): {type(e).__name__}: {e}", original=True)


PEER_LOSS = ("Connection closed by peer", "Connection reset by peer", "remote worker",
             "Broken pipe", "Socket Timeout", "NCCL communicator was aborted", "Timed out waiting",
             "Application timeout caused pair closure", "collective operation timeout")


def lost_a_peer(error: BaseException) -> bool:
    """A collective failed because another process died or hung (gloo reports some as plain
    RuntimeError, and a hung peer as a timeout)."""
    return isinstance(error, dist.DistError) or (
        isinstance(error, RuntimeError) and any(mark in str(error) for mark in PEER_LOSS))


def fail(folder: Path, rank: int, exit_code: int, message: str, original: bool) -> int:
    """Record the failure for the launcher, which prints the original one once.

    Under an external torchrun there is no launcher of ours, so say it here.
    """
    record_error(folder, rank, exit_code, message, original)
    if LAUNCHED not in os.environ and original:
        print(f"error: {message}", file=sys.stderr)
    return exit_code


def die_with_launcher(poll_s: float = 1.0) -> None:
    """Exit when the process that started this worker is gone (killed with SIGKILL, say).

    The elastic agent starts workers in sessions of their own, so killing the
    launcher's process group does not reach them; without this they would live
    on as orphans, blocked in a collective until the process-group timeout.
    """
    launcher = os.getppid()

    def watch() -> None:
        while os.getppid() == launcher:
            time.sleep(poll_s)
        os._exit(INTERNAL)  # no cleanup to wait for: the group is gone with the launcher

    threading.Thread(target=watch, name="ddp-launcher-watch", daemon=True).start()


def work(job_dir: str) -> int:
    """The worker's life, however it was started: its exit code."""
    logging.basicConfig(level=os.environ.get("DDP_LOG_LEVEL", "INFO"), format="%(message)s")
    startup = StartupClock.inherited()
    startup.mark("worker_imports")
    die_with_launcher()
    return run_job(Path(job_dir), startup)


def forked(job_dir: str) -> None:
    """The agent's function entrypoint for workers forked from the launcher.

    Made like a spawned worker first: a session of its own (a terminal's Ctrl-C
    reaches the launcher, which passes it on once) and the default signal
    handlers (not the agent's, inherited by the fork). A failure exits with its
    code; success returns, as the agent waits for a return value, once the
    loader processes are gone (they ignore SIGTERM, so multiprocessing's exit
    would wait on them forever; their work is done).
    """
    os.setsid()
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    code = work(job_dir)
    if code:
        exit_now(code)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # torch's handler would call their deaths failures
    for loader in multiprocessing.active_children():
        loader.kill()


def main() -> None:
    exit_now(work(sys.argv[1]))


if __name__ == "__main__":
    main()
