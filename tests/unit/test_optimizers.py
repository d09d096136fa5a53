"""LARS and LAMB against their papers' update rules, parameter groups, optimiser selection."""

from __future__ import annotations

import io
import math

import pytest
import torch
from torch import nn

from ddp_cli.config import OptimConfig
from ddp_cli.errors import ConfigError
from ddp_cli.train.large_batch import Lamb, Lars
from ddp_cli.train.optim import build_optimizer, param_groups


def gradients(step: int, like: torch.Tensor) -> torch.Tensor:
    return torch.randn(like.shape, generator=torch.Generator().manual_seed(step))


def run(optimizer_cls, steps: int = 5, **kwargs) -> torch.Tensor:
    """`steps` updates of one 3x4 tensor with fixed pseudo-random gradients."""
    w = nn.Parameter(torch.linspace(-1, 1, 12).view(3, 4))
    opt = optimizer_cls([w], **kwargs)
    for step in range(steps):
        w.grad = gradients(step, w)
        opt.step()
    return w.detach()


def test_lars_without_trust_ratio_is_sgd_with_momentum_and_weight_decay():
    lars = run(lambda p, **kw: Lars([{"params": p, "trust_ratio": False}], **kw),
               lr=0.1, momentum=0.9, weight_decay=0.01)
    sgd = run(torch.optim.SGD, lr=0.1, momentum=0.9, weight_decay=0.01)
    torch.testing.assert_close(lars, sgd)


def test_lars_step_is_the_papers_local_lr_times_the_decayed_gradient():
    """You et al. 2017: local_lr = eta |w| / (|g| + beta |w|); step = lr * local_lr * (g + beta w)."""
    w = nn.Parameter(torch.tensor([3.0, 4.0]))  # |w| = 5
    w.grad = torch.tensor([0.6, 0.8])  # |g| = 1
    Lars([w], lr=2.0, momentum=0.9, weight_decay=0.1, trust_coefficient=0.001).step()
    local_lr = 0.001 * 5 / (1 + 0.1 * 5)
    expected = torch.tensor([3.0, 4.0]) - 2.0 * local_lr * torch.tensor([0.6 + 0.3, 0.8 + 0.4])
    torch.testing.assert_close(w.detach(), expected)


def test_lars_momentum_accumulates_scaled_steps():
    w = nn.Parameter(torch.tensor([3.0, 4.0]))
    opt = Lars([w], lr=1.0, momentum=0.5, weight_decay=0.0, trust_coefficient=0.01)
    w.grad = torch.tensor([0.6, 0.8])
    opt.step()
    first = 0.01 * 5 / 1 * torch.tensor([0.6, 0.8])
    after_one = torch.tensor([3.0, 4.0]) - first
    torch.testing.assert_close(w.detach(), after_one)
    w.grad = torch.tensor([0.6, 0.8])
    opt.step()
    second = 0.01 * after_one.norm() / 1 * torch.tensor([0.6, 0.8])
    torch.testing.assert_close(w.detach(), after_one - (0.5 * first + second))


def test_lamb_without_trust_ratio_is_adamw():
    lamb = run(lambda p, **kw: Lamb([{"params": p, "trust_ratio": False}], **kw),
               lr=0.01, betas=(0.9, 0.99), eps=1e-6, weight_decay=0.05)
    adamw = run(torch.optim.AdamW, lr=0.01, betas=(0.9, 0.99), eps=1e-6, weight_decay=0.05)
    torch.testing.assert_close(lamb, adamw)


def test_lamb_first_step_is_the_papers_trust_ratio_times_the_adam_direction():
    """You et al. 2019, Algorithm 2, step 1: m_hat = g, v_hat = g^2, so r = g / (|g| + eps)."""
    w0 = torch.tensor([3.0, -4.0, 0.0])
    g = torch.tensor([0.5, 2.0, -1.0])
    w = nn.Parameter(w0.clone())
    w.grad = g.clone()
    Lamb([w], lr=0.1, eps=1e-6, weight_decay=0.01).step()
    update = g / (g.abs() + 1e-6) + 0.01 * w0
    expected = w0 - 0.1 * (w0.norm() / update.norm()) * update
    torch.testing.assert_close(w.detach(), expected)


@pytest.mark.parametrize("cls", [Lars, Lamb])
def test_a_zero_tensor_still_moves(cls):
    """With |w| = 0 the ratio would be 0 for ever; it is 1 instead."""
    w = nn.Parameter(torch.zeros(4))
    w.grad = torch.ones(4)
    cls([w], lr=0.1).step()
    assert w.detach().abs().min() > 0


@pytest.mark.parametrize("cls", [Lars, Lamb])
def test_state_survives_a_weights_only_round_trip(cls):
    a = nn.Parameter(torch.linspace(-1, 1, 12).view(3, 4))
    opt = cls([a], lr=0.1)
    a.grad = gradients(0, a)
    opt.step()
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    b = nn.Parameter(a.detach().clone())
    restored = cls([b], lr=0.1)
    restored.load_state_dict(torch.load(buffer, weights_only=True))
    for p, o in ((a, opt), (b, restored)):
        p.grad = gradients(1, p)
        o.step()
    torch.testing.assert_close(a.detach(), b.detach())


def test_norm_and_bias_parameters_get_no_decay_and_no_trust_ratio():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(4, 2))
    matrices, vectors = param_groups(model, OptimConfig(weight_decay=1e-4))
    assert {p.ndim for p in matrices["params"]} == {2, 4} and len(matrices["params"]) == 2
    assert len(vectors["params"]) == 4  # conv bias, BN weight and bias, linear bias
    assert (matrices["weight_decay"], matrices["trust_ratio"]) == (1e-4, True)
    assert (vectors["weight_decay"], vectors["trust_ratio"]) == (0.0, False)
    _, decayed = param_groups(model, OptimConfig(weight_decay=1e-4, decay_norm_and_bias=True))
    assert (decayed["weight_decay"], decayed["trust_ratio"]) == (1e-4, False)


@pytest.mark.parametrize(("name", "cls"), [("sgd", torch.optim.SGD), ("adamw", torch.optim.AdamW),
                                           ("lars", Lars), ("lamb", Lamb), ("rmsprop", torch.optim.RMSprop)])
def test_build_optimizer_by_name(name, cls):
    model = nn.Linear(3, 2)
    opt = build_optimizer(OptimConfig(name=name, weight_decay=0.01, betas=[0.8, 0.9]), model, lr=0.3)
    assert type(opt) is cls
    assert [g["lr"] for g in opt.param_groups] == [0.3, 0.3]
    if name in ("adamw", "lamb"):
        assert opt.param_groups[0]["betas"] == (0.8, 0.9)


def test_nesterov_without_momentum_is_a_config_error():
    with pytest.raises(ConfigError, match="optim.nesterov"):
        build_optimizer(OptimConfig(nesterov=True, momentum=0.0), nn.Linear(2, 2), lr=0.1)


def test_lamb_step_sizes_follow_the_weights_not_the_gradient_scale():
    """The point of a trust ratio: the step is lr * |w| whatever the gradient's magnitude."""
    for scale in (1e-3, 1.0, 1e3):
        w = nn.Parameter(torch.tensor([3.0, 4.0]))
        w.grad = scale * torch.tensor([1.0, 1.0])
        Lamb([w], lr=0.01).step()
        step = (torch.tensor([3.0, 4.0]) - w.detach()).norm().item()
        assert math.isclose(step, 0.01 * 5, rel_tol=1e-5)
