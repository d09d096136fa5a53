"""Host syncs counted on any machine: the operations that would make the host wait for the GPU.

On a GPU, reading a device tensor's value (`.item()`, `.tolist()`, `bool()`,
`float()`, `int()`), an operation whose output size depends on the data
(`nonzero`, a boolean-mask index, `unique`) and a blocking copy from pageable
host memory (`torch.tensor(data, device=...)`, `.to(device)` without
`non_blocking`) all stall the host until the device has caught up. On a CPU
nothing stalls, so `HostSyncs` counts the operations instead, seeing every
torch call through a TorchFunctionMode.

Which tensors live "on the device" is tracked, since on a CPU run all are
CPU tensors: a tensor made with no device named and no device input (a
CPU random draw, a batch as the loader collates it, the counters of an
optimiser's step) is a host tensor, and so is whatever is computed only from
host tensors; `.to(device)` moves one to the device. Everything else counts
as on the device, tensors made before the mode or out of its sight included
(parameters, gradients), so an unknown tensor is counted, never missed.
"""

from __future__ import annotations

import traceback
from collections import Counter

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

READS = {"item", "tolist", "__bool__", "__float__", "__int__", "__index__", "__complex__", "is_nonzero",
         "numpy", "__array__", "cpu", "equal", "allclose"}  # a device value brought to the host
DATA_SIZED = {"nonzero", "argwhere", "masked_select", "unique", "unique_consecutive"}  # output size
FROM_HOST_DATA = {"tensor", "as_tensor", "asarray"}  # Python data copied to the named device
MOVES = {"to", "cuda"}


class HostSyncs(TorchFunctionMode):
    """Within `with HostSyncs(device) as syncs:`, `syncs.seen` lists each would-be sync as
    "kind at file:line (function)", naming the first frame in ddp_cli (else the caller)."""

    def __init__(self, device: torch.device | str) -> None:
        super().__init__()
        self.device = torch.device(device)
        self.host = WeakIdKeyDictionary()  # the tensors known to be in host memory
        self.seen: list[str] = []

    def __len__(self) -> int:
        return len(self.seen)

    def report(self, since: int = 0) -> str:
        """The syncs from the `since`-th on, one line per kind and place, with its count."""
        return "\n".join(f"{n} x {sync}" for sync, n in Counter(self.seen[since:]).items())

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        kind = self.sync_kind(name, args, kwargs, inputs)
        if kind:
            self.seen.append(f"{kind} at {where()}")
        out = func(*args, **kwargs)
        if not (name.endswith("_") and not name.startswith("__")):  # in place: the target stays put
            on_host = self.output_on_host(name, args, kwargs, inputs)
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    if on_host:
                        self.host[t] = True
                    else:
                        self.host.pop(t, None)
        return out

    def on_device(self, t: torch.Tensor) -> bool:
        return t not in self.host

    def is_device(self, where) -> bool:
        return torch.device(where).type == self.device.type

    def destination(self, name: str, args, kwargs) -> bool | None:
        """Where `.to`/`.cuda` sends a tensor: True the device, False the host, None nowhere new."""
        if name == "cuda":
            return True
        for a in (*args[1:], kwargs.get("device")):
            if isinstance(a, torch.Tensor):
                return self.on_device(a)
            if isinstance(a, str | torch.device):
                return self.is_device(a)
        return None

    def sync_kind(self, name: str, args, kwargs, inputs: list[torch.Tensor]) -> str | None:
        first = args[0] if args and isinstance(args[0], torch.Tensor) else None
        blocking = not kwargs.get("non_blocking", False)
        if first is not None and self.on_device(first) and (name in READS or name in DATA_SIZED):
            return name
        if first is not None and self.on_device(first) and name == "where" and len(args) == 1:
            return "where"
        if first is not None and self.on_device(first) and name in ("__getitem__", "__setitem__") and any(
                t.dtype == torch.bool for t in tree_leaves(args[1]) if isinstance(t, torch.Tensor)):
            return "boolean mask"
        if name in FROM_HOST_DATA and kwargs.get("device") is not None and self.is_device(kwargs["device"]):
            return f"torch.{name}(host data, device)"
        if name in MOVES and first is not None and blocking:
            to_device = self.destination(name, args, kwargs)
            if to_device is not None and to_device != self.on_device(first):
                return "blocking copy to the device" if to_device else "copy to the host"
        if name == "copy_" and blocking and isinstance(args[1], torch.Tensor) \
                and self.on_device(args[0]) != self.on_device(args[1]):
            return "blocking copy_"
        return None

    def output_on_host(self, name: str, args, kwargs, inputs: list[torch.Tensor]) -> bool:
        if name in ("cpu", "numpy"):
            return True
        if name in MOVES:
            to_device = self.destination(name, args, kwargs)
            if to_device is not None:
                return not to_device
        elif kwargs.get("device") is not None:
            return not self.is_device(kwargs["device"])
        return all(t in self.host for t in inputs)  # no tensor input, no device named: made on the host


def where() -> str:
    """The first frame in ddp_cli that led here (else the frame that called into torch)."""
    frames = [f for f in traceback.extract_stack()[:-2] if "/torch/" not in f.filename]
    ours = [f for f in frames if "/ddp_cli/" in f.filename] or frames
    frame = ours[-1]
    return f"{frame.filename.rsplit('/', 2)[-2]}/{frame.filename.rsplit('/', 1)[-1]}:{frame.lineno} " \
           f"({frame.name})"
