"""train.precision: "auto" is bf16 only where the hardware computes it; fp16 only on CUDA."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ddp_cli.errors import ConfigError
from ddp_cli.train import precision

CPU = torch.device("cpu")


@pytest.mark.parametrize(("flags", "expected"), [
    ("fpu sse avx2 avx512f avx512_bf16 amx_tile", "bf16"),
    ("fpu sse avx2 amx_bf16", "bf16"),
    ("fpu sse avx2 avx512f avx512_vnni", "fp32"),  # AVX-512 without BF16: bf16 would be emulated
])
def test_auto_is_bf16_only_where_the_cpu_has_it(monkeypatch, flags, expected):
    real = Path.read_text
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: f"flags\t\t: {flags}\n"
                        if str(self) == "/proc/cpuinfo" else real(self, *a, **k))
    assert precision.native_precision(CPU) == expected


@pytest.mark.parametrize(("told", "expected"), [("native", "bf16"), ("emulated", "fp32")])
def test_ddp_cpu_bf16_makes_auto_resolve_as_on_the_other_kind_of_cpu(monkeypatch, told, expected):
    monkeypatch.setenv("DDP_CPU_BF16", told)
    assert precision.native_precision(CPU) == expected


def test_a_misspelt_ddp_cpu_bf16_is_one_line_naming_it(monkeypatch):
    monkeypatch.setenv("DDP_CPU_BF16", "yes")
    with pytest.raises(ConfigError, match='DDP_CPU_BF16=yes: write "native" or "emulated"'):
        precision.native_precision(CPU)


def test_fp16_needs_cuda_and_the_others_run_anywhere():
    for kept in ("fp32", "bf16", "auto"):
        precision.check_precision(kept, CPU)
    with pytest.raises(ConfigError, match="train.precision: fp16 needs CUDA"):
        precision.check_precision("fp16", CPU)
    precision.check_precision("fp16", torch.device("cuda", 0))


def test_auto_on_cuda_asks_for_native_bf16_not_emulation(monkeypatch):
    """In a worker, which has initialised CUDA (the launcher asks the driver: test_gpus.py)."""
    asked = {}
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported",
                        lambda including_emulation=True: asked.setdefault("emulation", including_emulation))
    assert precision.native_precision(torch.device("cuda", 0)) == "fp32"
    assert asked == {"emulation": False}


def test_autocast_is_a_no_op_in_fp32_and_lowers_matmuls_in_bf16():
    x = torch.randn(4, 4)
    with precision.autocast(CPU, "fp32"):
        assert (x @ x).dtype == torch.float32
    with precision.autocast(CPU, "bf16"):
        assert (x @ x).dtype == torch.bfloat16


@pytest.mark.parametrize(("precision_", "warns"), [("fp16", False), ("fp32", True)])
def test_a_step_the_scaler_skips_does_not_warn_about_the_schedule_under_fp16(precision_, warns):
    """Under fp16 the GradScaler skips the step whose gradients overflowed while the schedule goes
    on (it counts steps): torch's order warning is a false alarm there, and only there."""
    import warnings

    weight = torch.nn.Parameter(torch.ones(2))
    optimizer = torch.optim.SGD([weight], lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        scaler = precision.grad_scaler(CPU, precision_)
        if precision_ == "fp32":  # no scaler: a step that was never taken, as the scaler's skip looks
            assert not scaler.is_enabled()
        else:
            assert scaler.is_enabled()
            scaler.scale((weight * torch.tensor([float("inf"), 1.0])).sum()).backward()  # overflows
            scaler.step(optimizer)
            assert weight.tolist() == [1.0, 1.0]  # skipped
        scheduler.step()
    assert any("lr_scheduler.step()" in str(w.message) for w in seen) == warns


@pytest.mark.parametrize(("isa", "expected"), [("AVX2", "fp32"), ("avx512_core", "fp32"),
                                               ("AVX512_CORE_BF16", "bf16"), ("", "bf16")])
def test_kernels_held_below_avx512_bf16_emulate_it_so_auto_is_fp32(monkeypatch, isa, expected):
    real = Path.read_text
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: "flags\t\t: avx2 avx512f avx512_bf16\n"
                        if str(self) == "/proc/cpuinfo" else real(self, *a, **k))
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", isa)
    assert precision.native_precision(CPU) == expected
