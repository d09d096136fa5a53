"""A fake GPU world: this process as rank 3 of an 8-rank NCCL job, on `cuda:3` of an 8-GPU node, on a CPU.

What plays what:

- torch's `FakeTensorMode` makes the `cuda` tensors: shapes, dtypes and devices, no data. It raises
  where a GPU run would compute with tensors on two devices (a CPU tensor into a CUDA op), and on
  reading a value to the host (`.item()`, `.tolist()`, `bool()`: a `GpuRuleError` naming it;
  data-dependent shapes: torch's own) unless `host_reads()` sanctions it (then a read gives 0,
  True for a bool, and is recorded).
- torch's fake process group (`FakeStore`, backend "fake") gives the world its rank and size.
- `CollectiveRules` replaces torch.distributed's collectives with checks of what NCCL accepts: on the
  NCCL (default) group only dense, contiguous tensors on the rank's own device, reduce ops NCCL has,
  a bound device (`set_device`) before object collectives and barriers, no CUDA tensor inside a
  pickled object; on a gloo group (`new_group(backend="gloo")`) CPU tensors only. The data part of
  a collective is played as if every rank held what this one holds (all-reduce SUM multiplies by 8).
- `CudaRecorder` stands in for the torch.cuda calls the code makes (8 GPUs, `set_device`, each
  device's RNG state, bf16 support, seeding) and records them; it refuses a rank touching another
  GPU's generator (each such call opens a CUDA context on that GPU, ~500 MB, from every rank).
- `BucketDDP` stands in for DistributedDataParallel, whose C++ reducer needs a real GPU: it checks
  DDP's arguments, broadcasts the module's state at construction and its buffers at each training
  forward (as DDP does, through the checked collectives), skips the reduction under `no_sync`, and
  after backward hands flat gradient buckets to the registered comm hook (the real fp16/bf16/
  PowerSGD/sum hooks) as DDP's reducer would, copying the result back into the gradients.
- `fake_backward`: the autograd engine on fake CUDA tensors needs a CUDA driver, so backward walks
  the graph from the loss to the leaf parameters it reaches, and gives each a gradient of its own
  dtype on its own device, accumulating as autograd does, then runs their post-accumulate hooks.
- Host work runs for real: an op with no fake tensor in and no CUDA device asked for (a sampler's
  permutation, seeding, a model built on the CPU, a DataLoader's collate; `pin_memory` is a marked
  copy, and a `non_blocking` copy to the GPU must come from one), and `torch.load` reads its file
  for real. Files holding fake tensors cannot be written: a test writes a real copy of a state,
  its tensors tagged cuda:3 as a GPU run writes them (`written_on_gpu`), and loading such a tensor
  anywhere but the CPU (no map_location="cpu") is refused.

What this proves: every device placement, transfer, collective and torch.cuda call the code makes on
the GPU path is one a GPU run with NCCL accepts, and the step reads nothing back to the host. What it
cannot: numerics (no values exist; a sanctioned read gives a placeholder, so code that computes with
what it read is exercised, not checked), kernels and their speed, backward's own kernels, NCCL's real
behaviour (hangs, timeouts, ordering across ranks, one rank only is played), DDP's C++ reducer
itself (its bucket order and sizes are approximated), pinned memory's real effect, loader processes
(the tests load in-process), torch.compile, and a real file written from GPU memory. tests/cuda and
`make gpu-check` cover those on a GPU.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, unset_fake_temporarily
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.utils import _pytree as pytree

RANK, WORLD, GPUS = 3, 8, 8
DEVICE = torch.device("cuda", RANK)
NCCL_REDUCE_OPS = {dist.ReduceOp.SUM, dist.ReduceOp.AVG, dist.ReduceOp.PRODUCT, dist.ReduceOp.MIN,
                   dist.ReduceOp.MAX}  # not BAND/BOR/BXOR: ProcessGroupNCCL refuses them


class GpuRuleError(AssertionError):
    """A call a GPU run with NCCL would refuse (or that would go wrong there)."""


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


class CudaRecorder:
    """torch.cuda as seen on a node of 8 GPUs, recording the calls; no CUDA state is touched."""

    def __init__(self) -> None:
        self.current, self.bound, self.calls = 0, False, []
        self.rng = {d: torch.full((16,), d, dtype=torch.uint8) for d in range(GPUS)}  # real CPU tensors

    def index(self, device: Any) -> int:
        """The device index `device` names (an int, "cuda:3", a torch.device), the current one if none."""
        if isinstance(device, int):
            return device
        named = torch.device("cuda" if device is None else device)
        return self.current if named.index is None else named.index

    def check_placed(self, func: Any, device: torch.device) -> None:
        """A CUDA tensor is made on the rank's own GPU, once it is bound: before `set_device`, the
        libraries' handles and streams (and NCCL's communicator) go to cuda:0, from every rank."""
        if device != DEVICE or not self.bound:
            raise GpuRuleError(f"{func}: a tensor on {device} (current device {self.current}, set_device "
                               f"called: {self.bound}); this rank's GPU is {DEVICE}, bound first")

    def own_device(self, call: str, device: Any) -> int:
        index = self.index(device)
        self.calls.append((call, index))
        if index != RANK or not self.bound:
            raise GpuRuleError(f"torch.cuda.{call} on cuda:{index} (set_device called: {self.bound}); "
                               f"this rank's GPU is cuda:{RANK}")
        return index

    def set_device(self, device: Any) -> None:
        self.current = self.index(device)
        self.bound = True
        self.calls.append(("set_device", self.current))

    def get_rng_state(self, device: Any = "cuda") -> torch.Tensor:
        return self.rng[self.own_device("get_rng_state", device)]

    def set_rng_state(self, state: torch.Tensor, device: Any = "cuda") -> None:
        index = self.own_device("set_rng_state", device)
        if isinstance(state, FakeTensor) or state.device.type != "cpu" or state.dtype != torch.uint8:
            raise GpuRuleError(f"torch.cuda.set_rng_state: a {state.dtype} tensor on {state.device}; "
                               "it takes the CPU ByteTensor get_rng_state gave (map_location='cpu')")
        self.rng[index] = state

    def every_gpu(self, *args: Any) -> None:
        raise GpuRuleError("torch.cuda.get/set_rng_state_all: a rank touches every visible GPU's generator "
                           f"(a CUDA context on each of the {GPUS}, and fails where a node has fewer)")

    def patches(self) -> dict[str, Any]:
        return {
            "is_available": lambda: True, "device_count": lambda: GPUS, "is_initialized": lambda: self.bound,
            "current_device": lambda: self.current, "set_device": self.set_device,
            "get_rng_state": self.get_rng_state, "set_rng_state": self.set_rng_state,
            "get_rng_state_all": self.every_gpu, "set_rng_state_all": self.every_gpu,
            "manual_seed": lambda seed: self.calls.append(("manual_seed", seed)),
            "manual_seed_all": lambda seed: self.calls.append(("manual_seed_all", seed)),
            "synchronize": lambda device=None: self.own_device("synchronize", device),
            "is_bf16_supported": lambda including_emulation=True: True,
            "is_current_stream_capturing": lambda: False,
        }


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


def tensors_in(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor inside `obj`'s dicts, lists, tuples and sets."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from tensors_in(value)
    elif isinstance(obj, list | tuple | set):
        for value in obj:
            yield from tensors_in(value)


class CollectiveRules:
    """torch.distributed's collectives, checked as NCCL (default group) or gloo (a control group)."""

    def __init__(self, world: FakeGpuWorld) -> None:
        self.world, self.calls = world, []

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
            if not self.world.cuda.bound:
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
        self.cuda, self.collectives = CudaRecorder(), CollectiveRules(self)
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
        """A host-to-GPU copy asked to be asynchronous is so only from pinned memory."""
        device = kwargs.get("device")
        to_gpu = device is not None and torch.device(device).type == "cuda" and kwargs.get("non_blocking")
        if to_gpu and source.device.type == "cpu" and not getattr(source, "pinned_by_fake_world", False):
            raise GpuRuleError(f"a non_blocking copy of a {tuple(source.shape)} {source.dtype} tensor to "
                               f"{device} from pageable memory: synchronous on a GPU (no pin_memory)")
