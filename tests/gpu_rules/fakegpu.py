"""A fake GPU world: this process as rank 3 of an 8-rank NCCL job, on `cuda:3` of an 8-GPU node, on a CPU.

What plays what:

- torch's `FakeTensorMode` makes the `cuda` tensors: shapes, dtypes and devices, no data. It raises
  where a GPU run would compute with tensors on two devices (a CPU tensor into a CUDA op), and on
  reading a value to the host (`.item()`, `.tolist()`, `bool()`: a `GpuRuleError` naming it;
  data-dependent shapes: torch's own) unless `host_reads()` sanctions it (then a read gives 0, True for a
  bool, and is recorded).
- torch's fake process group (`FakeStore`, backend "fake") gives the world its rank and size.
- `CollectiveRules` (nccl_rules.py) replaces torch.distributed's collectives with checks of what NCCL
  accepts: on the NCCL (default) group only dense, contiguous tensors on the rank's own device, reduce
  ops NCCL has, a bound device (`set_device`) before object collectives and barriers, no CUDA tensor
  inside a pickled object; on a gloo group (`new_group(backend="gloo")`) CPU tensors only. The data part
  of a collective is played as if every rank held what this one holds (all-reduce SUM multiplies by 8).
- `CudaRecorder` (cuda_recorder.py) stands in for the torch.cuda calls the code makes (8 GPUs,
  `set_device`, each device's RNG state, bf16 support, seeding) and records them; it refuses a rank
  touching another GPU's generator (each such call opens a CUDA context on that GPU, ~500 MB, from every
  rank).
- `BucketDDP` (ddp_standin.py) stands in for DistributedDataParallel, whose C++ reducer needs a real
  GPU: it checks DDP's arguments, broadcasts the module's state at construction and its buffers at each
  training forward (as DDP does, through the checked collectives), skips the reduction under `no_sync`,
  and after backward hands flat gradient buckets to the registered comm hook (the real
  fp16/bf16/PowerSGD/sum hooks) as DDP's reducer would, copying the result back into the gradients.
- `fake_backward` (ddp_standin.py): the autograd engine on fake CUDA tensors needs a CUDA driver, so
  backward walks the graph from the loss to the leaf parameters it reaches, and gives each a gradient of
  its own dtype on its own device, accumulating as autograd does, then runs their post-accumulate hooks.
- Host work runs for real: an op with no fake tensor in and no CUDA device asked for (a sampler's
  permutation, seeding, a model built on the CPU, a DataLoader's collate; `pin_memory` is a marked copy,
  and a `non_blocking` copy to the GPU must come from one; a copy without `non_blocking`, which the host
  waits for, is recorded in `blocking`), and `torch.load` reads its file for real.
  Files holding fake tensors cannot be written: a test writes a real copy of a state, its tensors tagged
  cuda:3 as a GPU run writes them (`written_on_gpu`), and loading such a tensor anywhere but the CPU (no
  map_location="cpu") is refused.

What this proves: every device placement, transfer, collective and torch.cuda call the code makes on the
GPU path is one a GPU run with NCCL accepts, and the step reads nothing back to the host and waits for
no copy to the GPU. What it cannot: numerics (no values exist; a sanctioned read gives a placeholder, so
code that computes with what it read is exercised, not checked), kernels and their speed, backward's own
kernels, NCCL's real behaviour (hangs, timeouts, ordering across ranks, one rank only is played), DDP's
C++ reducer itself (its bucket order and sizes are approximated), pinned memory's real effect, loader
processes (the tests load in-process), torch.compile, and a real file written from GPU memory.
tests/cuda and `make gpu-check` cover those on a GPU.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, unset_fake_temporarily
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.utils import _pytree as pytree

from gpu_rules.cuda_recorder import CudaRecorder
from gpu_rules.ddp_standin import BucketDDP, fake_backward
from gpu_rules.nccl_rules import CollectiveRules
from gpu_rules.node import RANK, WORLD, GpuRuleError, tensors_in


class GpuFakeMode(FakeTensorMode):
    """FakeTensorMode as on a machine without a GPU (`avoid_device_init`, whatever torch.cuda says once
    patched), whose host reads are refused except inside `host_reads()`, and whose CUDA outputs must be
    on the rank's device. Real CPU tensors may come in (a loader's batch), as on a GPU run."""

    avoid_device_init = True

    def __init__(self, world: FakeGpuWorld) -> None:
        super().__init__(allow_non_fake_inputs=True)
        self.world = world

    def __deepcopy__(self, memo: dict) -> GpuFakeMode:
        return self  # a fake tensor's deepcopy (the EMA's copy of the model) keeps its mode

    def dispatch(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        device = kwargs.get("device")
        if not any(isinstance(a, FakeTensor) for a in pytree.tree_leaves((args, kwargs))) and not (
                device is not None and torch.device(device).type == "cuda"):
            return func(*args, **kwargs)  # host work (a sampler, seeding, a model built on CPU): real
        if func is torch.ops.aten._local_scalar_dense.default and not self.world.reads_allowed:
            raise GpuRuleError(f"a host read of a {args[0].dtype} tensor on {args[0].device} (.item(), "
                               ".tolist(), bool(), float()): the host waits for the GPU here")
        if self.world.reads_allowed:
            if func is torch.ops.aten._local_scalar_dense.default:
                self.world.reads.append(f"item of a {args[0].dtype} on {args[0].device}")
                return True if args[0].dtype == torch.bool else 0.0 if args[0].is_floating_point() else 0
            if func is torch.ops.aten.equal.default:
                self.world.reads.append("torch.equal")
                return True
            mask = args[1][0] if func is torch.ops.aten.index.Tensor and len(args[1]) == 1 else None
            if mask is not None and mask.dtype == torch.bool and mask.shape == args[0].shape[:mask.dim()]:
                self.world.reads.append("a boolean mask's count")  # taken as all True: the rows, copied
                return super().dispatch(torch.ops.aten.clone.default, types, (args[0],), {})
        if func is torch.ops.aten._to_copy.default:
            self.world.check_transfer(args[0], kwargs)
        if func in CUDA_ONLY:
            return CUDA_ONLY[func](lambda *a, **k: super(GpuFakeMode, self).dispatch(*a, **k), types, *args)
        out = super().dispatch(func, types, args, kwargs)
        for tensor in out if isinstance(out, list | tuple) else [out]:
            if isinstance(tensor, FakeTensor) and tensor.device.type == "cuda":
                self.world.cuda.check_placed(func, tensor.device)
        return out


def stats(dispatch, types, like: torch.Tensor, channels: int, dtype: torch.dtype) -> tuple:
    """(mean, invstd) of `channels` on `like`'s device, as SyncBatchNorm's CUDA kernels return them."""
    new = torch.ops.aten.new_empty.default
    return tuple(dispatch(new, types, (like, [channels]), {"dtype": dtype}) for _ in range(2))


# SyncBatchNorm's CUDA-only kernels, which have no fake implementation in torch: their outputs' shapes
CUDA_ONLY = {
    torch.ops.aten.batch_norm_stats.default:
        lambda dispatch, types, x, eps: stats(dispatch, types, x, x.shape[1], torch.float32),
    torch.ops.aten.batch_norm_gather_stats_with_counts.default:
        lambda dispatch, types, x, mean, *rest: stats(dispatch, types, x, mean.shape[-1], mean.dtype),
    torch.ops.aten.batch_norm_elemt.default:
        lambda dispatch, types, x, *rest: dispatch(torch.ops.aten.empty_like.default, types, (x,), {}),
}

def host_side(load: Any) -> Any:
    """torch.load reading a file for real (host work): under FakeTensorMode it would read no data."""
    def real_load(*args: Any, **kwargs: Any) -> Any:
        with unset_fake_temporarily():
            return load(*args, **kwargs)
    return real_load


def restore_location(storage: Any, location: str) -> None:
    """torch.load's deserializer for a location: a tensor saved on a GPU is not put back there."""
    if location.startswith("cuda"):
        raise GpuRuleError(f"a checkpoint's tensor put back on {location}, where it was saved: load with "
                           "map_location=\"cpu\" (that GPU may not exist on this node)")


class FakeGpuWorld:
    """Enter: this process is rank 3 of 8 on cuda:3 (see the module docstring); exit restores torch."""

    def __init__(self, monkeypatch) -> None:
        self.monkeypatch, self.reads, self.reads_allowed = monkeypatch, [], False
        self.blocking: list[str] = []  # host-to-GPU copies the host waits for (`check_transfer`)
        self.cuda = CudaRecorder()
        self.collectives = CollectiveRules(self.cuda)
        self.mode = GpuFakeMode(self)
        self.gpu_storages: set[int] = set()

    def __enter__(self) -> FakeGpuWorld:
        patch = self.monkeypatch.setattr
        dist.init_process_group("fake", store=FakeStore(), rank=RANK, world_size=WORLD)
        for name, fn in self.cuda.patches().items():
            patch(torch.cuda, name, fn)
        for name, fn in self.collectives.patches().items():
            patch(dist, name, fn)
        patch(torch.accelerator, "is_available", lambda: True)
        patch(torch.accelerator, "current_accelerator", lambda check_available=False: torch.device("cuda"))
        patch(torch.Tensor, "pin_memory", lambda t, device=None: self.pin(t))
        patch(torch.Tensor, "is_pinned", lambda t, device=None: getattr(t, "pinned_by_fake_world", False))
        patch(torch.Tensor, "backward", fake_backward)
        patch(torch.Tensor, "record_stream", lambda t, stream: self.cuda.record_stream(t, stream))
        patch(torch.backends.cudnn, "benchmark", torch.backends.cudnn.benchmark)  # restored on exit
        patch("ddp_cli.distributed.reduce.DistributedDataParallel", BucketDDP)
        patch(torch, "load", host_side(torch.load))
        packages = torch.serialization._package_registry  # files written as on a GPU (`written_on_gpu`)
        patch(torch.serialization, "_package_registry", [(0, self.location, restore_location), *packages])
        self.mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.mode.__exit__(*exc)
        dist.destroy_process_group()

    @contextlib.contextmanager
    def host_reads(self) -> Iterator[list[str]]:
        """Sanctioned host reads (a logging window's loss, a checkpoint, a validation's totals): allowed and
        recorded; a value read is 0 (GradScaler finds no inf), True for a bool; torch.equal is True; a
        boolean mask all True. Code computing with such values (a per-class table) is not run here."""
        before, self.reads_allowed = self.reads_allowed, True
        try:
            yield self.reads
        finally:
            self.reads_allowed = before

    def written_on_gpu(self, state: Any) -> None:
        """`state`'s (real, CPU) tensors are saved as a GPU run saves them: tagged cuda:3 in the file."""
        self.gpu_storages.update(t.untyped_storage().data_ptr() for t in tensors_in(state))

    def location(self, storage: Any) -> str | None:
        return f"cuda:{RANK}" if storage.data_ptr() in self.gpu_storages else None

    def pin(self, tensor: torch.Tensor) -> torch.Tensor:
        """Tensor.pin_memory: a copy, remembered as pinned (pinning needs a driver)."""
        if tensor.device.type != "cpu":
            raise GpuRuleError(f"pin_memory of a tensor on {tensor.device}: only CPU memory is pinned")
        copy = tensor.clone()
        copy.pinned_by_fake_world = True
        return copy

    def check_transfer(self, source: Any, kwargs: dict[str, Any]) -> None:
        """A host-to-GPU copy asked to be asynchronous is so only from pinned memory; one not asked to be
        is a wait of the host for the copy, recorded in `blocking` (fine while setting up, not in a step)."""
        device = kwargs.get("device")
        if device is None or torch.device(device).type != "cuda" or source.device.type != "cpu":
            return
        what = f"a copy of a {tuple(source.shape)} {source.dtype} tensor to {device}"
        if not kwargs.get("non_blocking"):
            self.blocking.append(what)
        elif not getattr(source, "pinned_by_fake_world", False):
            raise GpuRuleError(f"a non_blocking {what[2:]} from pageable memory: synchronous on a GPU (no "
                               "pin_memory)")
