"""The node's NVIDIA GPUs as the driver (NVML) sees them, read without initialising CUDA.

The launcher must not initialise CUDA: a context on GPU 0 costs every node
hundreds of MB there, and a process that initialised CUDA cannot fork. NVML
(libnvidia-ml.so.1, part of the driver, what `nvidia-smi` and torch's own
`device_count` read) answers what the launcher needs: how many GPUs, their
compute capability (bf16 in hardware from 8.0) and the driver's version.
It also tells a GPU torch cannot use (`gpu_problem`): NVML sees it, torch does
not, because the driver is older than the CUDA torch was built for, or the
wheel is a CPU build; "auto" would then quietly train on the CPU.
"""

from __future__ import annotations

import ctypes
import re
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

DRIVER_FILE = Path("/proc/driver/nvidia/version")
# CUDA versions pytorch.org publishes wheels for (https://download.pytorch.org/whl/cuXYZ)
WHEEL_CUDA = ((11, 8), (12, 1), (12, 4), (12, 6), (12, 8), (12, 9), (13, 0))


@dataclass(frozen=True)
class Gpu:
    index: int  # NVML's index (PCI order), what CUDA_VISIBLE_DEVICES numbers
    name: str
    uuid: str
    memory_gib: float
    capability: tuple[int, int]


@dataclass(frozen=True)
class Nvml:
    """What the driver reports: its version, the newest CUDA it runs, and every GPU of the node."""

    driver: str | None
    cuda: tuple[int, int] | None  # the newest CUDA version this driver supports
    gpus: list[Gpu] = field(default_factory=list)


def read_nvml(lib: Any = None) -> Nvml | None:
    """The driver's view through NVML's C API (ctypes: pynvml need not be installed); None where
    there is no NVIDIA driver (no library, or it does not initialise)."""
    try:
        lib = lib or ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return None
    if lib.nvmlInit_v2() != 0:
        return None
    try:
        return Nvml(nvml_string(lib.nvmlSystemGetDriverVersion), nvml_cuda(lib), nvml_gpus(lib))
    finally:
        lib.nvmlShutdown()


def nvml_string(function: Any, *args: Any) -> str | None:
    buffer = ctypes.create_string_buffer(96)
    return buffer.value.decode() if function(*args, buffer, ctypes.c_uint(96)) == 0 else None


def nvml_cuda(lib: Any) -> tuple[int, int] | None:
    version = ctypes.c_int(0)
    if lib.nvmlSystemGetCudaDriverVersion_v2(ctypes.byref(version)) != 0 or not version.value:
        return None
    return version.value // 1000, version.value % 1000 // 10  # 12020 -> 12.2


def nvml_gpus(lib: Any) -> list[Gpu]:
    count = ctypes.c_uint(0)
    if lib.nvmlDeviceGetCount_v2(ctypes.byref(count)) != 0:
        return []
    gpus = []
    for index in range(count.value):
        handle = ctypes.c_void_p()
        if lib.nvmlDeviceGetHandleByIndex_v2(ctypes.c_uint(index), ctypes.byref(handle)) != 0:
            continue
        major, minor = ctypes.c_int(0), ctypes.c_int(0)
        lib.nvmlDeviceGetCudaComputeCapability(handle, ctypes.byref(major), ctypes.byref(minor))
        memory = (ctypes.c_ulonglong * 3)()  # nvmlMemory_t: total, free, used
        lib.nvmlDeviceGetMemoryInfo(handle, ctypes.byref(memory))
        gpus.append(Gpu(index, nvml_string(lib.nvmlDeviceGetName, handle) or "?",
                        nvml_string(lib.nvmlDeviceGetUUID, handle) or "", round(memory[0] / 2**30, 1),
                        (major.value, minor.value)))
    return gpus


def visible(gpus: list[Gpu], spec: Sequence[int | str] | None) -> list[Gpu]:
    """The GPUs CUDA_VISIBLE_DEVICES leaves this process, as CUDA reads it: indices or UUID
    prefixes, up to the first that names no GPU. MIG instances are not resolved: all GPUs."""
    if spec is None:
        return gpus
    chosen = []
    for item in spec:
        if isinstance(item, str) and item.startswith("MIG-"):
            return gpus
        match = [g for g in gpus if g.index == item] if isinstance(item, int) else \
            [g for g in gpus if g.uuid.startswith(item)]
        if len(match) != 1:
            break
        chosen.append(match[0])
    return chosen


def visible_spec() -> Sequence[int | str] | None:
    """CUDA_VISIBLE_DEVICES parsed as torch parses it; None where it is unset."""
    import os

    if "CUDA_VISIBLE_DEVICES" not in os.environ:
        return None
    try:
        return torch.cuda._parse_visible_devices()
    except (AttributeError, RuntimeError, ValueError):  # a private helper: gone in another torch
        return None


def node_gpus() -> list[Gpu]:
    """This process's GPUs as NVML sees them ([] without an NVIDIA driver)."""
    nvml = read_nvml()
    return visible(nvml.gpus, visible_spec()) if nvml else []


def driver_version() -> str | None:
    """The NVIDIA driver's version: NVML's, else the kernel module's (/proc/driver/nvidia/version)."""
    nvml = read_nvml()
    if nvml and nvml.driver:
        return nvml.driver
    try:
        found = re.search(r"Module(?: for \S+)?\s+(\d+\.\d+(?:\.\d+)?)", DRIVER_FILE.read_text())
    except OSError:
        return None
    return found.group(1) if found else None


def cuda_bf16_native() -> bool:
    """Whether this process's GPUs compute bf16 in hardware (capability 8.0+, all of them), asked
    without initialising CUDA here: from NVML, else from a child process."""
    gpus = node_gpus()
    if gpus:
        capability = min(g.capability for g in gpus)
    else:
        capability = probe_capability() if torch_sees_gpus() else None
    return capability is not None and capability >= (8, 0)


def probe_capability() -> tuple[int, int] | None:
    """Device 0's compute capability read by a child process (torch initialises CUDA to read it):
    for drivers whose NVML cannot be loaded; costs a Python start-up (~2 s)."""
    code = "import torch; print(*torch.cuda.get_device_capability(0))"
    try:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                              check=True)
        major, minor = done.stdout.split()
    except (subprocess.SubprocessError, OSError, ValueError):
        return None
    return int(major), int(minor)


def gpu_problem(gpus: list[Gpu] | None = None, runs: tuple[int, int] | None = None,
                driver: str | None = None) -> str | None:
    """Why torch cannot use the GPUs the driver shows this process, and the fix; None when it can
    (or there are none). `runs`: the newest CUDA the driver runs. Asking torch initialises the CUDA
    driver API, not a CUDA context."""
    if gpus is None:
        nvml = read_nvml()
        gpus = visible(nvml.gpus, visible_spec()) if nvml else []
        runs, driver = (nvml.cuda, nvml.driver) if nvml else (None, None)
    if not gpus or torch_sees_gpus():
        return None
    seen = f"the NVIDIA driver shows {len(gpus)} GPU{'s' if len(gpus) > 1 else ''} ({gpus[0].name})"
    if torch.version.cuda is None:
        return f"{seen} but torch {torch.__version__} is a CPU-only build; install {wheel_hint(runs)}"
    driver = driver or driver_version() or "?"
    built = tuple(int(part) for part in torch.version.cuda.split(".")[:2])
    if runs and runs < built:
        return (f"{seen} but torch cannot use them: driver {driver} runs CUDA up to {runs[0]}.{runs[1]} and "
                f"torch {torch.__version__} was built for CUDA {torch.version.cuda}; install a newer NVIDIA "
                f"driver (one for CUDA {torch.version.cuda}), or {wheel_hint(runs)}")
    return (f"{seen} but torch {torch.__version__} (CUDA {torch.version.cuda}) cannot initialise CUDA with "
            f"driver {driver}; `python -c \"import torch; torch.cuda.init()\"` shows the driver's error")


def wheel_hint(cuda: tuple[int, int] | None) -> str:
    """The pip command for the newest torch wheel this driver runs: any CUDA of the driver's major
    version (CUDA's minor version compatibility: 11.x wheels run on drivers for 11.0+, 12.x on 12.0+)."""
    fitting = [v for v in WHEEL_CUDA if cuda is None or v[0] <= cuda[0]]
    if not fitting:
        return "no torch wheel is built for a CUDA that old: update the NVIDIA driver"
    major, minor = fitting[-1]
    return (f"the torch wheel for CUDA {major}.{minor}: pip install torch torchvision "
            f"--index-url https://download.pytorch.org/whl/cu{major}{minor}")


def torch_sees_gpus() -> bool:
    """torch.cuda.is_available(), without its warning (the caller names the problem itself)."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.cuda.is_available()
