"""The weights' EMA: its update rule, and its place in the trainer's checkpoints."""

from __future__ import annotations

from pathlib import Path

import torch
from replicas import make_config, make_trainer, step_replica, weights
from torch import nn

from ddp_cli.run.loopback import run_workers
from ddp_cli.train.checkpoint import load_checkpoint, save_checkpoint
from ddp_cli.train.ema import EmaModel


def small_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))


def test_update_follows_the_ramped_decay_and_copies_integer_buffers():
    model = small_model()
    ema = EmaModel(model, decay=0.5)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    expected = dict(start)
    for t in range(4):
        with torch.no_grad():
            model[0].weight.add_(1.0)
            model[1].running_mean.add_(2.0)
            model[1].num_batches_tracked.add_(1)
        ema.update(model)
        d = min(0.5, (1 + t) / (10 + t))  # 0.1, 2/11, 3/12, then the configured 0.5
        live = model.state_dict()
        expected = {k: d * expected[k] + (1 - d) * live[k] if live[k].is_floating_point() else live[k]
                    for k in live}
    for key, value in ema.module.state_dict().items():
        torch.testing.assert_close(value, expected[key], msg=key)
    assert ema.module.state_dict()["1.num_batches_tracked"].item() == 4
    assert not any(p.requires_grad for p in ema.module.parameters())


def test_state_dict_round_trip_and_restart():
    model = small_model()
    ema = EmaModel(model, decay=0.9)
    with torch.no_grad():
        model[0].weight.mul_(3)
    ema.update(model)
    other = EmaModel(small_model(), decay=0.9)
    other.load_state_dict(ema.state_dict())
    assert other.updates == 1
    assert torch.equal(other.module[0].weight, ema.module[0].weight)
    other.restart(model)
    assert other.updates == 0 and torch.equal(other.module[0].weight, model[0].weight)


EMA = {"train": {"ema_decay": 0.9}}


def train_save_resume(rank: int, world_size: int, folder: str) -> dict:
    """Train 3 steps with EMA, checkpoint, then resume two fresh trainers from it."""
    trainer = make_trainer(rank, world_size, make_config(EMA), 3, folder)
    lives = [weights(trainer)]
    for step in range(3):
        step_replica(trainer, rank, world_size, step)
        lives.append(weights(trainer))
    trainer.save(top1=0.5)
    trainer.close()
    state = load_checkpoint(f"{folder}/checkpoints/last.pt")
    resumed = make_trainer(rank, world_size, make_config(EMA), 3, folder)
    resumed.resume(f"{folder}/checkpoints/last.pt")
    save_checkpoint({**state, "ema": None}, Path(folder) / "no-ema.pt")  # from a run that had no EMA
    without = make_trainer(rank, world_size, make_config(EMA), 3, folder)
    without.resume(Path(folder) / "no-ema.pt")
    return {"lives": lives, "ema": {k: v.clone() for k, v in trainer.ema.module.state_dict().items()},
            "saved": state["ema"], "resumed": resumed.ema.state_dict(),
            "restarted": without.ema.state_dict(), "model": state["model"]}


def test_trainer_averages_every_step_and_checkpoints_the_average(tmp_path):
    out = run_workers(train_save_resume, 1, str(tmp_path))[0]
    expected = out["lives"][0]
    for t, live in enumerate(out["lives"][1:]):
        d = min(0.9, (1 + t) / (10 + t))
        expected = {k: d * expected[k] + (1 - d) * v if v.is_floating_point() else v for k, v in live.items()}
    for key, value in out["ema"].items():
        torch.testing.assert_close(value, expected[key], msg=key)
    assert out["saved"]["updates"] == out["resumed"]["updates"] == 3
    for key, value in out["ema"].items():
        assert torch.equal(out["saved"]["module"][key], value), key
        assert torch.equal(out["resumed"]["module"][key], value), key
        assert torch.equal(out["restarted"]["module"][key], out["model"][key]), key
    assert out["restarted"]["updates"] == 0
    moved = max((out["lives"][-1][k] - out["ema"][k]).abs().max().item() for k in out["ema"]
                if out["ema"][k].is_floating_point())
    assert moved > 1e-4, "the average equals the live weights: the comparison would be vacuous"
