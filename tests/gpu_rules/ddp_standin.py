"""DistributedDataParallel and backward as the fake GPU world plays them (fakegpu.py): DDP's C++ reducer and
autograd's engine need a CUDA driver, so these stand-ins keep their contracts in Python."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gpu_rules.node import DEVICE, WORLD, GpuRuleError


class GradBucket:
    """dist.GradBucket as DDP's reducer hands it to a comm hook: a flat buffer, the gradients as views."""

    def __init__(self, index: int, buffer: torch.Tensor, params: list[nn.Parameter], last: bool) -> None:
        self._index, self._buffer, self._params, self._last = index, buffer, params, last

    def index(self) -> int:
        return self._index

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def set_buffer(self, buffer: torch.Tensor) -> None:
        self._buffer = buffer

    def is_last(self) -> bool:
        return self._last

    def parameters(self) -> list[nn.Parameter]:
        return self._params

    def gradients(self) -> list[torch.Tensor]:
        views, offset = [], 0
        for p in self._params:
            views.append(self._buffer[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
        return views


def mean_hook(state, bucket):
    """DDP's own reduction (no hook registered): divide, then all-reduce (default_hooks.allreduce_hook)."""
    buffer = bucket.buffer().div_(WORLD)
    return dist.all_reduce(buffer, async_op=True).get_future().then(lambda fut: fut.value()[0])


class BucketDDP(nn.Module):
    """DistributedDataParallel's contract in Python (see the module docstring): what a comm hook and
    the collectives see of it, checked; DDP's C++ reducer needs a real GPU."""

    def __init__(self, module: nn.Module, device_ids: list | None = None, output_device: Any = None,
                 broadcast_buffers: bool = True, process_group: Any = None, bucket_cap_mb: float = 25,
                 find_unused_parameters: bool = False, gradient_as_bucket_view: bool = False,
                 static_graph: bool = False, **kwargs: Any) -> None:
        super().__init__()
        devices = {p.device for p in module.parameters()}
        if devices != {DEVICE} or [torch.device(d) for d in device_ids or []] != [DEVICE]:
            raise GpuRuleError(f"DistributedDataParallel(device_ids={device_ids}) over a module on "
                               f"{sorted(map(str, devices))}; this rank's GPU is {DEVICE}")
        self.module, self.broadcast_buffers, self.syncing = module, broadcast_buffers, True
        for tensor in module.state_dict().values():  # DDP's constructor: rank 0's state to every rank
            dist.broadcast(tensor, 0)
        self.params = [p for p in module.parameters() if p.requires_grad]
        cap, self.buckets, size = int(bucket_cap_mb * 2**20), [[]], 0
        for p in reversed(self.params):  # DDP buckets in reverse order: the last layers' gradients come first
            if self.buckets[-1] and size + p.numel() * p.element_size() > cap:
                self.buckets.append([])
                size = 0
            self.buckets[-1].append(p)
            size += p.numel() * p.element_size()
        self.hook, self.state, self.ready = mean_hook, None, set()
        for p in self.params:
            p.register_post_accumulate_grad_hook(self.grad_ready)

    def register_comm_hook(self, state: Any, hook: Any) -> None:
        if self.hook is not mean_hook:
            raise RuntimeError("register_comm_hook or register_builtin_comm_hook can only be called once.")
        self.state, self.hook = state, hook

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        before, self.syncing = self.syncing, False
        try:
            yield
        finally:
            self.syncing = before

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.training and self.broadcast_buffers:
            for buffer in self.module.buffers():
                dist.broadcast(buffer, 0)
        return self.module(*args, **kwargs)

    def grad_ready(self, param: nn.Parameter) -> None:
        if not self.syncing:
            return
        self.ready.add(param)
        if len(self.ready) == len(self.params):
            self.ready.clear()
            self.reduce()

    def reduce(self) -> None:
        for i, params in enumerate(self.buckets):
            buffer = torch.cat([p.grad.reshape(-1) for p in params])
            bucket = GradBucket(i, buffer, params, last=i == len(self.buckets) - 1)
            reduced = self.hook(self.state, bucket).wait()
            if not isinstance(reduced, torch.Tensor) or reduced.device != DEVICE or \
                    reduced.numel() != buffer.numel():
                raise GpuRuleError(f"comm hook {self.hook.__name__}: returned {reduced!r} for a bucket of "
                                   f"{buffer.numel()} on {DEVICE}")
            bucket.set_buffer(reduced.to(buffer.dtype))
            for p, grad in zip(params, bucket.gradients(), strict=True):
                p.grad.copy_(grad)


def leaf_parameters(loss: torch.Tensor) -> list[torch.Tensor]:
    """The leaves that `loss.backward()` would give gradients to: its graph's AccumulateGrad nodes."""
    leaves, seen, todo = [], set(), [loss.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if hasattr(node, "variable"):
            leaves.append(node.variable)
        todo.extend(next_node for next_node, _ in node.next_functions)
    return leaves


def fake_backward(self: torch.Tensor, gradient: Any = None, retain_graph: Any = None,
                  create_graph: bool = False, inputs: Any = None) -> None:
    """Tensor.backward for fake CUDA tensors (see the module docstring)."""
    if self.grad_fn is None:
        raise RuntimeError("element 0 of tensors does not require grad and does not have a grad_fn")
    if self.numel() != 1:
        raise RuntimeError("grad can be implicitly created only for scalar outputs")
    if self.device != DEVICE:
        raise GpuRuleError(f"backward from a loss on {self.device}; this rank's GPU is {DEVICE}")
    for leaf in leaf_parameters(self):
        grad = torch.ones_like(leaf, memory_format=torch.preserve_format)
        if leaf.grad is None:
            leaf.grad = grad
        else:
            leaf.grad.add_(grad)
        for hook in getattr(leaf, "_post_accumulate_grad_hooks", None) or {}:
            leaf._post_accumulate_grad_hooks[hook](leaf)
