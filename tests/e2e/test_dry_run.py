"""`ddp train --dry-run`: every shipped config and every model the issue names, on a tiny data set.

What the dry run refuses (and `train` alike): tests/e2e/test_preflight.py."""

from __future__ import annotations

import tomllib

import pytest
import torch
from conftest import REPO, ddp_in_process, last_json
from synthetic import make_imagenet_loc, write_registry

from ddp_cli.config.resolve import prefetch_for
from ddp_cli.data.pipeline.autotune import choose_workers, cores_per_rank
from ddp_cli.train.precision import native_precision

# the run configs, not a sweep's space beside one (*-space.toml)
CONFIGS = sorted(p for p in (REPO / "configs").glob("*.toml") if not p.name.endswith("-space.toml"))
NAMED = ["resnet18", "resnet34", "resnet50", "resnet101", "resnet152", "resnext50_32x4d",
         "efficientnet_v2_s", "inception_v3", "squeezenet1_0", "vgg11", "vgg11_bn", "vgg13", "vgg13_bn",
         "vgg16", "vgg16_bn", "vgg19", "vgg19_bn", "convnext_tiny", "vit_b_16"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A 3-class, 24-image Kaggle-layout data set named `tiny`: (registry path, --set arguments)."""
    folder = tmp_path_factory.mktemp("tiny")
    make_imagenet_loc(folder / "data", classes=3, train_per_class=8, val=7)
    registry = write_registry(folder, [{"name": "tiny", "layout": "imagenet-loc",
                                        "storage": {"driver": "FileSystem", "path": str(folder / "data")}}])
    return str(registry), ["--set", "data.dataset=tiny", "--set", "data.batch_size=2"]


def dry_run(tiny, config: str, *args: str):
    """`ddp train CONFIG --dry-run` in this process; `args` come last, so their --set wins."""
    registry, sets = tiny
    return ddp_in_process("train", config, "--dry-run", "--json", "--registry", registry, *sets, *args)


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_plans(tiny, config):
    fewer = ["--set", "semi.labels_per_class=2"] if "semi" in tomllib.loads(config.read_text()) else []
    plan = last_json(dry_run(tiny, str(config), *fewer))  # the tiny set has 8 images a class
    assert plan["splits"] == {"train": 24, "val": 7} and plan["classes"] == 3
    assert plan["parameters"] > 0 and plan["steps_per_epoch"] >= 1
    assert plan["global_batch"] == plan["world_size"] * 2 * 1
    first = next(iter(plan["lr_schedule"].values()))
    assert 0 < first <= plan["lr"] * (1 + 1e-9)
    assert {"precision", "reduce", "optimizer", "image_size", "warmup_steps", "total_steps"} <= plan.keys()
    assert plan["resume"] == "auto"


def test_the_fast_recipe_plans_its_ramp_and_its_lr(tiny):
    result = dry_run(tiny, str(REPO / "configs/resnet50-fast.toml"))
    plan = last_json(result)
    assert plan["image_size"] == {"train from epoch 1": 160, "train from epoch 33": 192, "val": 256}
    assert plan["lr"] == pytest.approx(0.10625 * 2 / 256)
    native = native_precision(torch.device("cpu"))  # "auto" resolved for this machine
    assert (plan["precision"], plan["channels_last"], plan["schedule"]) == (native, True, "poly")
    assert plan["warmup_steps"] == 2 * plan["steps_per_epoch"]
    assert plan["lr_schedule"][f"step {plan['warmup_steps']} (warmup done)"] == pytest.approx(plan["lr"])


@pytest.mark.parametrize("model", NAMED)
def test_every_model_the_issue_names_plans(tiny, model):
    size = ["--set", "data.image_size=299", "--set", "data.val_resize=342"] if model == "inception_v3" else []
    result = dry_run(tiny, str(REPO / "configs/resnet50.toml"), "--set", f"model.name={model}", *size)
    plan = last_json(result)
    assert plan["model"] == model and plan["parameters"] > 500_000


def test_powersgd_plan_shows_its_warmup(tiny):
    result = dry_run(tiny, str(REPO / "configs/demo.toml"), "--set", 'distributed.reduce="powersgd"')
    plan = last_json(result)
    assert plan["reduce"] == "powersgd"
    assert plan["powersgd_warmup_steps"] == max(2, plan["total_steps"] // 10)


def test_auto_loader_workers_are_resolved_and_explained(tiny):
    result = dry_run(tiny, str(REPO / "configs/demo.toml"), "--set", "data.workers=auto",
                     "--set", "data.prefetch_factor=auto", "--set", "distributed.nproc_per_node=1")
    choice = last_json(result)["data_workers"]
    assert choice["cores_per_rank"] == cores_per_rank(1) and choice["decode_ms"] > 0
    assert choice["workers"] == choose_workers(choice["cores_per_rank"], "cpu", choice["decode_ms"],
                                               choice.get("model_ms"))[0]
    assert choice["prefetch_factor"] == prefetch_for(choice["workers"]) and choice["rule"]
