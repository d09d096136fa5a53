"""torch.cuda as the fake GPU world plays it (fakegpu.py): 8 GPUs, their calls recorded and checked."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor

from gpu_rules.node import DEVICE, GPUS, RANK, GpuRuleError


class CudaRecorder:
    """torch.cuda as seen on a node of 8 GPUs, recording the calls; no CUDA state is touched."""

    def __init__(self) -> None:
        self.current, self.bound, self.calls = 0, False, []
        self.rng = {d: torch.full((16,), d, dtype=torch.uint8) for d in range(GPUS)}  # real CPU tensors
        self.streams = [FakeStream(self, "default")]  # the current stream last

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

    def current_stream(self, device: Any = None) -> FakeStream:
        self.own_device("current_stream", device)
        return self.streams[-1]

    def new_stream(self, device: Any = None, priority: int = 0) -> FakeStream:
        self.own_device("Stream", device)
        return FakeStream(self, f"stream {len(self.calls)}")

    @contextlib.contextmanager
    def stream(self, stream: FakeStream) -> Iterator[None]:
        self.streams.append(stream)
        self.calls.append(("stream", stream.name))
        try:
            yield
        finally:
            self.streams.pop()

    def record_stream(self, tensor: torch.Tensor, stream: Any) -> None:
        """Tensor.record_stream: a tensor on this rank's GPU, a stream of it."""
        if tensor.device != DEVICE or not isinstance(stream, FakeStream):
            raise GpuRuleError(f"record_stream of a tensor on {tensor.device} with {stream!r}: a CUDA tensor "
                               f"of this rank's GPU ({DEVICE}) and a stream")
        self.calls.append(("record_stream", stream.name))

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
            "current_stream": self.current_stream, "Stream": self.new_stream, "stream": self.stream,
        }


class FakeStream:
    """A CUDA stream of the rank's GPU: its name, and its waits recorded in the recorder's calls."""

    def __init__(self, recorder: CudaRecorder, name: str) -> None:
        self.recorder, self.name = recorder, name

    def wait_stream(self, other: FakeStream) -> None:
        self.recorder.calls.append(("wait_stream", self.name, other.name))

    def __repr__(self) -> str:
        return f"FakeStream({self.name!r})"
