"""The fake GPU world refuses what a GPU run with NCCL refuses (fakegpu.py): each rule, seen failing, so a
passing test of the layer means the code kept it."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import DynamicOutputShapeException

from ddp_cli.data.pipeline.transforms import to_model_input
from ddp_cli.distributed.setup import choose_device
from ddp_cli.distributed.signals import control_group
from gpu_rules.node import DEVICE, GpuRuleError


@pytest.fixture
def bound(gpu):
    choose_device("nccl", 3)
    return gpu


@pytest.mark.parametrize(("make", "rule"), [
    (lambda: torch.zeros(2), "NCCL takes CUDA tensors only"),
    (lambda: torch.zeros(2, 3, device=DEVICE).t(), "dense contiguous"),
])
def test_nccl_takes_contiguous_tensors_on_the_ranks_gpu_only(bound, make, rule):
    with pytest.raises(GpuRuleError, match=rule):
        dist.all_reduce(make())


def test_a_tensor_on_another_gpu_is_refused_where_it_is_made(bound):
    with pytest.raises(GpuRuleError, match="a tensor on cuda:0 .*this rank's GPU is cuda:3"):
        torch.zeros(2, device="cuda:0")


def test_the_ranks_gpu_is_bound_before_any_cuda_tensor_or_collective(gpu):
    with pytest.raises(GpuRuleError, match="a tensor on cuda:3 .*set_device called: False"):
        torch.zeros(2, device=DEVICE)
    with pytest.raises(GpuRuleError, match=r"before torch.cuda.set_device\(3\)"):
        dist.barrier()
    choose_device("nccl", 3)
    assert torch.zeros(2, device="cuda").device == DEVICE  # a bare "cuda" is the current device


def test_nccl_has_no_bitwise_reductions(bound):
    with pytest.raises(GpuRuleError, match="not a reduce op NCCL has"):
        dist.all_reduce(torch.zeros(2, dtype=torch.int64, device=DEVICE), op=dist.ReduceOp.BAND)


def test_the_cpu_control_group_takes_cpu_tensors_and_objects_carry_no_gpu_tensor(bound):
    with pytest.raises(GpuRuleError, match="the gloo control group takes CPU tensors"):
        dist.all_reduce(torch.zeros(1, device=DEVICE), group=control_group("nccl"))
    with pytest.raises(GpuRuleError, match="unpickle it onto that device index"):
        dist.all_gather_object([None] * 8, {"loss": torch.zeros(1, device=DEVICE)})


def test_host_reads_and_device_mixing_raise(bound):
    x = torch.ones(4, device=DEVICE)
    with pytest.raises(GpuRuleError, match="a host read of a torch.float32 tensor on cuda:3"):
        x.sum().item()
    with pytest.raises(DynamicOutputShapeException):
        x[x > 0]
    with pytest.raises(RuntimeError, match="found at least two devices"):
        x + torch.ones(4)


def test_a_rank_touches_only_its_own_gpus_generator(bound):
    with pytest.raises(GpuRuleError, match="every visible GPU's generator"):
        torch.cuda.get_rng_state_all()
    with pytest.raises(GpuRuleError, match="on cuda:0"):
        torch.cuda.set_rng_state(torch.zeros(16, dtype=torch.uint8), 0)


def test_an_asynchronous_copy_to_the_gpu_needs_pinned_memory(bound):
    images = torch.zeros(2, 8, 8, 3, dtype=torch.uint8)
    with pytest.raises(GpuRuleError, match="from pageable memory"):
        to_model_input(images, DEVICE, channels_last=False)
    assert to_model_input(images.pin_memory(), DEVICE, channels_last=True).device == DEVICE


def test_a_copy_to_the_gpu_the_host_waits_for_is_recorded(bound):
    """A copy not asked to be asynchronous makes the host wait for it (from pinned memory too): recorded,
    for the step's tests to find none; an asynchronous one from pinned memory is not."""
    labels = torch.zeros(4, dtype=torch.long)
    labels.pin_memory().to(DEVICE, non_blocking=True)
    assert not bound.blocking
    labels.pin_memory().to(DEVICE)
    labels.to(DEVICE)
    assert bound.blocking == ["a copy of a (4,) torch.int64 tensor to cuda:3"] * 2
