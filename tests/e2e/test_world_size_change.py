"""Resuming at another world size: the global batch, the LR rule and the schedule follow, or the run refuses.

Two ranks train three steps and checkpoint mid-epoch; one rank resumes. With the
lr_per_256 rule the peak LR halves with the global batch, the schedule goes on at
the same point of the run counted in epochs, and the epoch continues with the
positions of its permutation no rank has seen.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

import pytest
import torch
from replicas import make_config, make_trainer, step_replica

from ddp_cli.errors import ConfigError
from ddp_cli.run.loopback import run_workers
from ddp_cli.train.checkpoint import load_checkpoint
from ddp_cli.train.schedules import lr_factor

STEPS_PER_EPOCH = {2: 10, 1: 20}  # the same split at batch 4 per rank: 80 images
SECTIONS = {"optim": {"lr_per_256": 2.0}, "schedule": {"name": "cosine", "warmup_steps": 2},
            "train": {"epochs": 2}}
DONE = 3


def train_and_checkpoint(rank: int, world_size: int, folder: str) -> str:
    trainer = make_trainer(rank, world_size, make_config(SECTIONS), STEPS_PER_EPOCH[world_size], folder)
    for step in range(DONE):  # what train_epoch does around each step
        step_replica(trainer, rank, world_size, step)
        trainer.state.step += 1
        trainer.state.step_in_epoch += 1
        trainer.state.samples_in_epoch += trainer.global_batch
    return str(trainer.save())


def resume(rank: int, world_size: int, path: str, folder: str, policy: str) -> dict:
    sections = {**SECTIONS, "checkpoint": {"on_world_size_change": policy}}
    trainer = make_trainer(rank, world_size, make_config(sections), STEPS_PER_EPOCH[world_size], folder)
    said: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    logging.getLogger("ddp").addHandler(handler)
    logging.getLogger("ddp").setLevel(logging.INFO)
    try:
        trainer.resume(path)
    except ConfigError as e:
        return {"error": str(e), "exit_code": e.exit_code}
    return {"lr": trainer.optimizer.param_groups[0]["lr"], "initial_lr": trainer.lr,
            "position": trainer.scheduler.last_epoch, "state": trainer.state.state_dict(),
            "said": said}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> tuple[str, str]:
    folder = str(tmp_path_factory.mktemp("resize"))
    return run_workers(train_and_checkpoint, 2, folder)[0], folder


def test_one_rank_resumes_two_with_the_new_global_batch(checkpoint):
    path, folder = checkpoint
    out = run_workers(resume, 1, path, folder, "rescale")[0]
    cfg = make_config(SECTIONS)
    assert out["state"]["samples_in_epoch"] == DONE * 8  # 3 steps of 2 ranks x 4 images
    assert out["state"]["step_in_epoch"] == 6  # the same 24 images are 6 steps of 4
    assert out["state"]["global_batch"] == 4 and out["state"]["step"] == DONE
    assert out["position"] == 6  # the schedule at the same fraction of the run
    peak = cfg.optim.effective_lr(4)
    assert out["initial_lr"] == pytest.approx(2.0 * 4 / 256)
    factor = lr_factor(cfg.schedule, 20, 40)
    assert out["lr"] == pytest.approx(peak * factor(6))
    assert not math.isclose(out["lr"], cfg.optim.effective_lr(8) * lr_factor(cfg.schedule, 10, 20)(3))
    message = next(m for m in out["said"] if "world size" in m)
    assert "written at world size 2 (global batch 8)" in message
    assert "world size 1 (global batch 4)" in message and "peak LR 0.0625 -> 0.03125" in message


def test_refusing_a_world_size_change_is_a_config_error(checkpoint):
    path, folder = checkpoint
    out = run_workers(resume, 1, path, folder, "refuse")[0]
    assert out["exit_code"] == 2
    assert Path(path).name in out["error"] and "written at world size 2" in out["error"]
    assert 'on_world_size_change = "refuse"' in out["error"] and "run 2 workers" in out["error"]


def test_the_same_world_size_resumes_unchanged(checkpoint):
    path, folder = checkpoint
    out = run_workers(resume, 2, path, folder, "refuse")[0]  # no change: refusing changes nothing
    assert "error" not in out
    assert out["state"]["step_in_epoch"] == DONE and out["position"] == DONE
    cfg = make_config(SECTIONS)
    assert out["lr"] == pytest.approx(cfg.optim.effective_lr(8) * lr_factor(cfg.schedule, 10, 20)(DONE))


def as_written_at(version: int, path: str, folder: str) -> str:
    """The fixture's checkpoint as ddp wrote it at format `version` (no version field, no manifest)."""
    state = load_checkpoint(path)
    for key in ("format_version", "descriptions", "epoch_layout", "io_retries"):
        state.pop(key, None)
    if version < 2:  # the writer's running loss only, no world sizes
        state["running"] = state["running"][0]
        del state["world_sizes"]
    if version < 1:  # the global batch follows from the config every run's checkpoint holds
        del state["global_batch"], state["samples_in_epoch"]
        state["config"] = make_config(SECTIONS).model_dump(mode="json")
    old = Path(folder) / f"v{version}.pt"
    torch.save(state, old)
    return str(old)


@pytest.mark.parametrize("version", [0])  # 0 migrates through every step (each: test_checkpoint_format)
def test_checkpoints_of_earlier_formats_resume_at_another_world_size(checkpoint, version):
    path, folder = checkpoint
    out = run_workers(resume, 1, as_written_at(version, path, folder), folder, "rescale")[0]
    assert out["state"]["samples_in_epoch"] == DONE * 8 and out["state"]["step_in_epoch"] == 6
    assert out["position"] == 6 and out["state"]["world_sizes"] == [2, 1]
    assert out["initial_lr"] == pytest.approx(2.0 * 4 / 256)
