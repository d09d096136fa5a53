"""benchmarks/ssl_probe.py, issue 59's measurement of features learnt without labels: its loss is SimCLR's
NT-Xent as written by hand, and it writes the trained encoder, its classifier as initialised, which ddp's
`model.weights` loads into the model the config names."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from ddp_cli.config.model import ModelConfig
from ddp_cli.models.weights import select_weights
from ddp_cli.models.zoo import build_model

pytest.importorskip("skimage")
BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


probe = load("ssl_probe")


def test_nt_xent_is_each_views_cross_entropy_against_its_pair_among_the_other_views():
    z = torch.tensor([[1.0, 0.0], [0.0, 2.0], [1.0, 1.0], [-1.0, 0.5]])  # views of a, b; then of a, b
    t = 0.5
    unit = F.normalize(z, dim=1)
    losses = []
    for i, pair in enumerate([2, 3, 0, 1]):
        others = [j for j in range(4) if j != i]
        sims = {j: float(unit[i] @ unit[j]) / t for j in others}
        losses.append(-sims[pair] + math.log(sum(math.exp(s) for s in sims.values())))
    assert probe.nt_xent(z, t).item() == pytest.approx(sum(losses) / 4, rel=1e-6)


def test_the_weights_are_the_trained_encoder_with_an_untrained_classifier_and_load_as_model_weights(tmp_path):
    registry = load("make_photo_crops").make_dataset(tmp_path / "photos", side=16, train_per_class=2,
                                                     val_per_class=1)
    config = tmp_path / "run.toml"
    config.write_text('[data]\ndataset = "photos"\nimage_size = 16\n\n'
                      '[model]\nname = "resnet_tiny"\nkwargs = { width = 8 }\n')
    out = tmp_path / "ssl.pt"
    result = probe.main([str(config), "--registry", str(registry), "--out", str(out), "--epochs", "2",
                         "--batch-size", "8", "--report-every", "1", "--json"])
    assert [row["epoch"] for row in result["history"]] == [0, 1, 2]
    assert all(0 <= row["few"] <= 1 and 0 <= row["every"] <= 1 for row in result["history"])
    cfg = ModelConfig(name="resnet_tiny", kwargs={"width": 8}, weights=str(out))
    torch.manual_seed(0)  # the probe's seed: its model started as this one
    start = build_model(cfg, 10, 16).state_dict()
    saved = torch.load(out, weights_only=True)
    assert torch.equal(saved["head.2.weight"], start["head.2.weight"])
    assert torch.equal(saved["head.2.bias"], start["head.2.bias"])
    assert not torch.equal(saved["stem.0.weight"], start["stem.0.weight"])  # trained
    assert select_weights(start, dict(saved), cfg, 10).keys() == start.keys()
