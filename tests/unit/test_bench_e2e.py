"""`ddp bench e2e`'s baselines: the recipe each hands the torchrun script, as the script parses it.

A real run of the script (the reference recipe, on a tiny data set): tests/e2e/test_bench.py."""

from __future__ import annotations

import json

import pytest
from conftest import REPO
from typer.testing import CliRunner

from ddp_cli.bench.e2e import baseline_arguments
from ddp_cli.bench.e2e_baseline import arguments
from ddp_cli.cli import app
from ddp_cli.config import load_config


def parsed(config: str, baseline: str, workers: int = 2, overrides: tuple[str, ...] = ()):
    cfg = load_config(REPO / config, list(overrides))
    return cfg, arguments(["--root", "/data", *baseline_arguments(cfg, workers, baseline, cfg.data.workers)])


def test_torchrun_baseline_runs_the_configs_own_recipe():
    cfg, args = parsed("configs/demo.toml", "torchrun")
    assert (args.lr, args.momentum, args.weight_decay) == (cfg.lr(2), 0.9, 5e-4)
    assert (args.warmup_epochs, args.schedule) == (1, "cosine")
    assert (args.image_size, args.val_resize, args.min_crop_scale, args.hflip) == (32, 32, 0.5, False)
    assert (args.model, args.epochs, args.batch_size, args.workers, args.seed) == ("resnet_tiny", 8, 32, 1, 0)


@pytest.mark.parametrize("config, workers, lr, val_resize, hflip", [
    ("configs/demo.toml", 2, 0.1 * 64 / 256, 37, False),  # 32 / 0.875 = 36.6
    ("configs/photos.toml", 4, 0.1 * 128 / 256, 128, True),  # 112 / 0.875
])
def test_reference_baseline_is_torchvisions_recipe_at_the_configs_model_data_and_batch(
        config, workers, lr, val_resize, hflip):
    cfg, args = parsed(config, "reference", workers)
    assert args.lr == pytest.approx(lr)  # 0.1 per 256 images of global batch
    assert (args.momentum, args.weight_decay, args.warmup_epochs, args.schedule) == (0.9, 1e-4, 0, "constant")
    assert (args.image_size, args.val_resize, args.min_crop_scale) == (cfg.data.image_size, val_resize, 0.08)
    assert args.hflip is hflip  # as the config says
    data = cfg.data
    assert (args.model, args.batch_size, args.workers) == (cfg.model.name, data.batch_size, data.workers)


@pytest.mark.parametrize("baseline", ["torchrun", "reference"])
def test_epochs_override_reaches_the_baseline(baseline):
    _, args = parsed("configs/demo.toml", baseline, overrides=("train.epochs=3",))
    assert args.epochs == 3


def test_an_unknown_baseline_is_a_usage_error():
    result = CliRunner().invoke(app, ["bench", "e2e", "--baseline", "timm", "--json"])
    assert result.exit_code == 2
    assert "--baseline timm" in json.loads(result.stdout.strip().splitlines()[-1])["error"]


def test_the_baseline_loads_with_as_many_processes_as_ddps_run_resolves(monkeypatch, tmp_path):
    """data.workers = "auto" (the default) is a number only once ddp's preflight chooses it: the bench asks
    ddp's dry run, and hands the baseline that number."""
    from ddp_cli.bench import e2e

    asked = []

    def dry_run(command, timeout=None):
        asked.append(command)
        return 0.0, 'log line\n{"data_workers": {"workers": 3, "rule": "CPU"}}\n'
    monkeypatch.setattr(e2e, "run_timed", dry_run)
    cfg = load_config(REPO / "benchmarks/defaults-demo.toml")
    assert cfg.data.workers == "auto"
    config, registry = tmp_path / "c.toml", tmp_path / "data.toml"
    assert e2e.loader_processes(config, registry, cfg) == 3
    assert "--dry-run" in asked[0] and asked[0][asked[0].index("--registry") + 1] == str(registry)
    assert e2e.loader_processes(config, registry, cfg.resolved({"data.workers": 2})) == 2
    assert len(asked) == 1  # a number as set needs no dry run
