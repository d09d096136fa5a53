"""The training loop: N replicas, each on its own shard, gradients averaged every step.

`fit()` is the whole run: for each epoch, `train_epoch()` (micro-batches through
DDP with `no_sync` on all but the last, one optimiser and schedule step each;
the loss is the run's `Objective`'s: objectives.py), then `validate()` over the
whole val split (under pretrain.method, of the features: contrastive.py) and of
the weights' EMA, if on (in the first epochs with its
BatchNorm statistics recomputed first, `recalibrate_ema()`),
and after every step and epoch `checkpoint()`: when the `Checkpointer` says a
save is due, the state is settled and saved (and a stop signal ends the run).
Its parts are built one way: what the config makes (the replica, optimiser,
schedule, scaler, objective, EMA) the Trainer builds from it with the `build_*`
functions; what ties it to its process (steps per epoch, the checkpointer with
its stop request and store, the metrics sinks, the console, the startup clock,
and the hooks `on_validation` and `stop_after_epoch`) is handed to its
constructor, each with a bare default, so benches and tests build one without a
worker around it.

Its bookkeeping is named: the epoch's running sums are `RunningSums` (one flat
device tensor: running.py), a metrics.jsonl row is made by `log` (records.py's
`row`), an epoch's end is one `EpochEnd` written both as the history's row and
the validation records' keys, and a step's batches cross to the device once,
before the objective (`on_device`, objectives.py).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ddp_cli.config import ModelConfig, RunConfig, TrainConfig, config_from_dict
from ddp_cli.config.resolve import require_resolved, resume
from ddp_cli.data.fetch.retry import retries_so_far
from ddp_cli.data.pipeline.loaders import Batch, Loaders, skipped_files
from ddp_cli.data.pipeline.transforms import normalising, to_model_input
from ddp_cli.distributed.reduce import replicate
from ddp_cli.distributed.setup import DistContext
from ddp_cli.errors import ConfigError, DivergedError
from ddp_cli.observe.console import RunConsole
from ddp_cli.observe.mfu import Utilisation
from ddp_cli.observe.sinks import Sink
from ddp_cli.observe.startup import StartupClock
from ddp_cli.train.checkpoint import Checkpointer, RankRngs, RunState
from ddp_cli.train.checkpoint_model import warn_if_changed
from ddp_cli.train.contrastive import centroid_evaluate_each
from ddp_cli.train.ema import EmaModel
from ddp_cli.train.inference import evaluate_each, raise_bad_images
from ddp_cli.train.metrics import EvalTotals
from ddp_cli.train.objectives import Micro, build_objective, on_device
from ddp_cli.train.optim import build_optimizer
from ddp_cli.train.precision import autocast, grad_scaler
from ddp_cli.train.records import EpochEnd, row
from ddp_cli.train.resumed import Resumed, resumed
from ddp_cli.train.running import RunningSums
from ddp_cli.train.schedules import build_scheduler, resume_schedule

log = logging.getLogger("ddp")


def count_steps(batches: int, cfg: TrainConfig) -> int:
    """Optimisation steps per epoch from a rank's whole batches; none at all is a config error."""
    steps = batches // cfg.grad_accum
    if cfg.max_steps_per_epoch:
        steps = min(steps, cfg.max_steps_per_epoch)
    if steps < 1:
        raise ConfigError("data.batch_size: larger than a rank's share of the train split; "
                          "lower batch_size or grad_accum")
    return steps


def resume_position(epochs_done: int, samples_in_epoch: int, global_batch: int,
                    steps_per_epoch: int) -> tuple[int, int]:
    """(step in the epoch, step of the run) a resume at another global batch goes on from: the epoch's
    positions consumed, in whole steps of the new batch, and the same fraction of the run in epochs."""
    step_in_epoch = math.ceil(samples_in_epoch / global_batch)
    return step_in_epoch, epochs_done * steps_per_epoch + step_in_epoch


def place(model: nn.Module, cfg: ModelConfig, device: torch.device) -> nn.Module:
    """On the device, in the configured memory format, with SyncBatchNorm if asked."""
    memory_format = torch.channels_last if cfg.channels_last else torch.preserve_format
    model = model.to(device, memory_format=memory_format)
    return nn.SyncBatchNorm.convert_sync_batchnorm(model) if cfg.sync_batchnorm else model


def union_across_ranks(paths: set[str]) -> set[str]:
    """Every rank's set of (bad file) paths, merged."""
    everyone: list[set[str] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, paths)
    return set().union(*everyone)


class Trainer:
    def __init__(self, cfg: RunConfig, ctx: DistContext, model: nn.Module, loaders: Loaders,
                 steps_per_epoch: int, checkpointer: Checkpointer | None = None,
                 metrics: Sink | None = None, console: RunConsole | None = None,
                 startup: StartupClock | None = None, *,
                 on_validation: Callable[[EvalTotals, int], None] | None = None,
                 stop_after_epoch: Callable[[dict[str, float], int], bool] | None = None,
                 utilisation: Utilisation | None = None) -> None:
        require_resolved(cfg, "the Trainer")
        self.precision = cfg.train.precision
        self.cfg, self.ctx, self.loaders, self.steps_per_epoch = cfg, ctx, loaders, steps_per_epoch
        self.metrics, self.console = metrics, console or RunConsole(False)
        self.startup = startup or StartupClock()
        self.accum = cfg.train.grad_accum
        self.global_batch = cfg.global_batch(ctx.world_size)
        model = place(model, cfg.model, ctx.device)
        train = cfg.train
        self.ema = EmaModel(model, train.ema_decay, train.ema_every_steps) if train.ema_decay else None
        self.ema_bn_epochs = train.ema_bn_epochs if self.ema and loaders.calibration else 0
        self.ema_bn_sample: list[Batch] | None = None  # its batches, read at the first recalibration
        self.model = replicate(model, cfg.distributed, ctx.device, steps_per_epoch * cfg.train.epochs)
        self.forward = torch.compile(self.model) if cfg.train.compile else self.model
        self.lr = cfg.lr(ctx.world_size)
        self.optimizer = build_optimizer(cfg.optim, self.model.module, self.lr, cfg.model)
        self.scheduler = build_scheduler(self.optimizer, cfg.schedule, steps_per_epoch,
                                         steps_per_epoch * cfg.train.epochs)
        self.scaler = grad_scaler(ctx.device, self.precision)
        self.objective = build_objective(cfg, loaders, ctx.device, self.precision, self.ema)
        self.state = RunState(global_batch=self.global_batch, world_sizes=[ctx.world_size])
        self.running = RunningSums(self.objective.sums, ctx.device)  # this rank's, over the epoch so far
        self.mark = self.running.clone()  # all ranks' at the last record
        self.retries_seen = retries_so_far()
        self.checkpointer = checkpointer or Checkpointer(None)
        self.on_validation = on_validation  # (totals, epoch): rank 0's files
        # (val metrics, epoch) -> stop here? Asked on every rank at each epoch's end (a sweep's pruner)
        self.stop_after_epoch = stop_after_epoch
        self.utilisation = utilisation  # MFU's FLOPs and peak (observe/mfu.py), where reported: rank 0
        self.stopped_at: int | None = None  # the epoch a stop_after_epoch ended the run after
        self.checkpointer.track(self.state)
        self.checkpointer.register(
            model=self.model.module, optimizer=self.optimizer, scheduler=self.scheduler, scaler=self.scaler,
            ema=self.ema, rng=RankRngs(ctx.rank, ctx.world_size), optional=("ema",))

    def fit(self) -> dict[str, Any]:
        cfg, images_seen, train_seconds, flops = self.cfg, 0, 0.0, 0.0
        for epoch in range(self.state.epoch, cfg.train.epochs):
            # images this epoch trains: a resumed one only those of the steps it has left
            trained = (self.steps_per_epoch - self.state.step_in_epoch) * self.global_batch
            started = time.perf_counter()
            train_loss, bad, metrics = self.train_epoch(epoch)
            seconds = time.perf_counter() - started
            train_seconds += seconds
            images_seen += trained
            size = cfg.data.train_size(epoch)
            flops += trained * (self.utilisation.flops.get(size, 0.0) if self.utilisation else 0.0)
            if epoch < self.ema_bn_epochs:
                self.recalibrate_ema()
            evaluation, of_ema = self.validate(bad)
            bad = union_across_ranks(bad)  # distinct bad files met this epoch (train and val)
            end = EpochEnd(epoch=epoch + 1, train_loss=train_loss, val=evaluation.metrics,
                           ema_val=of_ema.metrics if of_ema else None, seconds=seconds,
                           images_per_second=trained / seconds,
                           skipped=len(bad), io_retries=self.retries_since_last(),
                           lr=self.optimizer.param_groups[0]["lr"], image_size=size, metrics=metrics,
                           mfu=self.mfu(trained / seconds, size).get("mfu"))
            self.end_epoch(end, bad)
            self.report(epoch, end, evaluation)
            judged = end.ema_val if cfg.checkpoint.best_metric == "ema_top1" else end.val  # the run's weights
            self.checkpoint(top1=judged["top1"])
            if self.stopping_after(judged, epoch + 1):
                break
        self.console.summary(self.state.history)
        return self.summary(images_seen / max(train_seconds, 1e-9), flops / max(train_seconds, 1e-9))

    def end_epoch(self, end: EpochEnd, bad: set[str]) -> None:
        """The run's progress past an epoch: its history row, the whole run's counts, and no running sums
        (the next epoch starts from none)."""
        self.state.io_retries += end.io_retries
        self.state.skipped_files = sorted(bad.union(self.state.skipped_files))
        self.state.epoch, self.state.final, self.state.final_ema = end.epoch, end.val, end.ema_val
        self.state.step_in_epoch = self.state.samples_in_epoch = 0
        self.running.zero()
        self.state.running = []
        self.state.history.append(end.history_row())

    def report(self, epoch: int, end: EpochEnd, evaluation: EvalTotals) -> None:
        """An epoch's end to metrics.jsonl (each validation's record with the epoch's keys, then the
        objective's metrics), the console (the history's row) and `on_validation`."""
        self.log("val", epoch, **end.val, **end.validation_keys())
        if end.ema_val:
            self.log("val_ema", epoch, **end.ema_val, **end.validation_keys())
        if end.metrics:  # the objective's own, over the epoch
            self.log(self.objective.name, epoch, **end.metrics)
        self.console.epoch_done(self.state.history[-1])
        if self.on_validation:
            self.on_validation(evaluation, end.epoch)

    def stopping_after(self, val: dict[str, float], epoch: int) -> bool:
        """Asks `stop_after_epoch` at every epoch's end (a sweep's trial reports each epoch), and ends
        the run there when it says so before the last epoch, once the epoch's checkpoint is on disk."""
        asked = self.stop_after_epoch and self.stop_after_epoch(val, epoch)
        if not asked or epoch == self.cfg.train.epochs:
            return False
        self.stopped_at = epoch
        self.checkpointer.wait()
        return True

    def retries_since_last(self) -> int:
        """Storage retries of every rank (and its loader processes) since the last call."""
        mine = retries_so_far()
        count = torch.tensor([mine - self.retries_seen], dtype=torch.int64, device=self.ctx.device)
        self.retries_seen = mine
        dist.all_reduce(count)
        return int(count.item())

    def train_epoch(self, epoch: int) -> tuple[float, set[str], dict[str, Any]]:
        """One pass over this rank's shard (or what is left of it after a resume).

        Returns (mean train loss of all ranks, this rank's bad files, the objective's epoch metrics).
        """
        start = self.state.step_in_epoch
        sampler = self.loaders.train_sampler
        if not self.state.samples_in_epoch:  # a fresh epoch, laid out for this world size
            self.state.epoch_layout = sampler.chunk
        sampler.set_epoch(epoch, skip=self.state.samples_in_epoch, layout=self.state.epoch_layout)
        self.model.train()
        batches = iter(self.loaders.train)
        self.running.restore(self.state.running_of(self.ctx.rank, self.ctx.world_size, len(self.running)))
        if self.objective.sums:
            self.mark = self.running.reduced()
        bad, window, every = set(), (start, time.perf_counter()), self.cfg.logging.every_steps
        lrs = []  # the LR of every step since the last record: all of them reach metrics.jsonl
        with self.console.epoch(epoch, self.cfg.train.epochs, self.steps_per_epoch) as update:
            update(start)
            for step in range(start + 1, self.steps_per_epoch + 1):
                micro = self.objective.micro_batches([next(batches) for _ in range(self.accum)])
                self.startup.mark("first_batch")
                bad.update(path for part in micro for batch in part for path in skipped_files(batch.skipped))
                lrs.append(self.optimizer.param_groups[0]["lr"])
                self.running.add(self.train_step(micro))
                self.state.step, self.state.step_in_epoch = self.state.step + 1, step
                if startup := self.startup.finish("first_step"):
                    self.console.info(self.startup.line())
                    self.log("startup", epoch, startup_seconds=startup)
                self.state.samples_in_epoch += self.global_batch
                if step % every == 0 or step == self.steps_per_epoch:
                    loss = self.check_finite()
                    rate = (step - window[0]) * self.global_batch / (time.perf_counter() - window[1])
                    mfu = self.mfu(rate, self.cfg.data.train_size(epoch))
                    update(step, loss=loss, lr=lrs[-1], img_s=rate, **mfu)
                    self.log("train", epoch, loss=loss, lr=lrs[-1], lrs=lrs, images_per_second=rate, **mfu,
                             **self.metrics_window())
                    window, lrs = (step, time.perf_counter()), []
                if step < self.steps_per_epoch:  # the epoch's last step is saved after validation
                    self.checkpoint()
        total = self.running.reduced().read()
        return total.loss / max(total.steps, 1), bad, self.objective.metrics(total.objective,
                                                                             total.steps * self.accum)

    def mfu(self, images_per_second: float, size: int) -> dict[str, float]:
        """`mfu`, the model FLOPs utilisation at `images_per_second` (all ranks) of `size` crops; none where
        not reported (another rank, a model torch cannot count, a GPU without a known peak)."""
        share = self.utilisation.of(images_per_second, size) if self.utilisation else None
        return {} if share is None else {"mfu": share}

    def metrics_window(self) -> dict[str, Any]:
        """The objective's metrics since the last record (all ranks'); none, and no collective, without
        sums of its own."""
        if not self.objective.sums:
            return {}
        now = self.running.reduced()
        since, self.mark = (now - self.mark).read(), now
        return self.objective.metrics(since.objective, since.steps * self.accum)

    def train_step(self, micro: list[Micro]) -> torch.Tensor:
        """Forward/backward each micro-step's batches (as loaded; moved to the device here, one micro-step
        at a time) through the objective, its loss divided by the micro-steps (gradients synced on the
        last), then one optimiser step. Returns (loss, the objective's sums...) of the step."""
        total = torch.zeros((), device=self.ctx.device)
        sums = torch.zeros(len(self.objective.sums), dtype=torch.float64, device=self.ctx.device)
        for i, part in enumerate(micro):
            part = on_device(part, self.ctx.device)
            with self.gradient_sync(i == len(micro) - 1):
                loss, counted = self.objective.loss(self.forward, part, self.state.step)
                loss = loss / len(micro)
                sums += counted
                self.backward(loss)
            total += loss.detach().float()
        self.optimizer_step()
        return torch.cat([total.double().view(1), sums])

    def gradient_sync(self, sync: bool) -> AbstractContextManager:
        """DDP all-reduces gradients during backward only when `sync` (the last micro-batch)."""
        return nullcontext() if sync else self.model.no_sync()

    def backward(self, loss: torch.Tensor) -> None:
        self.scaler.scale(loss).backward()

    def optimizer_step(self) -> None:
        """Clip (true, unscaled gradients), step through the scaler, schedule, and update the EMA."""
        if self.cfg.optim.grad_clip:
            self.scaler.unscale_(self.optimizer)
            nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.optim.grad_clip)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        if self.ema:  # the step being taken: `state.step` counts it once train_step returns
            self.ema.step(self.model.module, self.state.step + 1)

    def check_finite(self) -> float:
        """The epoch's mean loss so far; non-finite ends the run (exit 4), keeping the last checkpoint."""
        loss = self.running.mean_loss().item()
        if not math.isfinite(loss):
            raise DivergedError(f"training diverged at step {self.state.step} (loss {loss}); "
                                "lower optim.lr or add schedule.warmup_epochs")
        return loss

    def checkpoint(self, top1: float | None = None) -> None:
        """After a step, and at an epoch's end with the top-1 that decides best.pt: save when one is due,
        then end the run if a stop signal made it due."""
        if self.checkpointer.due(epoch_end=top1 is not None):
            self.checkpointer.end_if_stopping(self.save(top1))

    def save(self, top1: float | None = None) -> Path | None:
        """A checkpoint of the current step, settled first; its path on writing ranks."""
        self.settle()
        return self.checkpointer.save(top1)

    def settle(self) -> None:
        """Before any checkpoint: never diverged weights, and a state every writer saves alike (a node
        whose run dir is not shared writes a copy of its own): BatchNorm statistics are rank 0's, as
        DDP's broadcast at the next forward would make them anyway, and the running loss is every
        rank's own. The objective's state goes with the run's progress, flat (RunState's fields)."""
        self.check_finite()
        self.state.load_state_dict(self.objective.state_dict())
        for buffer in self.model.module.buffers():
            dist.broadcast(buffer, src=0)
        self.state.running = self.running.gathered(self.ctx.world_size)

    def recalibrate_ema(self) -> None:
        """The EMA's BatchNorm statistics recomputed from the run's fixed sample of train images (this
        rank's share, read once and kept: a few MB on the host)."""
        if self.ema_bn_sample is None:
            self.ema_bn_sample = list(self.loaders.calibration)
            for batch in self.ema_bn_sample:
                raise_bad_images(batch.errors)
        if not self.ema_bn_sample:  # a split smaller than the world: no rank has any
            return
        device, norm = self.ctx.device, normalising(self.cfg.data)
        with autocast(device, self.precision):
            self.ema.recalibrate(to_model_input(batch.images, device, self.cfg.model.channels_last, norm)
                                 for batch in self.ema_bn_sample)

    def validate(self, bad: set[str] | None = None) -> tuple[EvalTotals, EvalTotals | None]:
        """Evaluate rank 0's replica and its EMA, in one pass over the val split: their BatchNorm
        statistics are the ones checkpointed."""
        modules = [self.model.module, *([self.ema.module] if self.ema else [])]
        for buffer in (b for module in modules for b in module.buffers()):
            dist.broadcast(buffer, src=0)
        where = (self.loaders.val, self.ctx.device, self.precision, self.cfg.model.channels_last, bad)
        if self.cfg.pretrain.on():  # the features, by their nearest class mean: the classifier is untrained
            every = centroid_evaluate_each(modules, *where, normalising(self.cfg.data),
                                           self.cfg.pretrain.temperature)
        else:
            every = evaluate_each(modules, *where, norm=normalising(self.cfg.data))
        return every[0], every[1] if self.ema else None

    def resume(self, path: str | Path) -> Resumed:
        """Continue exactly where a checkpoint left off, mid-epoch included, on this run's schedule (a
        run given more epochs recomputes it from the next step); at another world size, follow the new
        global batch (`follow_world_size`). Returns what the resume changes, for its line."""
        saved = self.checkpointer.load(path)  # in the current format, whatever version wrote it
        self.objective.load_state_dict(self.state.state_dict())  # its fields of the run's progress
        if "config" in saved:
            trained = config_from_dict(saved["config"], str(path))
            if self.ctx.is_main:  # the model file it was trained from, edited since?
                warn_if_changed(trained.model, path)
            self.follow_trained(trained)
        if self.ema and saved.get("ema") is None:  # the run had no EMA so far: average from here on
            self.ema.restart(self.model.module)
        saved_world, saved_batch = len(saved["rng"]), self.state.global_batch
        if (saved_world, saved_batch) != (self.ctx.world_size, self.global_batch):
            self.follow_world_size(path, saved_world, saved_batch)
        else:  # the loaded LR is the old schedule's: the next step takes this run's
            resume_schedule(self.scheduler, 1.0, self.scheduler.last_epoch)
        self.state.global_batch = self.global_batch
        self.state.world_sizes.append(self.ctx.world_size)
        return resumed(path, saved, self.cfg, self.optimizer.param_groups[0]["lr"], self.scheduler.last_epoch)

    def follow_trained(self, trained: RunConfig) -> None:
        """The run's config reconciled with the one its checkpoint trained with (`config.resolve.resume`),
        and written as such into the next checkpoints."""
        cfg = resume(self.cfg, trained)
        if cfg == self.cfg:
            return
        self.cfg = cfg
        self.checkpointer.meta["config"] = cfg.model_dump(mode="json")
        if self.ema_bn_epochs and not cfg.train.ema_bn_epochs:
            self.ema_bn_epochs = 0

    def follow_world_size(self, path: str | Path, saved_world: int, saved_batch: int) -> None:
        """Resume a checkpoint written at another world size (a node lost or added).

        The per-rank batch stays; the global batch follows the world size. The peak
        LR follows it by the lr_per_256 rule (an absolute optim.lr stays), the
        schedule continues at the same fraction of the run in epochs, and the rest
        of the epoch's permutation is dealt over the new ranks (its last partial
        step dropped, as drop_last does). `checkpoint.on_world_size_change =
        "refuse"` makes this an error instead.
        """
        change = (f"{path} was written at world size {saved_world} (global batch {saved_batch}); this "
                  f"run has world size {self.ctx.world_size} (global batch {self.global_batch})")
        if self.cfg.checkpoint.on_world_size_change == "refuse":
            raise ConfigError(f"resume: {change}, and checkpoint.on_world_size_change = \"refuse\"; run "
                              f"{saved_world} workers in all, or set it to \"rescale\"")
        ratio = self.lr / self.cfg.optim.effective_lr(saved_batch)
        self.state.step_in_epoch, position = resume_position(self.state.epoch, self.state.samples_in_epoch,
                                                             self.global_batch, self.steps_per_epoch)
        resume_schedule(self.scheduler, ratio, position)
        self.log("world_size", self.state.epoch, world_size=self.ctx.world_size, previous=saved_world,
                 global_batch=self.global_batch, lr=self.lr)
        if self.ctx.is_main:
            log.info(f"resume: {change}: peak LR {self.lr / ratio:.6g} -> {self.lr:.6g}, schedule at "
                     f"step {position} of {self.steps_per_epoch * self.cfg.train.epochs} (epoch "
                     f"{self.state.epoch + 1}, step {self.state.step_in_epoch} of {self.steps_per_epoch})")

    def summary(self, images_per_second: float, flops_per_second: float = 0.0) -> dict[str, Any]:
        """`train --json`'s summary; `flops_per_second`: the model's, over this process's training time
        (MFU's numerator, whatever the crop sizes were)."""
        last = self.state.history[-1] if self.state.history else {}
        use, mfu = self.utilisation, {}
        if use and flops_per_second:
            mfu = {"mfu": flops_per_second / (use.peak.flops * use.world_size), "peak_flops": use.peak.flops,
                   "peak_source": use.peak.source}
        return {
            "epochs": self.cfg.train.epochs,
            "world_size": self.ctx.world_size,
            "precision": self.precision,
            "final": self.state.final,
            "final_ema": self.state.final_ema,
            "best_top1": self.state.best_top1,  # of the weights best.pt holds (checkpoint.best_metric)
            "weights": "ema" if self.cfg.checkpoint.best_metric == "ema_top1" else "model",  # ... these
            "images_per_second": images_per_second,
            **mfu,  # a share of the devices' peak at the run's precision (observe/mfu.py)
            "skipped_images": len(self.state.skipped_files),  # distinct bad files, whole run
            "io_retries": self.state.io_retries,  # transient storage errors retried, whole run
            "startup_seconds": self.startup.seconds(),  # to the end of the first step, by phase
            "world_sizes": self.state.world_sizes,
            "last_epoch": last,
            **({"pruned_at_epoch": self.stopped_at} if self.stopped_at else {}),
            **self.objective.summary(last),
        }

    def log(self, split: str, epoch: int, /, **fields: Any) -> None:
        """A metrics.jsonl row (`records.row`: `epoch` the 0-based one under way, at the steps taken)."""
        if self.metrics:
            self.metrics.write(row(split, epoch, self.state.step, **fields))

    def close(self) -> None:
        """Stop the live view; flush and close the metrics sinks (W&B finishes its run here); wait
        for the checkpoint being written, so the process never ends before it is on disk."""
        self.console.close()
        if self.metrics:
            self.metrics.close()
        self.checkpointer.close()
