"""torch.distributed's collectives as the fake GPU world plays them (fakegpu.py): checked as NCCL would."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from gpu_rules.cuda_recorder import CudaRecorder
from gpu_rules.node import DEVICE, RANK, WORLD, GpuRuleError, tensors_in

NCCL_REDUCE_OPS = {dist.ReduceOp.SUM, dist.ReduceOp.AVG, dist.ReduceOp.PRODUCT, dist.ReduceOp.MIN,
                   dist.ReduceOp.MAX}  # not BAND/BOR/BXOR: ProcessGroupNCCL refuses them


class ControlGroup:
    """A `new_group(backend=...)` of the fake world (the CPU control group beside NCCL)."""

    def __init__(self, backend: str) -> None:
        self.backend = backend


class Work:
    """An async collective's handle, already complete."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self.tensors = tensors

    def wait(self, timeout: Any = None) -> bool:
        return True

    def get_future(self) -> torch.futures.Future:
        future = torch.futures.Future()
        future.set_result(self.tensors)
        return future

class CollectiveRules:
    """torch.distributed's collectives, checked as NCCL (default group) or gloo (a control group)."""

    def __init__(self, cuda: CudaRecorder) -> None:
        self.cuda, self.calls = cuda, []

    def backend(self, group: Any) -> str:
        return group.backend if isinstance(group, ControlGroup) else "nccl"

    def check(self, name: str, group: Any, tensors: list[torch.Tensor], op: Any = None) -> None:
        backend = self.backend(group)
        self.calls.append((name, backend, [(str(t.device), str(t.dtype), tuple(t.shape)) for t in tensors]))
        for t in tensors:
            where = f"dist.{name} on the {backend} group: a {t.dtype} tensor {tuple(t.shape)} on {t.device}"
            if backend == "gloo":
                if t.device.type != "cpu":
                    raise GpuRuleError(f"{where}; the gloo control group takes CPU tensors")
                continue
            if t.device.type != "cuda":
                raise GpuRuleError(f"{where}; NCCL takes CUDA tensors only (\"No backend type associated "
                                   "with device type cpu\"): create it with device=")
            if t.device != DEVICE:
                raise GpuRuleError(f"{where}; this rank's GPU is {DEVICE}")
            if t.is_sparse or not (t.is_contiguous() or t.is_contiguous(memory_format=torch.channels_last)):
                raise GpuRuleError(f"{where}; NCCL takes dense contiguous tensors")
        if backend == "nccl":
            if op is not None and op not in NCCL_REDUCE_OPS:
                raise GpuRuleError(f"dist.{name}: {op} is not a reduce op NCCL has")
            if not self.cuda.bound:
                raise GpuRuleError(f"dist.{name} on NCCL before torch.cuda.set_device({RANK})")

    def all_reduce(self, tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        self.check("all_reduce", group, [tensor], op)
        if op == dist.ReduceOp.SUM and tensor.dtype != torch.bool:
            tensor.mul_(WORLD)  # every rank holds what this one holds
        return Work([tensor]) if async_op else None

    def broadcast(self, tensor, src=0, group=None, async_op=False, group_src=None):
        self.check("broadcast", group, [tensor])
        return Work([tensor]) if async_op else None

    def all_gather(self, tensor_list, tensor, group=None, async_op=False):
        self.check("all_gather", group, [*tensor_list, tensor])
        for out in tensor_list:
            out.copy_(tensor)
        return Work(tensor_list) if async_op else None

    def all_gather_into_tensor(self, output_tensor, input_tensor, group=None, async_op=False):
        self.check("all_gather_into_tensor", group, [output_tensor, input_tensor])
        output_tensor.copy_(input_tensor.repeat(WORLD, *([1] * (input_tensor.dim() - 1))))
        return Work([output_tensor]) if async_op else None

    all_gather_single = all_gather_into_tensor  # SyncBatchNorm's name for it

    def reduce_scatter_tensor(self, output, input, op=dist.ReduceOp.SUM, group=None, async_op=False):
        self.check("reduce_scatter_tensor", group, [output, input], op)
        return Work([output]) if async_op else None

    def reduce_scatter(self, output, input_list, op=dist.ReduceOp.SUM, group=None, async_op=False):
        self.check("reduce_scatter", group, [output, *input_list], op)
        return Work([output]) if async_op else None

    def barrier(self, group=None, async_op=False, device_ids=None):
        self.check("barrier", group, [])
        return Work([]) if async_op else None

    def check_object(self, name: str, group: Any, obj: Any) -> None:
        self.check(name, group, [])
        for t in tensors_in(obj):
            if t.device.type != "cpu":
                raise GpuRuleError(f"dist.{name}: an object holding a tensor on {t.device}; other ranks "
                                   "unpickle it onto that device index: send CPU tensors")

    def all_gather_object(self, object_list, obj, group=None):
        self.check_object("all_gather_object", group, obj)
        object_list[:] = [obj] * len(object_list)

    def gather_object(self, obj, object_gather_list=None, dst=0, group=None, group_dst=None):
        self.check_object("gather_object", group, obj)
        if object_gather_list is not None:
            object_gather_list[:] = [obj] * len(object_gather_list)

    def broadcast_object_list(self, object_list, src=0, group=None, device=None, group_src=None):
        self.check_object("broadcast_object_list", group, object_list)

    def new_group(self, ranks=None, timeout=None, backend=None, **kwargs):
        self.calls.append(("new_group", str(backend), []))
        return ControlGroup(str(backend or "nccl"))

    def get_backend(self, group=None):
        return self.backend(group)

    def patches(self) -> dict[str, Any]:
        names = ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "all_gather_single",
                 "reduce_scatter", "reduce_scatter_tensor", "barrier", "all_gather_object", "gather_object",
                 "broadcast_object_list", "new_group", "get_backend")
        return {name: getattr(self, name) for name in names}
