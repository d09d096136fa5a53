"""The heart of ddp: k replicas with batch b behave as one process with batch k*b."""

from __future__ import annotations

import pytest
import torch
from replicas import CLASSES, train_replica

from ddp_cli.config import config_from_dict
from ddp_cli.models import build_model
from ddp_cli.run.loopback import run_workers

STEPS = 4


def replicas(tmp_path, world_size: int, batch: int, accum: int, optim: dict) -> list[dict]:
    tmp_path.mkdir(parents=True, exist_ok=True)
    sections = {"data": {"batch_size": batch}, "optim": optim, "train": {"grad_accum": accum}}
    return [r["end"] for r in run_workers(train_replica, world_size, sections, STEPS, str(tmp_path))]


def single_process(tmp_path, batch: int, accum: int, optim: dict):
    return replicas(tmp_path, 1, batch, accum, optim)[0]


def assert_same_weights(a: dict, b: dict, atol: float = 1e-5) -> None:
    """Equal up to float reduction order: every element within atol, nearly all within 1e-5."""
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-4, atol=atol, msg=name)
        if a[name].is_floating_point():
            assert (a[name] - b[name]).abs().mean() < 1e-6, name


# Adam divides by sqrt(v): for the few elements whose gradient is ~0, the last
# bits of the all-reduce sum decide a sign, so a handful move by ~lr/100.
OPTIMS = [({"name": "sgd", "momentum": 0.9, "nesterov": True}, 1e-5), ({"name": "adamw"}, 1e-3)]


@pytest.mark.parametrize(("optim", "atol"), OPTIMS, ids=["sgd", "adamw"])
def test_two_replicas_equal_one_process_on_the_combined_batch(tmp_path, optim, atol):
    ranks = replicas(tmp_path, 2, 4, 1, optim)
    reference = single_process(tmp_path / "single", 8, 1, optim)
    for weights in ranks:
        assert_same_weights(weights, reference, atol)
    untouched = build_model(config_from_dict({"model": {"name": "resnet_tiny"}}).model, CLASSES)
    moved = max((ranks[0][k] - v).abs().max().item() for k, v in untouched.state_dict().items()
                if v.is_floating_point())
    assert moved > 1e-3, "training did not change the weights; the comparison would be vacuous"


def test_gradient_accumulation_equals_the_larger_batch(tmp_path):
    optim = {"name": "sgd", "momentum": 0.9}
    accumulated = replicas(tmp_path, 2, 2, 3, optim)
    reference = single_process(tmp_path / "single", 12, 1, optim)
    for weights in accumulated:
        assert_same_weights(weights, reference)
