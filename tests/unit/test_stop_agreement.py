"""The stop flag is agreed every `distributed.stop_check_steps` steps (and at every save due anyway),
not after every step: the host is not held back by a CPU collective each step, and all ranks still stop
after the same step."""

from __future__ import annotations

import signal

import pytest
import torch
import torch.distributed as dist
from replicas import CLASSES, make_config, step_replica

from ddp_cli.data.pipeline.loaders import Loaders
from ddp_cli.distributed import faults
from ddp_cli.distributed.setup import DistContext, seed_everything
from ddp_cli.distributed.signals import StopRequest
from ddp_cli.errors import DdpError
from ddp_cli.models import build_model
from ddp_cli.train.checkpoint import Checkpointer
from ddp_cli.train.trainer import Trainer
from tests.resolved import resolved


class CountingStop:
    """A StopRequest stand-in: counts the agreements, at the step each came."""

    def __init__(self, checkpointer_steps: list[int]) -> None:
        self.signal, self.asked_at, self.steps = 0, [], checkpointer_steps

    def agreed(self) -> int:
        self.asked_at.append(self.steps[0])
        return self.signal

    def after_step(self, step: int) -> None:
        pass


def asked(stop_every: int, every_steps: int = 0, epoch_ends: tuple[int, ...] = ()) -> list[int]:
    step = [0]
    stop = CountingStop(step)
    ckpt = Checkpointer(None, every_steps=every_steps, stop=stop, stop_every=stop_every)
    for step[0] in range(1, 21):
        ckpt.progress.step = step[0]
        ckpt.due(epoch_end=step[0] in epoch_ends)
    return stop.asked_at


def test_the_stop_is_agreed_every_stop_every_steps_and_whenever_a_save_is_due():
    assert asked(10) == [10, 20]
    assert asked(10, every_steps=4) == [4, 8, 10, 12, 16, 20]
    assert asked(10, epoch_ends=(7, 14)) == [7, 10, 14, 20]
    assert asked(1) == list(range(1, 21))


def trainer_with_stop(stop_check_steps: int) -> Trainer:
    cfg = make_config({"distributed": {"stop_check_steps": stop_check_steps}, "data": {"batch_size": 1}})
    seed_everything(cfg.seed)
    ctx = DistContext(0, 1, 0, 1, torch.device("cpu"), "gloo")
    checkpointer = Checkpointer(None, stop=StopRequest(None), stop_every=stop_check_steps)
    trainer = Trainer(resolved(cfg, 40, ctx.world_size), ctx, build_model(cfg.model, CLASSES),
                      Loaders(None, [], None), 40, checkpointer)
    trainer.model.eval()
    return trainer


def run_steps(trainer: Trainer, steps: range, signal_after: int = 0) -> None:
    """Steps as train_epoch takes them: train_step, count it, then `checkpoint()`."""
    for step in steps:
        step_replica(trainer, 0, 1, step)
        trainer.state.step = trainer.state.step_in_epoch = step
        if step == signal_after:
            trainer.checkpointer.stop.signal = signal.SIGTERM  # as the handler sets it
        trainer.checkpoint()


def test_twenty_real_steps_make_a_collective_only_at_each_agreement(one_process_group, monkeypatch):
    trainer = trainer_with_stop(10)
    calls = []
    real = dist.all_reduce

    def counting(*args, **kwargs):
        calls.append(trainer.state.step)
        return real(*args, **kwargs)

    monkeypatch.setattr(dist, "all_reduce", counting)
    run_steps(trainer, range(1, 21))
    assert calls == [10, 20]  # DDP's own gradient all-reduce goes through its reducer, not counted


def test_a_signal_stops_the_run_at_the_next_agreement(one_process_group):
    trainer = trainer_with_stop(4)
    with pytest.raises(DdpError, match="stopped by SIGTERM after step 4") as stopped:
        run_steps(trainer, range(1, 9), signal_after=1)
    assert stopped.value.exit_code == 143 and trainer.state.step == 4


@pytest.mark.parametrize(("stop_check_steps", "stops_after"), [(1, 3), (4, 4)])
def test_a_sigterm_fault_stops_the_run_at_the_step_it_names(one_process_group, monkeypatch, stop_check_steps,
                                                            stops_after):
    """`DDP_FAULTS=sigterm@3`: the real signal, raised right after step 3, caught by the real handler."""
    monkeypatch.setenv("DDP_FAULTS", "sigterm@3")
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)  # no launcher: the rank signals itself
    trainer = trainer_with_stop(stop_check_steps)
    with pytest.raises(DdpError, match=f"stopped by SIGTERM after step {stops_after},"):
        run_steps(trainer, range(1, 9))


def test_under_a_launcher_the_fault_goes_to_it_and_the_rank_waits_for_it_to_come_back(one_process_group,
                                                                                       monkeypatch):
    sent = []
    monkeypatch.setenv("DDP_FAULTS", "sigint@2")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "t")
    monkeypatch.setattr(faults.os, "getppid", lambda: sent.append("launcher") or faults.os.getpid())
    trainer = trainer_with_stop(1)
    with pytest.raises(DdpError, match="stopped by SIGINT after step 2,") as stopped:
        run_steps(trainer, range(1, 9))
    assert sent == ["launcher"] and stopped.value.exit_code == 130


BY_TOP1 = {"checkpoint": {"best_metric": "top1"}}


@pytest.mark.parametrize(("sets", "judged"), [({}, "ema"), (BY_TOP1, "model")])
def test_an_epoch_end_judges_best_pt_and_the_stop_by_the_weights_the_run_hands_over(one_process_group, sets,
                                                                                   judged):
    """The default EMA's top-1 decides best.pt and is what a sweep's pruner is told; with best_metric
    "top1", the trained weights' (the fit loop's epoch end, training and validation stood in for)."""
    from types import SimpleNamespace

    cfg = make_config({"train": {"epochs": 2, "ema_decay": "auto"}, **sets})
    seed_everything(cfg.seed)
    ctx = DistContext(0, 1, 0, 1, torch.device("cpu"), "gloo")
    model = build_model(cfg.model, CLASSES)
    saved, told = [], []
    trainer = Trainer(resolved(cfg, 4, ctx.world_size), ctx, model, Loaders(None, [], None), 4,
                      Checkpointer(None), stop_after_epoch=lambda val, epoch: told.append(val) or False)
    scores = {"model": {"loss": 1.0, "top1": 0.5, "top5": 1.0},
              "ema": {"loss": 0.9, "top1": 0.6, "top5": 1.0}}
    trainer.train_epoch = lambda epoch: (1.0, set(), {})
    trainer.validate = lambda bad: tuple(SimpleNamespace(metrics=scores[w]) for w in ("model", "ema"))
    trainer.checkpoint = lambda top1=None: saved.append(top1)
    out = trainer.fit()
    assert saved == [scores[judged]["top1"]] * 2 and told == [scores[judged]] * 2
    assert (out["final"], out["final_ema"]) == (scores["model"], scores["ema"])
