"""Gradient reduction hooks (distributed/reduce.py), in-process on a one-rank gloo group.

The hooks otherwise run only in spawned workers (tests/e2e), where mutation testing cannot see
them. With one rank, sum and mean reduce alike, so which hook `register_reduction` installs is
read from the model; what a hook does to a gradient (fp16/bf16 rounding) is checked on DDP itself.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

from ddp_cli.config import DistributedConfig
from ddp_cli.distributed import reduce


@pytest.fixture(scope="module")
def one_rank():
    if dist.is_initialized():  # pragma: no cover - another test left a group
        yield
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


class Hooked:
    """Stands in for DDP: records the hook registered."""

    def __init__(self):
        self.hooks = []

    def register_comm_hook(self, state, hook):
        self.hooks.append((state, hook))


def registered(total_steps=100, **cfg):
    model = Hooked()
    reduce.register_reduction(model, DistributedConfig(**cfg), total_steps)
    return model.hooks


@pytest.mark.parametrize(("total", "warmup"), [(100, 10), (35, 3), (10, 2), (29, 2), (30, 3),
                                               (10_000, 1000), (10_010, 1000), (50_000, 1000)])
def test_powersgd_warmup_is_a_tenth_of_the_run_between_2_and_1000(total, warmup):
    got = reduce.powersgd_warmup(DistributedConfig(reduce="powersgd"), total)
    assert got == warmup and isinstance(got, int)


def test_powersgd_warmup_as_configured():
    assert reduce.powersgd_warmup(DistributedConfig(reduce="powersgd", powersgd_warmup_steps=7), 100_000) == 7


def test_mean_installs_no_hook():
    assert registered(reduce="mean") == []


@pytest.mark.parametrize(("name", "hook"), [("sum", reduce._sum_hook),
                                            ("fp16", default_hooks.fp16_compress_hook),
                                            ("bf16", default_hooks.bf16_compress_hook)])
def test_each_reduction_installs_its_hook(name, hook):
    assert registered(reduce=name) == [(None, hook)]


def test_powersgd_state_has_the_rank_and_the_warmup():
    [(state, hook)] = registered(total_steps=500, reduce="powersgd", powersgd_rank=3)
    assert hook is powerSGD_hook.powerSGD_hook
    assert state.process_group is None
    assert state.matrix_approximation_rank == 3
    assert state.start_powerSGD_iter == 50
    [(state, _)] = registered(reduce="powersgd", powersgd_warmup_steps=4)
    assert state.start_powerSGD_iter == 4


class Bucket:
    def __init__(self, buffer):
        self._buffer = buffer

    def buffer(self):
        return self._buffer


def test_sum_hook_returns_the_all_reduced_buffer(one_rank):
    buffer = torch.tensor([1.5, -2.0, 3.25])
    out = reduce._sum_hook(None, Bucket(buffer)).wait()
    assert torch.equal(out, torch.tensor([1.5, -2.0, 3.25]))


def grads(cfg: DistributedConfig) -> torch.Tensor:
    torch.manual_seed(0)
    model = reduce.replicate(nn.Linear(4, 1, bias=False), cfg, torch.device("cpu"), total_steps=100)
    x = torch.tensor([[1 + 2**-12, 1 / 3, 1e-3 + 2**-20, 7.0]])
    model(x).sum().backward()
    return model.module.weight.grad[0]


@pytest.mark.parametrize("name", ["fp16", "bf16"])
def test_16_bit_reductions_round_the_gradients(one_rank, name):
    exact = grads(DistributedConfig(reduce="mean"))
    dtype = torch.float16 if name == "fp16" else torch.bfloat16
    rounded = grads(DistributedConfig(reduce=name))
    assert not torch.equal(rounded, exact)
    assert torch.equal(rounded, exact.to(dtype).float())


def test_replicate_passes_the_bucket_options(one_rank):
    cfg = DistributedConfig(bucket_cap_mb=2, gradient_as_bucket_view=False, static_graph=True)
    ddp = reduce.replicate(nn.Linear(2, 2), cfg, torch.device("cpu"), total_steps=10)
    assert ddp.device_ids is None
    assert ddp.bucket_bytes_cap == 2 * 1024 * 1024
    assert ddp.gradient_as_bucket_view is False
    assert ddp.static_graph is True
    other = reduce.replicate(nn.Linear(2, 2), DistributedConfig(), torch.device("cpu"), total_steps=10)
    assert other.gradient_as_bucket_view is True and other.static_graph is False


def test_replicate_registers_the_configured_hook(one_rank, monkeypatch):
    seen = []
    monkeypatch.setattr(reduce, "register_reduction",
                        lambda model, cfg, total: seen.append((cfg.reduce, total)))
    reduce.replicate(nn.Linear(2, 2), DistributedConfig(reduce="sum"), torch.device("cpu"), total_steps=42)
    assert seen == [("sum", 42)]
