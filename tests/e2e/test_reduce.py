"""Gradient reduction: each `distributed.reduce` hook really runs, and the DDP switches keep mean exact.

One pair of gloo processes trains every variant from the same start on the
same batches and records the weights after each step; the tests compare them.
"""

from __future__ import annotations

import pytest
import torch
from replicas import make_config, make_trainer, step_replica, weights

from ddp_cli.config import DistributedConfig
from ddp_cli.distributed.reduce import powersgd_warmup
from ddp_cli.run.loopback import run_workers

STEPS = 4
LR = 0.5
PLAIN_SGD = {"optim": {"name": "sgd", "momentum": 0.0, "weight_decay": 0.0, "lr": LR},
             "schedule": {"name": "constant", "warmup_steps": 0}}
VARIANTS = {
    "mean": {},
    "sum": {"distributed": {"reduce": "sum"}},
    "bf16": {"distributed": {"reduce": "bf16"}},
    "fp16": {"distributed": {"reduce": "fp16"}},
    "powersgd": {"distributed": {"reduce": "powersgd", "powersgd_warmup_steps": 2}},
    "static_graph": {"distributed": {"static_graph": True}},
    "copied_buckets": {"distributed": {"gradient_as_bucket_view": False, "bucket_cap_mb": 0.05}},
    "clipped": {"optim": {"grad_clip": 0.1}},  # the first gradient's norm is ~0.4
}


def train_variants(rank: int, world_size: int, folder: str) -> dict[str, list[dict]]:
    """{variant: [weights at the start, after step 1, ...]}."""
    history = {}
    for name, sections in VARIANTS.items():
        merged = {k: {**PLAIN_SGD.get(k, {}), **sections.get(k, {})} for k in {*PLAIN_SGD, *sections}}
        trainer = make_trainer(rank, world_size, make_config(merged), STEPS, folder)
        history[name] = [weights(trainer)]
        for step in range(STEPS):
            step_replica(trainer, rank, world_size, step)
            history[name].append(weights(trainer))
    return history


@pytest.fixture(scope="module")
def history(tmp_path_factory) -> dict[str, list[dict]]:
    folder = tmp_path_factory.mktemp("reduce")
    ranks = run_workers(train_variants, 2, str(folder))
    for name in VARIANTS:  # whatever the hook, every replica applied the same update
        for a, b in zip(ranks[0][name], ranks[1][name], strict=True):
            for key in a:
                assert torch.equal(a[key], b[key]), (name, key)
    return ranks[0]


def delta(history: dict, name: str, step: int) -> torch.Tensor:
    """All parameters' change from step-1 to step, flattened (buffers do not move in eval mode)."""
    before, after = history[name][step - 1], history[name][step]
    return torch.cat([(after[k] - before[k]).flatten() for k in after if after[k].is_floating_point()])


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """|a - b| / |b|: robust to the float32 rounding of each weight, unlike an elementwise test."""
    return ((a - b).norm() / b.norm()).item()


def test_sum_steps_world_size_times_further_than_mean(history):
    mean, summed = delta(history, "mean", 1), delta(history, "sum", 1)
    assert mean.norm() > 0.01
    assert relative_error(summed, 2 * mean) < 1e-3


def test_bf16_reduction_is_mean_up_to_bf16_rounding(history):
    mean, bf16 = delta(history, "mean", 1), delta(history, "bf16", 1)
    assert not torch.equal(bf16, mean), "the bf16 hook did not run"
    assert relative_error(bf16, mean) < 1e-2


def test_fp16_reduction_is_mean_up_to_fp16_rounding(history):
    """fp16 keeps 11 mantissa bits to bf16's 8: the first step (same weights) nearer the mean than
    bf16's; later steps (from weights already apart by the rounding) still near it."""
    for step in range(1, STEPS + 1):
        mean, fp16 = delta(history, "mean", step), delta(history, "fp16", step)
        assert not torch.equal(fp16, mean), f"the fp16 hook did not run (step {step})"
        assert relative_error(fp16, mean) < 1e-2, step
    fp16_error = relative_error(delta(history, "fp16", 1), delta(history, "mean", 1))
    bf16_error = relative_error(delta(history, "bf16", 1), delta(history, "mean", 1))
    assert fp16_error < 2e-3 and fp16_error < bf16_error / 2, ("not fp16 rounding (bf16's hook?)",
                                                               fp16_error, bf16_error)


def test_powersgd_is_exact_during_warmup_then_compresses(history):
    for step in (1, 2):
        assert relative_error(delta(history, "powersgd", step), delta(history, "mean", step)) < 1e-3
    assert relative_error(delta(history, "powersgd", 3), delta(history, "mean", 3)) > 0.05, \
        "PowerSGD never compressed"


@pytest.mark.parametrize("name", ["static_graph", "copied_buckets"])
def test_ddp_switches_keep_the_exact_mean(history, name):
    for step in range(1, STEPS + 1):
        assert relative_error(delta(history, name, step), delta(history, "mean", step)) < 1e-3


def test_grad_clip_bounds_the_global_gradient_norm(history):
    """Plain SGD moves by lr * gradient: a clipped step has norm lr * grad_clip, in the mean's direction."""
    clipped, mean = delta(history, "clipped", 1), delta(history, "mean", 1)
    assert clipped.norm() == pytest.approx(LR * 0.1, rel=1e-3)
    assert mean.norm() > 2 * clipped.norm()
    assert relative_error(clipped / clipped.norm(), mean / mean.norm()) < 1e-3


def test_powersgd_warmup_is_derived_from_the_run_unless_set():
    assert powersgd_warmup(DistributedConfig(), 176) == 17  # the demo: 8 epochs x 22 steps
    assert powersgd_warmup(DistributedConfig(), 10) == 2
    assert powersgd_warmup(DistributedConfig(), 10**6) == 1000
    assert powersgd_warmup(DistributedConfig(powersgd_warmup_steps=5), 10**6) == 5

