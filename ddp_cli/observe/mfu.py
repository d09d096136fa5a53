"""Model FLOPs utilisation: the share of the devices' peak a run's model arithmetic used.

MFU = images/s x FLOPs per image (forward and backward, at the epoch's train crop: ddp_cli/flops.py)
/ (peak FLOP/s of one device at the run's precision x world size). Only the model's own FLOPs count
(not the optimizer's, the data pipeline's or recomputation), so it compares runs and machines alike.

The peak: on a GPU, NVIDIA's datasheet figure for the card (dense, no sparsity) at the precision
(`GPU_PEAKS`); on a CPU, measured once by a matmul probe at the precision and thread count
(`cpu_peak`), cached in ~/.cache/ddp/peak_flops.json by CPU model, flags, torch version, threads and
precision (a corrupt cache is ignored and rewritten). Neither is part of the run's config: they are
facts of the machine, not choices.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ddp_cli.flops import flops_per_image

log = logging.getLogger("ddp")

TERA = 1e12
# Dense tensor-core (and FP32 CUDA-core) peaks in TFLOP/s from NVIDIA's datasheets (their "with
# sparsity" figures halved). Most specific name first: "A100" contains "A10", "H100 PCIe" "H100".
GPU_PEAKS: tuple[tuple[str, str, dict[str, float]], ...] = (
    ("H200 NVL", "NVIDIA H200 NVL datasheet", {"bf16": 835.5, "fp16": 835.5, "tf32": 417.5, "fp32": 60.0}),
    ("H200", "NVIDIA H200 SXM datasheet", {"bf16": 989.5, "fp16": 989.5, "tf32": 494.5, "fp32": 67.0}),
    ("H100 NVL", "NVIDIA H100 NVL datasheet", {"bf16": 835.5, "fp16": 835.5, "tf32": 417.5, "fp32": 60.0}),
    ("H100 PCIe", "NVIDIA H100 PCIe datasheet", {"bf16": 756.5, "fp16": 756.5, "tf32": 378.0, "fp32": 51.0}),
    ("H100", "NVIDIA H100 SXM datasheet", {"bf16": 989.5, "fp16": 989.5, "tf32": 494.5, "fp32": 67.0}),
    ("A100", "NVIDIA A100 datasheet", {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5}),
    ("L40S", "NVIDIA L40S datasheet", {"bf16": 362.05, "fp16": 362.05, "tf32": 183.0, "fp32": 91.6}),
    ("L4", "NVIDIA L4 datasheet", {"bf16": 121.0, "fp16": 121.0, "tf32": 60.0, "fp32": 30.3}),
    ("A10", "NVIDIA A10 datasheet", {"bf16": 125.0, "fp16": 125.0, "tf32": 62.5, "fp32": 31.2}),
    ("V100-PCIE", "NVIDIA V100 PCIe datasheet", {"fp16": 112.0, "fp32": 14.0}),
    ("V100", "NVIDIA V100 SXM2 datasheet", {"fp16": 125.0, "fp32": 15.7}),
    ("T4", "NVIDIA T4 datasheet", {"fp16": 65.0, "fp32": 8.1}),
)
# n x n matmuls, timed after two to warm up, for PROBE_SECONDS (at least PROBE_REPEATS of them): the fastest
# counts, so a busy machine's slow ones do not lower the peak
PROBE_SIDE, PROBE_REPEATS, PROBE_SECONDS = 1024, 3, 1.0
PROBE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
CACHE_FILE = "peak_flops.json"


@dataclass(frozen=True)
class Peak:
    """One device's peak FLOP/s at a precision, and where the figure comes from."""

    flops: float
    source: str


def gpu_peak(name: str, precision: str, tf32: bool) -> Peak | None:
    """The datasheet's peak of the GPU named `name` (torch's device name) at `precision`; fp32 where
    TF32 is allowed (torch's default for convolutions) is judged against the TF32 figure. None for a
    card or precision the table does not know."""
    key = "tf32" if precision == "fp32" and tf32 else precision
    for pattern, sheet, peaks in GPU_PEAKS:
        if pattern.lower() in name.lower():
            return Peak(peaks[key] * TERA, f"{sheet}, {key} dense") if key in peaks else None
    return None


def cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "ddp"


def cpu_key(precision: str, threads: int) -> str:
    """What a CPU probe's figure depends on: the CPU model, its flags, torch, the threads, the precision."""
    model, flags = "unknown CPU", ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            name, _, value = line.partition(":")
            if name.strip() == "model name" and model == "unknown CPU":
                model = value.strip()
            elif name.strip() == "flags" and not flags:
                flags = value.strip()
    except OSError:  # not Linux: the model and flags are not known; torch's capability still is
        pass
    flags += " " + torch.backends.cpu.get_cpu_capability()
    digest = hashlib.sha1(flags.encode()).hexdigest()[:12]
    return f"{model}|flags {digest}|torch {torch.__version__}|{threads} threads|{precision}"


def probe_cpu(precision: str, threads: int) -> float:
    """FLOP/s of the fastest of a few `PROBE_SIDE`-square matmuls at `precision` on `threads` threads."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        dtype = PROBE_DTYPES.get(precision, torch.float32)
        a, b = (torch.randn(PROBE_SIDE, PROBE_SIDE, dtype=dtype) for _ in range(2))
        a @ b
        a @ b
        times: list[float] = []
        until = time.perf_counter() + PROBE_SECONDS
        while len(times) < PROBE_REPEATS or time.perf_counter() < until:
            started = time.perf_counter()
            a @ b
            times.append(time.perf_counter() - started)
        return 2 * PROBE_SIDE**3 / min(times)
    finally:
        torch.set_num_threads(before)


def cpu_peak(precision: str, threads: int | None = None) -> Peak:
    """This CPU's matmul rate at `precision` on `threads` threads (this process's by default): the
    cached figure, or measured once and cached."""
    threads = threads or torch.get_num_threads()
    key, path = cpu_key(precision, threads), cache_dir() / CACHE_FILE
    try:
        cached = json.loads(path.read_text())
        if not isinstance(cached, dict):
            cached = {}
    except (OSError, ValueError):  # none yet, or cut short: measured again and rewritten
        cached = {}
    flops = cached.get(key)
    if not isinstance(flops, (int, float)) or flops <= 0:
        flops = probe_cpu(precision, threads)
        cached[key] = flops
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(cached, indent=1))
            tmp.replace(path)
        except OSError as e:  # a read-only home: measured each run instead
            log.debug(f"MFU: peak not cached at {path}: {e}")
    return Peak(flops, f"measured: {PROBE_SIDE}x{PROBE_SIDE} {precision} matmul, {threads} thread(s), "
                       f"{key.split('|')[0]}")


def device_peak(device: torch.device, precision: str) -> Peak | None:
    """One device's peak at `precision`: the table's for a GPU (None for one it lacks), the probe's on a
    CPU."""
    if device.type == "cuda":
        return gpu_peak(torch.cuda.get_device_name(device), precision, torch.backends.cudnn.allow_tf32)
    return cpu_peak(precision)


@dataclass(frozen=True)
class Utilisation:
    """What MFU needs, found once at the start: FLOPs per image at each train crop, a device's peak, the
    world size. `of` is arithmetic on host floats: no device work, no sync."""

    flops: dict[int, float]
    peak: Peak
    world_size: int

    def of(self, images_per_second: float, size: int) -> float | None:
        flops = self.flops.get(size)
        return None if flops is None else images_per_second * flops / (self.peak.flops * self.world_size)

    def about(self) -> dict[str, object]:
        """The peak used, named (`train --json`'s and `bench step --json`'s keys)."""
        return {"peak_flops": self.peak.flops, "peak_source": self.peak.source,
                "flops_per_image": {str(size): flops for size, flops in sorted(self.flops.items())}}


def measure(model: nn.Module, sizes: Iterable[int], device: torch.device, precision: str,
            world_size: int, images: int = 1) -> Utilisation | None:
    """MFU's facts for `model` (on the meta device) at `sizes` on `device`, each counted image taking
    `images` through the model (FixMatch's unlabelled views); None, said once, where the model's FLOPs
    cannot be counted or the device's peak is not known: the run goes on without MFU."""
    try:
        flops = {size: images * flops_per_image(model, size) for size in sorted(set(sizes))}
    except Exception as e:  # noqa: BLE001 (a user's model may do anything on the meta device)
        # the exception's type only: where it is the model's own bug, the run says it once, when it trains
        log.warning(f"MFU: not reported: the model's FLOPs could not be counted on the meta device "
                    f"({type(e).__name__})")
        log.debug("MFU: the count failed with %s", e)
        return None
    if not all(flops.values()):
        log.warning("MFU: not reported: torch's FLOP counter counts none of this model's operations")
        return None
    peak = device_peak(device, precision)
    if peak is None:
        log.warning(f"MFU: not reported: no peak FLOP/s known for {torch.cuda.get_device_name(device)} at "
                    f"{precision} (ddp_cli/observe/mfu.py GPU_PEAKS)")
        return None
    return Utilisation(flops, peak, world_size)
