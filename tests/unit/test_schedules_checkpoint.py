"""LR schedule shapes, and checkpoints: atomic writes, safe loads."""

from __future__ import annotations

import math
import pickle

import pytest
import torch

from ddp_cli.config import ScheduleConfig
from ddp_cli.errors import ConfigError, DataError
from ddp_cli.io import atomic_write
from ddp_cli.train.checkpoint import load_checkpoint, save_checkpoint
from ddp_cli.train.schedules import ONECYCLE_END, ONECYCLE_START, build_scheduler, held_at_zero, lr_factor

SPE = 10  # steps per epoch
TOTAL = 100


def factor(steps_per_epoch: int = SPE, total: int = TOTAL, **cfg):
    return lr_factor(ScheduleConfig(**cfg), steps_per_epoch, total)


def test_constant():
    f = factor(name="constant")
    assert [f(s) for s in (0, 37, 99, 100)] == [1.0, 1.0, 1.0, 1.0]


def test_step():
    f = factor(name="step", step_epochs=2, gamma=0.5)
    assert f(0) == 1.0
    assert f(19) == 1.0
    assert f(20) == pytest.approx(0.5)
    assert f(39) == pytest.approx(0.5)
    assert f(40) == pytest.approx(0.25)
    assert f(95) == pytest.approx(0.5**4)


def test_multistep():
    f = factor(name="multistep", milestones=[1, 2.5, 7], gamma=0.1)
    assert f(9) == 1.0
    assert f(10) == pytest.approx(0.1)
    assert f(24) == pytest.approx(0.1)
    assert f(25) == pytest.approx(0.01)
    assert f(69) == pytest.approx(0.01)
    assert f(70) == pytest.approx(0.001)


def test_exponential_decays_by_gamma_per_epoch_smoothly_after_warmup():
    f = factor(name="exponential", gamma=0.5, warmup_steps=5)
    assert [f(s) for s in (0, 4)] == pytest.approx([0.2, 1.0])
    assert [f(s) for s in (5, 10, 15, 25)] == pytest.approx([1.0, 0.5 ** 0.5, 0.5, 0.25])
    torchvision_style = factor(name="exponential", gamma=0.97 ** (1 / 2.4))  # EfficientNet's decay
    assert torchvision_style(24) == pytest.approx(0.97)


def test_cosine_with_floor():
    f = factor(name="cosine", min_lr_ratio=0.2)
    assert f(0) == pytest.approx(1.0)
    assert f(25) == pytest.approx(0.2 + 0.8 * 0.5 * (1 + math.cos(math.pi / 4)))
    assert f(50) == pytest.approx(0.6)
    assert f(100) == pytest.approx(0.2)
    assert f(150) == pytest.approx(0.2)  # clamped past the end
    values = [f(s) for s in range(101)]
    assert all(a >= b for a, b in zip(values, values[1:], strict=False))


def test_poly():
    f = factor(name="poly", power=2.0)
    assert f(0) == pytest.approx(1.0)
    assert f(50) == pytest.approx(0.25)
    assert f(90) == pytest.approx(0.01)
    assert f(100) == pytest.approx(0.0)
    g = factor(name="poly", power=1.0, min_lr_ratio=0.1)
    assert g(50) == pytest.approx(0.55)
    assert g(100) == pytest.approx(0.1)


def test_onecycle():
    f = factor(name="onecycle", pct_start=0.25)
    assert f(0) == pytest.approx(ONECYCLE_START)
    assert f(0) == pytest.approx(1 / 25)
    assert f(10) == pytest.approx(1 / 25 + (1 - 1 / 25) * 0.4)
    assert f(25) == pytest.approx(1.0)
    assert f(25 + 75 // 3) < 1.0
    assert f(100) == pytest.approx(ONECYCLE_END)
    peak = max(range(101), key=f)
    assert peak == 25


def test_warmup_in_epochs_then_cosine():
    f = factor(name="cosine", warmup_epochs=2)  # 20 steps
    assert f(0) == pytest.approx(1 / 20)
    assert f(9) == pytest.approx(10 / 20)
    assert f(19) == pytest.approx(1.0)
    assert f(20) == pytest.approx(1.0)  # the cosine starts where warmup ends
    assert f(60) == pytest.approx(0.5)  # halfway through the 80 remaining steps
    assert f(100) == pytest.approx(0.0, abs=1e-12)


def test_fractional_warmup_epochs():
    f = factor(name="constant", warmup_epochs=0.5)  # 5 steps
    assert [f(s) for s in range(6)] == pytest.approx([0.2, 0.4, 0.6, 0.8, 1.0, 1.0])


def test_warmup_steps_override_epochs():
    f = factor(name="step", warmup_epochs=5, warmup_steps=4, step_epochs=3, gamma=0.1)
    assert [f(s) for s in range(4)] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert f(4) == 1.0
    assert f(30) == pytest.approx(0.1)  # step boundaries count epochs from step 0


def test_factor_drives_the_optimizer_lr():
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([param], lr=0.4)
    scheduler = build_scheduler(optimizer, ScheduleConfig(name="poly", power=1.0), SPE, TOTAL)
    lrs = []
    for _ in range(51):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert lrs[0] == pytest.approx(0.4)
    assert lrs[50] == pytest.approx(0.2)


def test_warmup_then_onecycle_starts_its_cycle_after_warmup():
    f = factor(name="onecycle", warmup_steps=10, pct_start=0.25)  # the cycle spans steps 10..100
    assert f(4) == pytest.approx(0.5)
    assert f(10) == pytest.approx(ONECYCLE_START)
    assert f(10 + 90 // 4) == pytest.approx(ONECYCLE_START + (1 - ONECYCLE_START) * (22 / 90) / 0.25)
    assert f(55) == pytest.approx(ONECYCLE_END + (1 - ONECYCLE_END) * 0.5 * (1 + math.cos(math.pi / 3)))
    assert f(100) == pytest.approx(ONECYCLE_END)


def test_warmup_then_poly_and_multistep():
    poly = factor(name="poly", power=2.0, warmup_steps=20)
    assert poly(19) == pytest.approx(1.0)
    assert poly(60) == pytest.approx((1 - 40 / 80) ** 2)
    multi = factor(name="multistep", milestones=[1, 3], gamma=0.5, warmup_steps=5)
    assert [multi(s) for s in (0, 4, 5, 9, 10, 29, 30)] == pytest.approx([0.2, 1, 1, 1, 0.5, 0.5, 0.25])


SHAPES = [{"name": "constant"}, {"name": "step", "step_epochs": 3}, {"name": "multistep"},
          {"name": "exponential", "gamma": 0.8},
          {"name": "cosine", "min_lr_ratio": 0.1}, {"name": "poly"}, {"name": "onecycle"}]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: s["name"])
def test_every_schedule_sets_the_closed_form_lr_at_every_optimisation_step(shape):
    cfg = ScheduleConfig(warmup_epochs=1.5, milestones=[2, 5], **shape)
    f = lr_factor(cfg, SPE, TOTAL)
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([param], lr=0.4)
    scheduler = build_scheduler(optimizer, cfg, SPE, TOTAL)
    for step in range(TOTAL):
        assert optimizer.param_groups[0]["lr"] == pytest.approx(0.4 * f(step), abs=1e-12), step
        optimizer.step()
        scheduler.step()


# --- checkpoints -----------------------------------------------------------------------------


def sample_state() -> dict:
    return {"model": {"w": torch.arange(6.0).view(2, 3)}, "epoch": 3, "step": 120,
            "history": [{"top1": 0.5}], "rng": {"torch": torch.get_rng_state()}, "config": "x = 1\n"}


def test_save_then_load_round_trip(tmp_path):
    path = tmp_path / "ck" / "last.pt"
    save_checkpoint(sample_state(), path)
    state = load_checkpoint(path)
    assert state["format"] == 1
    assert state["epoch"] == 3 and state["step"] == 120
    assert torch.equal(state["model"]["w"], torch.arange(6.0).view(2, 3))
    assert torch.equal(state["rng"]["torch"], torch.get_rng_state())
    assert state["history"] == [{"top1": 0.5}]


def test_save_leaves_no_temp_files_and_replaces_whole(tmp_path):
    path = tmp_path / "last.pt"
    path.write_bytes(b"\xff" * 1_000_000)  # an old, much larger file
    old_inode = path.stat().st_ino
    save_checkpoint(sample_state(), path)
    assert [p.name for p in tmp_path.iterdir()] == ["last.pt"]
    assert path.stat().st_size < 100_000
    assert path.stat().st_ino != old_inode  # renamed into place, not rewritten in place
    assert load_checkpoint(path)["step"] == 120
    save_checkpoint({**sample_state(), "step": 121}, path)
    assert [p.name for p in tmp_path.iterdir()] == ["last.pt"]
    assert load_checkpoint(path)["step"] == 121


def test_failed_write_keeps_the_old_file(tmp_path):
    path = tmp_path / "last.pt"
    save_checkpoint(sample_state(), path)
    before = path.read_bytes()

    def half_then_fail(f):
        f.write(b"partial")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        atomic_write(path, half_then_fail)
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["last.pt"]


class Exploit:
    """Unpickling calls open(marker, "w"): any code-running load creates the marker file."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_exploit_really_runs_code_with_a_plain_pickle_load(tmp_path):
    marker = tmp_path / "pwned"
    path = tmp_path / "evil.pt"
    torch.save({"format": 1, "payload": Exploit(str(marker))}, path)
    torch.load(path, weights_only=False)
    assert marker.exists()  # the payload is real, so the refusal below means something


def test_load_refuses_code_in_a_pickle(tmp_path):
    marker = tmp_path / "pwned"
    path = tmp_path / "evil.pt"
    torch.save({"format": 1, "payload": Exploit(str(marker))}, path)
    with pytest.raises(DataError, match="refused") as info:
        load_checkpoint(path)
    assert not marker.exists()
    assert info.value.exit_code == 3
    assert str(path) in str(info.value)


def test_load_refuses_legacy_raw_pickle(tmp_path):
    marker = tmp_path / "pwned"
    path = tmp_path / "raw.pt"
    path.write_bytes(pickle.dumps({"format": 1, "payload": Exploit(str(marker))}, protocol=2))
    with pytest.raises(DataError):
        load_checkpoint(path)
    assert not marker.exists()


def test_load_refuses_a_truncated_file(tmp_path):
    path = tmp_path / "last.pt"
    save_checkpoint(sample_state(), path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(DataError, match="last.pt") as info:
        load_checkpoint(path)
    assert info.value.exit_code == 3


def test_load_refuses_plain_data_that_is_not_a_checkpoint(tmp_path):
    path = tmp_path / "weights.pt"
    torch.save({"w": torch.zeros(2)}, path)
    with pytest.raises(DataError, match="not a ddp checkpoint"):
        load_checkpoint(path)


def test_load_missing_path_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="nothing.pt") as info:
        load_checkpoint(tmp_path / "nothing.pt")
    assert info.value.exit_code == 2
    with pytest.raises(ConfigError):
        load_checkpoint(tmp_path)  # a folder is not a checkpoint file


def test_a_frozen_group_is_held_at_zero_for_its_frozen_epochs_then_follows_the_schedule():
    w, v = torch.nn.Parameter(torch.zeros(1)), torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([{"params": [w]}, {"params": [v], "frozen_epochs": 2}], lr=1.0)
    scheduler = build_scheduler(optimizer, ScheduleConfig(name="cosine"), steps_per_epoch=3, total_steps=12)
    cosine = lr_factor(ScheduleConfig(name="cosine"), 3, 12)
    seen = []
    for _ in range(12):
        seen.append([group["lr"] for group in optimizer.param_groups])
        optimizer.step()
        scheduler.step()
    assert [a for a, _ in seen] == pytest.approx([cosine(s) for s in range(12)])
    assert [b for _, b in seen] == pytest.approx([0.0] * 6 + [cosine(s) for s in range(6, 12)])


def test_held_at_zero_with_no_steps_is_the_factor_itself():
    f = lr_factor(ScheduleConfig(name="poly"), 3, 12)
    assert held_at_zero(f, 0) is f
    held = held_at_zero(f, 4)
    assert [held(s) for s in range(6)] == [0.0, 0.0, 0.0, 0.0, f(4), f(5)]
