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
import torch.distributed as dist
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
    finally:
        logging.getLogger("ddp").removeHandler(handler)
    return {"lr": trainer.optimizer.param_groups[0]["lr"], "initial_lr": trainer.lr,
            "position": trainer.scheduler.last_epoch, "state": trainer.state.state_dict(),
            "said": said}


def train_then_resume(rank: int, world_size: int, folder: str) -> tuple[str, dict]:
    """The checkpoint, then a fresh trainer at the same world size resuming it (policy "refuse"): one
    spawn for both (each spawned process costs a torch import). Rank 0 writes it, then tells its path."""
    path = [train_and_checkpoint(rank, world_size, folder)]
    dist.broadcast_object_list(path, src=0)
    return path[0], resume(rank, world_size, path[0], folder, "refuse")


def resumes(rank: int, world_size: int, runs: list[tuple[str, str, str]]) -> list[dict]:
    """`resume` for each (path, folder, policy) in turn, in this one process."""
    return [resume(rank, world_size, *run) for run in runs]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> tuple[str, str, dict]:
    """(checkpoint, folder, its resume at world size 2)."""
    folder = str(tmp_path_factory.mktemp("resize"))
    path, same = run_workers(train_then_resume, 2, folder)[0]
    return path, folder, same


@pytest.fixture(scope="module")
def one_rank(checkpoint) -> dict[str, dict]:
    """The checkpoint resumed by one rank: rescaled, refused, and as written at format 0 (rescaled), all
    in one spawned process."""
    path, folder, _ = checkpoint
    runs = {"rescale": (path, folder, "rescale"), "refuse": (path, folder, "refuse"),
            "v0": (as_written_at(0, path, folder), folder, "rescale")}
    return dict(zip(runs, run_workers(resumes, 1, list(runs.values()))[0], strict=True))


def test_one_rank_resumes_two_with_the_new_global_batch(one_rank):
    out = one_rank["rescale"]
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


def test_refusing_a_world_size_change_is_a_config_error(checkpoint, one_rank):
    path, _, _ = checkpoint
    out = one_rank["refuse"]
    assert out["exit_code"] == 2
    assert Path(path).name in out["error"] and "written at world size 2" in out["error"]
    assert 'on_world_size_change = "refuse"' in out["error"] and "run 2 workers" in out["error"]


def test_the_same_world_size_resumes_unchanged(checkpoint):
    out = checkpoint[2]  # resumed at world size 2 with "refuse": no change, refusing changes nothing
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


def test_checkpoints_of_earlier_formats_resume_at_another_world_size(one_rank):
    """Format 0 (in `one_rank`) migrates through every step (each: test_checkpoint_format)."""
    out = one_rank["v0"]
    assert out["state"]["samples_in_epoch"] == DONE * 8 and out["state"]["step_in_epoch"] == 6
    assert out["position"] == 6 and out["state"]["world_sizes"] == [2, 1]
    assert out["initial_lr"] == pytest.approx(2.0 * 4 / 256)
