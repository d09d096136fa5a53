"""The training loop: N replicas, each on its own shard, gradients averaged every step.

`fit()` is the whole run: for each epoch, `train_epoch()` (micro-batches through
DDP with `no_sync` on all but the last, one optimiser and schedule step each),
then `validate()` over the whole val split, then a checkpoint. Only rank 0
prints and writes.
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ddp_cli.config import RunConfig
from ddp_cli.data.loaders import Loaders
from ddp_cli.data.transforms import to_model_input
from ddp_cli.distributed.reduce import register_reduction
from ddp_cli.distributed.setup import DistContext
from ddp_cli.errors import ConfigError, DataError, DivergedError
from ddp_cli.observe.console import RunConsole
from ddp_cli.observe.sinks import build_sinks
from ddp_cli.train.checkpoint import save_checkpoint
from ddp_cli.train.metrics import EvalTotals
from ddp_cli.train.optim import build_optimizer
from ddp_cli.train.schedules import build_scheduler

AUTOCAST = {"bf16": torch.bfloat16, "fp16": torch.float16}


def autocast(device: torch.device, precision: str):
    if precision == "fp32":
        return nullcontext()
    return torch.autocast(device.type, dtype=AUTOCAST[precision])


def check_precision(precision: str, device: torch.device) -> None:
    if precision == "fp16" and device.type != "cuda":
        raise ConfigError('train.precision: fp16 needs CUDA (GradScaler); use "bf16" on CPU')


def raise_bad_images(errors: list[str]) -> None:
    """Under on_bad_image = "error" the dataset hands bad files over as messages."""
    for message in errors:
        if message:
            raise DataError(f"bad image {message} (set data.on_bad_image = \"skip\" to skip it)")


@torch.no_grad()
def evaluate(
    model: nn.Module, loader, device: torch.device, precision: str, channels_last: bool
) -> dict[str, float]:
    """Top-1/top-5/loss over this rank's exact shard, summed across ranks."""
    model.eval()
    totals = EvalTotals(device)
    for images, labels, skipped, errors in loader:
        raise_bad_images(errors)
        x = to_model_input(images, device, channels_last)
        with autocast(device, precision):
            logits = model(x)
        totals.add(logits, labels.to(device, non_blocking=True), (skipped == 0).to(device))
    return totals.reduce()


@dataclass
class RunState:
    """What a checkpoint remembers besides the tensors."""

    epoch: int = 0
    step: int = 0
    best_top1: float = -1.0
    history: list[dict[str, Any]] = field(default_factory=list)
    final: dict[str, float] = field(default_factory=dict)


class Trainer:
    def __init__(self, cfg: RunConfig, ctx: DistContext, loaders: Loaders, model: nn.Module,
                 run_dir: Path, extra_state: dict[str, Any], console: RunConsole) -> None:
        check_precision(cfg.train.precision, ctx.device)
        self.cfg, self.ctx, self.loaders, self.run_dir = cfg, ctx, loaders, run_dir
        self.extra_state, self.console = extra_state, console
        memory_format = torch.channels_last if cfg.model.channels_last else torch.preserve_format
        model = model.to(ctx.device, memory_format=memory_format)
        if cfg.model.sync_batchnorm:
            model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
        self.model = DistributedDataParallel(
            model,
            device_ids=[ctx.device] if ctx.device.type == "cuda" else None,
            bucket_cap_mb=cfg.distributed.bucket_cap_mb,
            gradient_as_bucket_view=True,
        )
        register_reduction(self.model, cfg.distributed.reduce)
        self.accum = cfg.train.grad_accum
        self.global_batch = ctx.world_size * cfg.data.batch_size * self.accum
        self.steps_per_epoch = len(loaders.train) // self.accum
        if cfg.train.max_steps_per_epoch:
            self.steps_per_epoch = min(self.steps_per_epoch, cfg.train.max_steps_per_epoch)
        if self.steps_per_epoch < 1:
            raise ConfigError("data.batch_size: larger than a rank's share of the train split; "
                              "lower batch_size or grad_accum")
        self.lr = cfg.optim.effective_lr(self.global_batch)
        self.optimizer = build_optimizer(cfg.optim, self.model.module, self.lr)
        self.scheduler = build_scheduler(self.optimizer, cfg.schedule, self.steps_per_epoch,
                                         self.steps_per_epoch * cfg.train.epochs)
        self.scaler = torch.amp.GradScaler(ctx.device.type, enabled=cfg.train.precision == "fp16")
        self.loss_fn = nn.CrossEntropyLoss(label_smoothing=cfg.optim.label_smoothing)
        self.state = RunState()
        self.metrics = build_sinks(cfg.logging, run_dir, cfg.model_dump(mode="json")) if ctx.is_main else None

    def fit(self) -> dict[str, Any]:
        cfg, images_seen, train_seconds = self.cfg, 0, 0.0
        for epoch in range(self.state.epoch, cfg.train.epochs):
            started = time.perf_counter()
            train_loss, skipped = self.train_epoch(epoch)
            seconds = time.perf_counter() - started
            train_seconds += seconds
            images_seen += self.steps_per_epoch * self.global_batch
            val = self.validate()
            self.state.epoch, self.state.final = epoch + 1, val
            row = {"epoch": epoch + 1, "train_loss": train_loss, "val_loss": val["loss"],
                   "top1": val["top1"], "top5": val["top5"], "seconds": seconds,
                   "images_per_second": self.steps_per_epoch * self.global_batch / seconds,
                   "skipped": skipped}
            self.state.history.append(row)
            self.log({"split": "val", "epoch": epoch + 1, "step": self.state.step, **val,
                      "lr": self.optimizer.param_groups[0]["lr"],
                      "images_per_second": row["images_per_second"], "skipped_images": skipped})
            self.console.epoch_done(row)
            self.save(val)
        self.console.summary(self.state.history)
        return self.summary(images_seen / max(train_seconds, 1e-9))

    def train_epoch(self, epoch: int) -> tuple[float, int]:
        """One pass over this rank's shard; returns (mean train loss, skipped images, all ranks)."""
        self.loaders.train_sampler.set_epoch(epoch)
        self.model.train()
        batches = iter(self.loaders.train)
        running = torch.zeros(2, dtype=torch.float64, device=self.ctx.device)  # loss sum, steps
        skipped, window, every = 0, (0, time.perf_counter()), self.cfg.logging.every_steps
        with self.console.epoch(epoch, self.cfg.train.epochs, self.steps_per_epoch) as update:
            for step in range(1, self.steps_per_epoch + 1):
                micro = [next(batches) for _ in range(self.accum)]
                skipped += sum(int(b[2].sum()) for b in micro)
                running += torch.stack([self.train_step(micro).double(), running.new_ones(())])
                self.state.step += 1
                if step % every == 0 or step == self.steps_per_epoch:
                    loss = self.check_finite(running)
                    rate = (step - window[0]) * self.global_batch / (time.perf_counter() - window[1])
                    lr = self.optimizer.param_groups[0]["lr"]
                    update(step, loss=loss, lr=lr, img_s=rate)
                    self.log({"split": "train", "epoch": epoch + 1, "step": self.state.step,
                              "loss": loss, "lr": lr, "images_per_second": rate})
                    window = (step, time.perf_counter())
        totals = torch.cat([running, running.new_tensor([skipped])])
        dist.all_reduce(totals)
        return totals[0].item() / max(totals[1].item(), 1), int(totals[2].item())

    def train_step(self, micro: list) -> torch.Tensor:
        """Forward/backward each micro-batch (gradients synced on the last), then step."""
        total = torch.zeros((), device=self.ctx.device)
        for i, (images, labels, _skipped, errors) in enumerate(micro):
            raise_bad_images(errors)
            x = to_model_input(images, self.ctx.device, self.cfg.model.channels_last)
            y = labels.to(self.ctx.device, non_blocking=True)
            last = i == len(micro) - 1
            with nullcontext() if last else self.model.no_sync():
                with autocast(self.ctx.device, self.cfg.train.precision):
                    loss = self.loss_fn(self.model(x), y) / len(micro)
                self.scaler.scale(loss).backward()
            total += loss.detach().float()
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        return total

    def check_finite(self, running: torch.Tensor) -> float:
        """Mean loss so far; a non-finite one ends the run (exit 4), keeping the last checkpoint."""
        loss = (running[0] / running[1].clamp(min=1)).item()
        if loss != loss or loss in (float("inf"), float("-inf")):
            raise DivergedError(f"training diverged at step {self.state.step} (loss {loss}); "
                                "lower optim.lr or add schedule.warmup_epochs")
        return loss

    def validate(self) -> dict[str, float]:
        """Evaluate rank 0's replica: its BatchNorm statistics are the ones checkpointed."""
        for buffer in self.model.module.buffers():
            dist.broadcast(buffer, src=0)
        return evaluate(self.model.module, self.loaders.val, self.ctx.device,
                        self.cfg.train.precision, self.cfg.model.channels_last)

    def save(self, val: dict[str, float]) -> None:
        """Rank 0 writes last.pt (and best.pt when top-1 improves), atomically."""
        best = val["top1"] > self.state.best_top1
        self.state.best_top1 = max(self.state.best_top1, val["top1"])
        if not self.ctx.is_main:
            return
        state = {
            "model": self.model.module.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict(),
            "epoch": self.state.epoch,
            "step": self.state.step,
            "best_top1": self.state.best_top1,
            "history": self.state.history,
            "final": val,
            "rng": {"torch": torch.get_rng_state()},
            **self.extra_state,
        }
        folder = self.run_dir / "checkpoints"
        save_checkpoint(state, folder / "last.pt")
        if best:
            save_checkpoint(state, folder / "best.pt")

    def resume(self, state: dict[str, Any]) -> None:
        """Continue from a checkpoint's epoch boundary (weights, optimiser, schedule, history)."""
        self.model.module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.scaler.load_state_dict(state["scaler"])
        self.state = RunState(state["epoch"], state["step"], state["best_top1"], state["history"],
                              state["final"])

    def summary(self, images_per_second: float) -> dict[str, Any]:
        last = self.state.history[-1] if self.state.history else {}
        return {
            "epochs": self.cfg.train.epochs,
            "world_size": self.ctx.world_size,
            "final": self.state.final,
            "best_top1": self.state.best_top1,
            "images_per_second": images_per_second,
            "skipped_images": sum(r["skipped"] for r in self.state.history),
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
