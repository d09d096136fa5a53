"""Autocast precision: what each `train.precision` means on a device, "auto" included.

bf16 is only fast where the hardware computes it (CUDA from Ampere, CPUs with
AVX-512 BF16 or AMX: about 2x fp32's steps/s there: BENCHMARKS.md, "Training step"); elsewhere it is emulated
and slower than fp32. So "auto" picks bf16 only where it is native. `DDP_CPU_BF16=native|emulated`
overrides what the CPU's flags say: to see, on any machine, what `auto` does on the other kind
(docs/development.md, "Other CPUs").
"""

from __future__ import annotations

import os
import warnings
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path

import torch

from ddp_cli.distributed.gpus import cuda_bf16_native
from ddp_cli.errors import ConfigError

AUTOCAST = {"bf16": torch.bfloat16, "fp16": torch.float16}
CPU_BF16_FLAGS = ("avx512_bf16", "amx_bf16")
# oneDNN's instruction sets below its first with bf16 arithmetic (AVX512_CORE_BF16)
ONEDNN_ISAS_WITHOUT_BF16 = {"SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE",
                            "AVX512_CORE_VNNI"}
CPU_BF16_OVERRIDE = "DDP_CPU_BF16"  # "native" | "emulated": what auto takes the CPU for
# torch's warning when a schedule steps past an optimizer step the GradScaler skipped (see grad_scaler)
SKIPPED_STEP_WARNING = r"Detected call of `lr_scheduler\.step\(\)` before `optimizer\.step\(\)`"


def native_bf16(device: torch.device) -> bool:
    """Whether `device` computes bf16 in hardware (CUDA: capability 8.0+; CPU: AVX-512 BF16 / AMX).

    torch's own check initialises CUDA (`current_device`): a worker has anyway, the launcher must
    not (`gpus`), so there the capability comes from the driver (NVML)."""
    if device.type == "cuda":
        if torch.cuda.is_initialized():
            return torch.cuda.is_bf16_supported(including_emulation=False)
        return cuda_bf16_native()
    told = os.environ.get(CPU_BF16_OVERRIDE, "")
    if told in ("native", "emulated"):
        return told == "native"
    if told:
        raise ConfigError(f'{CPU_BF16_OVERRIDE}={told}: write "native" or "emulated", or unset it to read '
                          "the CPU's flags")
    return cpu_has_bf16()


def cpu_has_bf16() -> bool:
    """What the CPU's flags say, whatever `DDP_CPU_BF16` makes of them: what a bf16 step costs here. A
    CPU whose oneDNN kernels are held below AVX-512 BF16 (`ONEDNN_MAX_CPU_ISA`) emulates it."""
    if os.environ.get("ONEDNN_MAX_CPU_ISA", "").upper() in ONEDNN_ISAS_WITHOUT_BF16:
        return False
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:  # not Linux: do not guess
        return False
    return any(flag in flags for flag in CPU_BF16_FLAGS)


def runs_natively(precision: str, device: torch.device) -> bool:
    """Whether `device` computes `precision` at full speed: fp32 anywhere, fp16 on CUDA, bf16 where
    `native_bf16`."""
    if precision == "bf16":
        return native_bf16(device)
    return precision == "fp32" or (precision == "fp16" and device.type == "cuda")


def native_precision(device: torch.device) -> str:
    """What train.precision "auto" means on `device`: bf16 where it is native, else fp32."""
    return "bf16" if native_bf16(device) else "fp32"


def check_precision(precision: str, device: torch.device) -> None:
    """fp16 trains with a GradScaler, which needs CUDA."""
    if precision == "fp16" and device.type != "cuda":
        raise ConfigError('train.precision: fp16 needs CUDA (GradScaler); use "bf16" or "auto" on CPU')


def autocast(device: torch.device, precision: str) -> AbstractContextManager:
    if precision == "fp32":
        return nullcontext()
    return torch.autocast(device.type, dtype=AUTOCAST[precision])


def grad_scaler(device: torch.device, precision: str) -> torch.amp.GradScaler:
    """The loss scaler: active under fp16 only, where it skips the optimizer step whose gradients
    overflowed (the first ones, while it finds its scale).

    The LR schedule still advances on such a step, by design: it counts training steps, so a resumed
    run lands on the same LR. torch takes that for a call in the wrong order and warns on every rank
    (seen on a GPU); under fp16 that warning is a false alarm, silenced in this worker process.
    """
    if precision == "fp16":
        warnings.filterwarnings("ignore", SKIPPED_STEP_WARNING, UserWarning)
    return torch.amp.GradScaler(device.type, enabled=precision == "fp16")
