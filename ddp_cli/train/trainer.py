"""The training loop: N replicas, each on its own shard, gradients averaged every step.

`fit()` is the whole run: for each epoch, `train_epoch()` (micro-batches through
DDP with `no_sync` on all but the last, one optimiser and schedule step each),
then `validate()` over the whole val split (and of the weights' EMA, if on),
then a checkpoint. Checkpoints also come every `checkpoint.every_steps` and
when a signal asks every rank to stop; each holds enough (sampler position,
every rank's RNG) to resume exactly. Rank 0 alone prints and logs; each
node's first worker writes checkpoints, so every node can resume.
"""

from __future__ import annotations

import signal
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ddp_cli.config import ModelConfig, RunConfig, TrainConfig
from ddp_cli.data.loaders import Loaders, requested, skipped_files
from ddp_cli.data.transforms import to_model_input
from ddp_cli.distributed.reduce import replicate
from ddp_cli.distributed.setup import DistContext
from ddp_cli.distributed.signals import StopRequest, control_group
from ddp_cli.errors import ConfigError, DataError, DdpError, DivergedError
from ddp_cli.observe.console import RunConsole
from ddp_cli.observe.sinks import build_sinks
from ddp_cli.train import rng
from ddp_cli.train.checkpoint import CheckpointStore
from ddp_cli.train.ema import EmaModel
from ddp_cli.train.metrics import EvalTotals
from ddp_cli.train.optim import build_optimizer
from ddp_cli.train.precision import autocast, resolve_precision
from ddp_cli.train.schedules import build_scheduler


def count_steps(batches: int, cfg: TrainConfig) -> int:
    """Optimisation steps per epoch from a rank's whole batches; none at all is a config error."""
    steps = batches // cfg.grad_accum
    if cfg.max_steps_per_epoch:
        steps = min(steps, cfg.max_steps_per_epoch)
    if steps < 1:
        raise ConfigError("data.batch_size: larger than a rank's share of the train split; "
                          "lower batch_size or grad_accum")
    return steps


def place(model: nn.Module, cfg: ModelConfig, device: torch.device) -> nn.Module:
    """On the device, in the configured memory format, with SyncBatchNorm if asked."""
    memory_format = torch.channels_last if cfg.channels_last else torch.preserve_format
    model = model.to(device, memory_format=memory_format)
    return nn.SyncBatchNorm.convert_sync_batchnorm(model) if cfg.sync_batchnorm else model


def raise_bad_images(errors: list[str]) -> None:
    """The dataset hands over bad files (under on_bad_image = "error") and storage failures as messages."""
    for message in errors:
        if message:
            raise DataError(message)


def union_across_ranks(paths: set[str]) -> set[str]:
    """Every rank's set of (bad file) paths, merged."""
    everyone: list[set[str] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, paths)
    return set().union(*everyone)


@torch.no_grad()
def evaluate(
    model: nn.Module, loader, device: torch.device, precision: str, channels_last: bool,
    bad: set[str] | None = None,
) -> dict[str, float]:
    """Top-1/top-5/loss over this rank's exact shard, summed across ranks.

    Under "skip", a bad image's stand-in is not counted (so `images` is the
    split's good images) and the bad file goes into `bad`.
    """
    model.eval()
    totals = EvalTotals(device)
    for images, labels, skipped, errors in loader:
        raise_bad_images(errors)
        x = to_model_input(images, device, channels_last)
        with autocast(device, precision):
            logits = model(x)
        totals.add(logits, labels.to(device, non_blocking=True), requested(skipped).to(device))
        if bad is not None:
            bad.update(skipped_files(skipped))
    return totals.reduce()


@dataclass
class RunState:
    """What a checkpoint remembers besides the tensors."""

    epoch: int = 0  # epochs completed
    step: int = 0  # optimisation steps completed, all epochs
    step_in_epoch: int = 0  # of the epoch under way (0 at an epoch boundary)
    running: list[float] = field(default_factory=lambda: [0.0, 0.0])  # its loss sum, steps
    best_top1: float = -1.0
    history: list[dict[str, Any]] = field(default_factory=list)
    final: dict[str, float] = field(default_factory=dict)
    final_ema: dict[str, float] | None = None  # the EMA weights' validation, when on
    skipped_files: list[str] = field(default_factory=list)  # bad files replaced under "skip"


class Trainer:
    def __init__(self, cfg: RunConfig, ctx: DistContext, loaders: Loaders, model: nn.Module,
                 run_dir: Path, extra_state: dict[str, Any], console: RunConsole) -> None:
        self.precision = resolve_precision(cfg.train.precision, ctx.device)
        self.cfg, self.ctx, self.loaders, self.run_dir = cfg, ctx, loaders, run_dir
        self.extra_state, self.console = extra_state, console
        self.accum = cfg.train.grad_accum
        self.global_batch = ctx.world_size * cfg.data.batch_size * self.accum
        self.steps_per_epoch = count_steps(len(loaders.train), cfg.train)
        model = place(model, cfg.model, ctx.device)
        self.ema = EmaModel(model, cfg.train.ema_decay) if cfg.train.ema_decay else None
        self.model = replicate(model, cfg.distributed, ctx.device, self.steps_per_epoch * cfg.train.epochs)
        self.forward = torch.compile(self.model) if cfg.train.compile else self.model
        self.lr = cfg.optim.effective_lr(self.global_batch)
        self.optimizer = build_optimizer(cfg.optim, self.model.module, self.lr)
        self.scheduler = build_scheduler(self.optimizer, cfg.schedule, self.steps_per_epoch,
                                         self.steps_per_epoch * cfg.train.epochs)
        self.scaler = torch.amp.GradScaler(ctx.device.type, enabled=self.precision == "fp16")
        self.loss_fn = nn.CrossEntropyLoss(label_smoothing=cfg.optim.label_smoothing)
        self.state = RunState()
        self.metrics = build_sinks(cfg.logging, run_dir, cfg.model_dump(mode="json")) if ctx.is_main else None
        self.store = CheckpointStore(run_dir / "checkpoints", cfg.checkpoint.keep_last)
        self.stop = StopRequest(control_group(ctx.backend))

    def fit(self) -> dict[str, Any]:
        cfg, images_seen, train_seconds = self.cfg, 0, 0.0
        for epoch in range(self.state.epoch, cfg.train.epochs):
            started = time.perf_counter()
            train_loss, bad = self.train_epoch(epoch)
            seconds = time.perf_counter() - started
            train_seconds += seconds
            images_seen += self.steps_per_epoch * self.global_batch
            val = self.validate(bad)
            ema_val = self.validate(module=self.ema.module) if self.ema else None
            bad = union_across_ranks(bad)  # distinct bad files met this epoch (train and val)
            self.state.skipped_files = sorted(bad.union(self.state.skipped_files))
            skipped = len(bad)
            self.state.epoch, self.state.final, self.state.final_ema = epoch + 1, val, ema_val
            self.state.step_in_epoch, self.state.running = 0, [0.0, 0.0]
            row = {"epoch": epoch + 1, "train_loss": train_loss, "val_loss": val["loss"],
                   "top1": val["top1"], "top5": val["top5"], "seconds": seconds,
                   "images_per_second": self.steps_per_epoch * self.global_batch / seconds,
                   "skipped": skipped, **({"ema_top1": ema_val["top1"]} if ema_val else {})}
            self.state.history.append(row)
            self.log({"split": "val", "epoch": epoch + 1, "step": self.state.step, **val,
                      "lr": self.optimizer.param_groups[0]["lr"], "image_size": cfg.data.train_size(epoch),
                      "images_per_second": row["images_per_second"], "skipped_images": skipped})
            if ema_val:
                self.log({"split": "val_ema", "epoch": epoch + 1, "step": self.state.step, **ema_val})
            self.console.epoch_done(row)
            self.stop_if(self.stop.agreed(), self.save(val))
        self.console.summary(self.state.history)
        return self.summary(images_seen / max(train_seconds, 1e-9))

    def train_epoch(self, epoch: int) -> tuple[float, set[str]]:
        """One pass over this rank's shard (or what is left of it after a resume).

        Returns (mean train loss of all ranks, this rank's bad files).
        """
        start = self.state.step_in_epoch
        self.loaders.train_sampler.set_epoch(epoch, skip=start * self.accum * self.cfg.data.batch_size)
        self.model.train()
        batches = iter(self.loaders.train)
        running = torch.tensor(self.state.running, dtype=torch.float64, device=self.ctx.device)
        bad, window, every = set(), (start, time.perf_counter()), self.cfg.logging.every_steps
        lrs = []  # the LR of every step since the last record: all of them reach metrics.jsonl
        with self.console.epoch(epoch, self.cfg.train.epochs, self.steps_per_epoch) as update:
            update(start)
            for step in range(start + 1, self.steps_per_epoch + 1):
                micro = [next(batches) for _ in range(self.accum)]
                bad.update(path for b in micro for path in skipped_files(b[2]))
                lrs.append(self.optimizer.param_groups[0]["lr"])
                running += torch.stack([self.train_step(micro).double(), running.new_ones(())])
                self.state.step, self.state.step_in_epoch = self.state.step + 1, step
                if step % every == 0 or step == self.steps_per_epoch:
                    loss = self.check_finite(running)
                    rate = (step - window[0]) * self.global_batch / (time.perf_counter() - window[1])
                    update(step, loss=loss, lr=lrs[-1], img_s=rate)
                    self.log({"split": "train", "epoch": epoch + 1, "step": self.state.step,
                              "loss": loss, "lr": lrs[-1], "lrs": lrs, "images_per_second": rate})
                    window, lrs = (step, time.perf_counter()), []
                if step < self.steps_per_epoch:
                    self.checkpoint_mid_epoch(running)
        dist.all_reduce(running)
        return running[0].item() / max(running[1].item(), 1), bad

    def checkpoint_mid_epoch(self, running: torch.Tensor) -> None:
        """Every `checkpoint.every_steps`, and when a signal asks every rank to stop (then exit)."""
        signum = self.stop.agreed()
        every = self.cfg.checkpoint.every_steps
        if signum or (every and self.state.step % every == 0):
            self.check_finite(running)  # never checkpoint diverged weights
            self.state.running = running.tolist()
            self.stop_if(signum, self.save())

    def stop_if(self, signum: int, checkpoint: Path | None) -> None:
        """End the run with 143/130 once the checkpoint of a signalled stop is written."""
        if signum:
            where = checkpoint or self.run_dir / "checkpoints"
            raise DdpError(f"stopped by {signal.Signals(signum).name} after step {self.state.step}, "
                           f"checkpoint {where}; the same command with --run-dir {self.run_dir} "
                           "resumes it", StopRequest.exit_code(signum))

    def train_step(self, micro: list) -> torch.Tensor:
        """Forward/backward each micro-batch (gradients synced on the last), then step."""
        total = torch.zeros((), device=self.ctx.device)
        for i, (images, labels, _skipped, errors) in enumerate(micro):
            raise_bad_images(errors)
            x = to_model_input(images, self.ctx.device, self.cfg.model.channels_last)
            y = labels.to(self.ctx.device, non_blocking=True)
            last = i == len(micro) - 1
            with nullcontext() if last else self.model.no_sync():
                with autocast(self.ctx.device, self.precision):
                    loss = self.loss_fn(self.forward(x), y) / len(micro)
                self.scaler.scale(loss).backward()
            total += loss.detach().float()
        if self.cfg.optim.grad_clip:
            self.scaler.unscale_(self.optimizer)  # clip the true gradients, not fp16-scaled ones
            nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.optim.grad_clip)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        if self.ema:
            self.ema.update(self.model.module)
        return total

    def check_finite(self, running: torch.Tensor) -> float:
        """Mean loss so far; a non-finite one ends the run (exit 4), keeping the last checkpoint."""
        loss = (running[0] / running[1].clamp(min=1)).item()
        if loss != loss or loss in (float("inf"), float("-inf")):
            raise DivergedError(f"training diverged at step {self.state.step} (loss {loss}); "
                                "lower optim.lr or add schedule.warmup_epochs")
        return loss

    def validate(self, bad: set[str] | None = None, module: nn.Module | None = None) -> dict[str, float]:
        """Evaluate rank 0's replica (or its EMA): its BatchNorm statistics are the ones checkpointed."""
        module = self.model.module if module is None else module
        for buffer in module.buffers():
            dist.broadcast(buffer, src=0)
        return evaluate(module, self.loaders.val, self.ctx.device,
                        self.precision, self.cfg.model.channels_last, bad)

    def save(self, val: dict[str, float] | None = None):
        """A checkpoint of this step (after validation at epoch ends, `val` then set).

        Every rank's RNG states are gathered; each node's first worker writes
        (step file, last.pt, and best.pt when top-1 improves). Returns its path.
        """
        best = val is not None and val["top1"] > self.state.best_top1
        if val is not None:
            self.state.best_top1 = max(self.state.best_top1, val["top1"])
        rngs: list[dict[str, Any] | None] = [None] * self.ctx.world_size
        dist.all_gather_object(rngs, rng.capture())
        if self.ctx.local_rank != 0:
            return None
        state = {
            "model": self.model.module.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict(),
            "ema": self.ema.state_dict() if self.ema else None,
            "epoch": self.state.epoch,
            "step": self.state.step,
            "step_in_epoch": self.state.step_in_epoch,
            "running": self.state.running,
            "best_top1": self.state.best_top1,
            "history": self.state.history,
            "skipped_files": self.state.skipped_files,
            "final": self.state.final,
            "final_ema": self.state.final_ema,
            "rng": rngs,
            **self.extra_state,
        }
        info = {"epoch": self.state.epoch, "step": self.state.step,
                "step_in_epoch": self.state.step_in_epoch, "top1": val["top1"] if val else None}
        return self.store.save(state, info, best)

    def resume(self, state: dict[str, Any]) -> None:
        """Continue exactly where a checkpoint left off, mid-epoch included."""
        try:
            self.model.module.load_state_dict(state["model"])
        except RuntimeError as e:
            raise ConfigError(f"resume: the checkpoint holds another model or class count than "
                              f"model.name = {self.cfg.model.name!r} ({str(e).splitlines()[0]}); "
                              "use --resume never or a new --run-dir") from e
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.scaler.load_state_dict(state["scaler"])
        if self.ema and state.get("ema"):
            self.ema.load_state_dict(state["ema"])
        elif self.ema:  # the run had no EMA so far: average from here on
            self.ema.restart(self.model.module)
        self.state = RunState(state["epoch"], state["step"], state["step_in_epoch"], state["running"],
                              state["best_top1"], state["history"], state["final"],
                              state.get("final_ema"), state.get("skipped_files", []))
        if len(state["rng"]) == self.ctx.world_size:  # another world size cannot replay the same draws
            rng.restore(state["rng"][self.ctx.rank])

    def summary(self, images_per_second: float) -> dict[str, Any]:
        last = self.state.history[-1] if self.state.history else {}
        return {
            "epochs": self.cfg.train.epochs,
            "world_size": self.ctx.world_size,
            "precision": self.precision,
            "final": self.state.final,
            "final_ema": self.state.final_ema,
            "best_top1": self.state.best_top1,
            "images_per_second": images_per_second,
            "skipped_images": len(self.state.skipped_files),  # distinct bad files, whole run
            "last_epoch": last,
        }

    def log(self, record: dict[str, Any]) -> None:
        if self.metrics:
            self.metrics.write(record)

    def close(self) -> None:
        """Stop the live view; flush and close the metrics sinks (W&B finishes its run here)."""
        self.console.close()
        if self.metrics:
            self.metrics.close()
