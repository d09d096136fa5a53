"""`ddp env`: the machine as a bug report needs it, read the way training reads it.

bf16 support comes from `native_bf16` and the GPU count from `cuda_devices`,
the functions the trainer and preflight call, so what this reports is what a
run does here. Nothing fails: a fact that cannot be read is null, and GPUs
torch cannot use are a finding (`gpu_problem`), the line `ddp train` refuses with.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import Any

import torch

from ddp_cli import __version__
from ddp_cli.distributed import gpus as driver
from ddp_cli.distributed.setup import cuda_devices
from ddp_cli.train.precision import CPU_BF16_FLAGS, native_bf16

# variables that change what ddp or torch does here (none holds a secret)
SETTINGS = ("CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS", "DDP_DATA_TOML", "DDP_WORKER_START", "DDP_DEBUG",
            "NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME")
GIB = 2**30


def machine() -> dict[str, Any]:
    """Versions, accelerators, CPU, memory and collective backends of this machine."""
    import torchvision

    return {
        "ddp": __version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "torchvision": torchvision.__version__,
        "cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "cudnn": cudnn_version(),
        "nccl": nccl_version(),
        "gpus": gpus(),
        "nvidia": nvidia(),
        "gpu_problem": driver.gpu_problem(),
        "cpu": cpu(),
        "memory_gib": memory_gib(),
        "backends": collective_backends(),
        "settings": {name: os.environ[name] for name in SETTINGS if name in os.environ},
    }


def cudnn_version() -> str | None:
    """cuDNN of this torch build as x.y.z (9.x encodes 91002 as 9.10.2, 8.x 8907 as 8.9.7)."""
    version = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    if not version:
        return None
    major, rest = divmod(version, 10000 if version >= 90000 else 1000)
    return f"{major}.{rest // 100}.{rest % 100}"


def nccl_version() -> str | None:
    """NCCL of this torch build (it ships with CUDA builds, GPU or not)."""
    if not (torch.distributed.is_available() and torch.distributed.is_nccl_available()):
        return None
    try:
        return ".".join(str(part) for part in torch.cuda.nccl.version())
    except (RuntimeError, AttributeError):
        return None


def gpus() -> list[dict[str, Any]]:
    """The CUDA devices this process can use: name, memory, compute capability; from the driver
    (NVML) where it answers, so that `ddp env` leaves CUDA uninitialised as a launcher does."""
    count = cuda_devices()
    seen = driver.node_gpus()
    if len(seen) == count:
        return [{"index": index, "name": gpu.name, "memory_gib": gpu.memory_gib,
                 "capability": "{}.{}".format(*gpu.capability)} for index, gpu in enumerate(seen)]
    found = []
    for index in range(count):
        props = torch.cuda.get_device_properties(index)
        found.append({"index": index, "name": props.name, "memory_gib": round(props.total_memory / GIB, 1),
                      "capability": f"{props.major}.{props.minor}"})
    return found


def nvidia() -> dict[str, Any] | None:
    """The NVIDIA driver: its version, the newest CUDA it runs, the GPUs it shows this process
    (torch may not use them: `gpu_problem`); None where there is no driver."""
    nvml = driver.read_nvml()
    if nvml is None:
        return None
    return {"driver": nvml.driver, "cuda": ".".join(map(str, nvml.cuda)) if nvml.cuda else None,
            "gpus": len(driver.visible(nvml.gpus, driver.visible_spec()))}


def cpu() -> dict[str, Any]:
    """Model, CPU counts, and whether it computes bf16 natively (what `precision = "auto"` asks)."""
    info = cpuinfo()
    flags = set(info.get("flags", "").split())
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {
        "model": info.get("model name") or platform.processor() or platform.machine() or None,
        "count": os.cpu_count(),
        "usable": usable,
        "bf16_native": native_bf16(torch.device("cpu")),
        "bf16_flags": [flag for flag in CPU_BF16_FLAGS if flag in flags],
    }


def cpuinfo() -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo (empty where there is none: not Linux)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {}
    fields: dict[str, str] = {}
    for line in text.split("\n\n", 1)[0].splitlines():
        key, sep, value = line.partition(":")
        if sep:
            fields.setdefault(key.strip(), value.strip())
    return fields


def memory_gib() -> float | None:
    try:
        return round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB, 1)
    except (ValueError, OSError, AttributeError):
        return None


def collective_backends() -> dict[str, bool]:
    """Which torch.distributed backends this build has (gloo for CPU workers, nccl for GPUs)."""
    dist = torch.distributed
    if not dist.is_available():
        return {"gloo": False, "nccl": False, "mpi": False}
    return {"gloo": dist.is_gloo_available(), "nccl": dist.is_nccl_available(),
            "mpi": dist.is_mpi_available()}
