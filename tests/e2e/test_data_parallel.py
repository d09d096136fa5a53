"""The heart of ddp: k replicas with batch b behave as one process with batch k*b."""

from __future__ import annotations

import pytest
import torch
from replicas import make_config, train_replica

from ddp_cli.run.loopback import run_workers
from ddp_cli.train.mixing import BatchMixing

STEPS = 4


def replicas(tmp_path, world_size: int, batch: int, accum: int, optim: dict) -> list[dict]:
    """Every rank's {"start": weights before training, "end": after STEPS steps}."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    sections = {"data": {"batch_size": batch}, "optim": optim, "train": {"grad_accum": accum}}
    return run_workers(train_replica, world_size, sections, STEPS, str(tmp_path))


def single_process(tmp_path, batch: int, accum: int, optim: dict) -> dict:
    return replicas(tmp_path, 1, batch, accum, optim)[0]


def assert_same_weights(a: dict, b: dict, atol: float = 1e-5) -> None:
    """Equal up to float reduction order: every element within atol, nearly all within 1e-5."""
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-4, atol=atol, msg=name)
        if a[name].is_floating_point():
            assert (a[name] - b[name]).abs().mean() < 1e-6, name


def assert_moved(run: dict) -> None:
    """Training changed the weights it really started from: else every comparison is vacuous."""
    start, end = run["start"], run["end"]
    moved = max((end[k] - v).abs().max().item() for k, v in start.items() if v.is_floating_point())
    assert moved > 1e-3, "training did not change the weights; the comparison would be vacuous"


def assert_same_start(runs: list[dict]) -> None:
    """Replicas and the reference begin from the very same weights (same seed, rank 0 broadcast)."""
    for run in runs[1:]:
        for k, v in runs[0]["start"].items():
            assert torch.equal(run["start"][k], v), k


def assert_equivalent(ranks: list[dict], reference: dict, atol: float = 1e-5) -> None:
    """The same start, real training (the weights moved), and the same end as the reference."""
    assert_same_start([*ranks, reference])
    for run in (*ranks, reference):
        assert_moved(run)
    for run in ranks:
        assert_same_weights(run["end"], reference["end"], atol)


# Adam divides by sqrt(v): for the few elements whose gradient is ~0, the last
# bits of the all-reduce sum decide a sign, so a handful move by ~lr/100.
OPTIMS = [({"name": "sgd", "momentum": 0.9, "nesterov": True}, 1e-5), ({"name": "adamw"}, 1e-3)]


@pytest.mark.parametrize(("optim", "atol"), OPTIMS, ids=["sgd", "adamw"])
def test_two_replicas_equal_one_process_on_the_combined_batch(tmp_path, optim, atol):
    ranks = replicas(tmp_path, 2, 4, 1, optim)
    assert_equivalent(ranks, single_process(tmp_path / "single", 8, 1, optim), atol)


def test_gradient_accumulation_equals_the_larger_batch(tmp_path):
    optim = {"name": "sgd", "momentum": 0.9}
    accumulated = replicas(tmp_path, 2, 2, 3, optim)
    assert_equivalent(accumulated, single_process(tmp_path / "single", 12, 1, optim))


MIXING = {"augment": {"mixup_alpha": 0.8, "cutmix_alpha": 1.0, "mix_prob": 1.0, "switch_prob": 0.5},
          "optim": {"name": "sgd", "momentum": 0.9}}


def test_two_replicas_mix_as_one_process_on_the_combined_batch(tmp_path):
    """MixUp and CutMix pair adjacent images with one (seed, step) draw: dealt in blocks, every pair lies
    on one rank, and one process with the combined batch makes the same pairs with the same lambdas.
    GroupNorm in place of BatchNorm: nothing else may couple the images of a batch."""
    mixing = BatchMixing(make_config(MIXING).augment, seed=0)
    kinds = {mixing.draw(step, torch.zeros(1, 3, 16, 16)).box is None for step in range(STEPS)}
    assert kinds == {True, False}, "the steps must include MixUp and CutMix"
    ranks = run_workers(train_replica, 2, {**MIXING, "data": {"batch_size": 4}}, STEPS, str(tmp_path), False)
    single = run_workers(train_replica, 1, {**MIXING, "data": {"batch_size": 8}}, STEPS,
                         str(tmp_path / "single"), False)[0]
    assert_equivalent(ranks, single)
