"""MFU (observe/mfu.py): FLOPs counted forward and backward, the peak's table and probe cache, the share."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from torch import nn

from ddp_cli.config import ModelConfig
from ddp_cli.flops import flops_per_image
from ddp_cli.models.check import tensors_on_meta
from ddp_cli.models.zoo import build_model
from ddp_cli.observe import mfu
from ddp_cli.observe.mfu import Peak, Utilisation, cpu_peak, gpu_peak, measure


def meta_model(name: str = "resnet_tiny") -> nn.Module:
    with tensors_on_meta():
        return build_model(ModelConfig(name=name), 10, 32).train()


def test_backward_is_counted_not_guessed():
    """The backward's FLOPs are torch's count: about twice the forward's (not a fixed x3), and fewer
    with the body frozen (no weight gradients there)."""
    model = meta_model()
    forward, step = flops_per_image(model, 32, train=False), flops_per_image(model, 32)
    assert 2.5 < step / forward < 3.05 and step / forward != 3
    assert all(p.grad is None for p in model.parameters())  # the counting leaves no meta gradients
    for name, p in model.named_parameters():
        p.requires_grad_(name.startswith("head"))
    assert forward < flops_per_image(model, 32) < step
    assert flops_per_image(model, 64, train=False) == pytest.approx(4 * forward, rel=0.01)  # convs: area


@pytest.mark.parametrize(("name", "precision", "tf32", "tflops", "sheet"), [
    ("NVIDIA A100-SXM4-80GB", "bf16", True, 312, "A100"),
    ("NVIDIA A10", "bf16", True, 125, "A10 "),  # not the A100's: the table is most specific first
    ("NVIDIA H100 PCIe", "bf16", True, 756.5, "H100 PCIe"),
    ("NVIDIA H100 80GB HBM3", "fp16", True, 989.5, "H100 SXM"),
    ("NVIDIA H200", "fp32", True, 494.5, "tf32"),  # fp32 with TF32 allowed: the TF32 figure
    ("NVIDIA H200", "fp32", False, 67, "fp32"),
    ("NVIDIA L4", "bf16", True, 121, "L4"),
])
def test_gpu_peak_from_the_datasheet_table(name, precision, tf32, tflops, sheet):
    peak = gpu_peak(name, precision, tf32)
    assert peak.flops == tflops * 1e12 and sheet in peak.source and "datasheet" in peak.source


def test_gpu_peak_unknown_card_or_precision():
    assert gpu_peak("Tesla V100-SXM2-16GB", "bf16", True) is None  # Volta has no bf16
    assert gpu_peak("Some Future GPU", "bf16", True) is None


def test_cpu_peak_measured_once_cached_and_a_corrupt_cache_rewritten(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    probes = []
    monkeypatch.setattr(mfu, "probe_cpu", lambda *key: probes.append(key) or 5e10)
    first = cpu_peak("bf16", 2)
    assert first.flops == 5e10 and "measured" in first.source and probes == [("bf16", 2)]
    assert cpu_peak("bf16", 2) == first and len(probes) == 1  # cached
    cpu_peak("fp32", 2)
    cpu_peak("bf16", 1)
    assert probes[1:] == [("fp32", 2), ("bf16", 1)]  # keyed by precision and threads
    cache = tmp_path / "ddp" / mfu.CACHE_FILE
    assert len(json.loads(cache.read_text())) == 3
    cache.write_text('{"cut short')
    assert cpu_peak("bf16", 2).flops == 5e10 and len(probes) == 4
    assert len(json.loads(cache.read_text())) == 1  # rewritten, readable again


def test_probe_measures_a_matmul_rate():
    assert 1e8 < mfu.probe_cpu("fp32", 1) < 1e13


def test_mfu_is_images_times_flops_over_peak_times_world():
    use = Utilisation({32: 3e8, 64: 1.2e9}, Peak(4e10, "measured"), world_size=2)
    assert use.of(200.0, 32) == pytest.approx(200 * 3e8 / (4e10 * 2))
    assert use.of(200.0, 64) == pytest.approx(4 * use.of(200.0, 32))
    assert use.of(200.0, 48) is None
    assert use.about() == {"peak_flops": 4e10, "peak_source": "measured",
                           "flops_per_image": {"32": 3e8, "64": 1.2e9}}


class Uncountable(nn.Module):
    def forward(self, x):
        return torch.tensor(x.sum().item())  # data-dependent: fails on the meta device


def test_a_model_that_cannot_be_counted_leaves_mfu_out(caplog):
    with caplog.at_level(logging.WARNING, logger="ddp"):
        assert measure(Uncountable(), [32], torch.device("cpu"), "fp32", 1) is None
    assert len(caplog.records) == 1 and "MFU: not reported" in caplog.text


def test_fixmatch_counts_every_image_its_step_passes_through_the_model(monkeypatch):
    """Per labelled image a FixMatch step runs 1 + 2 mu images (the labelled, the weak and strong views)."""
    from ddp_cli.config import RunConfig
    from ddp_cli.distributed.setup import DistContext
    from ddp_cli.run.training import model_utilisation

    monkeypatch.setattr(mfu, "cpu_peak", lambda precision, threads=None: Peak(1e11, "measured"))
    ctx = DistContext(0, 2, 0, 2, torch.device("cpu"), "gloo")
    plain = RunConfig.model_validate({"model": {"name": "resnet_tiny"}, "data": {"image_size": 32},
                                      "train": {"precision": "fp32", "epochs": 1}})
    semi = plain.model_copy(update={"semi": plain.semi.model_copy(update={"method": "fixmatch", "mu": 3})})
    alone, with_views = model_utilisation(plain, ctx, 10), model_utilisation(semi, ctx, 10)
    assert with_views.flops[32] == pytest.approx(7 * alone.flops[32])
    assert with_views.of(100.0, 32) == pytest.approx(7 * alone.of(100.0, 32))
