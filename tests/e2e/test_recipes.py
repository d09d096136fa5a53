"""The recipes (configs/recipes/*.toml) dry-run clean on a tiny data set of their layout, plan what
their sources say, and the fine-tuning recipe finds its torchvision weights in $TORCH_HOME (or says
where to put them)."""

from __future__ import annotations

import json

import pytest
import torch
import torchvision
from conftest import REPO
from synthetic import make_imagefolder, make_imagenet_loc, write_registry
from typer.testing import CliRunner

from ddp_cli.cli import app
from ddp_cli.models import tensors_on_meta

RECIPES = sorted((REPO / "configs" / "recipes").glob("*.toml"))
FINE_TUNE = REPO / "configs" / "recipes" / "finetune-resnet50.toml"
RESNET50_V2 = torchvision.models.ResNet50_Weights.IMAGENET1K_V2
CLI_ENV = {"LOGLEVEL": "CRITICAL", "TORCH_CPP_LOG_LEVEL": "FATAL", "DDP_LOG_LEVEL": "INFO"}


@pytest.fixture(scope="module")
def registry(tmp_path_factory) -> str:
    """`tiny` (3 classes, Kaggle layout) for the ImageNet recipes, `photos` (10 classes, imagefolder)
    for the fine-tuning one."""
    folder = tmp_path_factory.mktemp("recipes")
    make_imagenet_loc(folder / "tiny", classes=3, train_per_class=8, val=7)
    make_imagefolder(folder / "photos", classes=10, per_class=2, size=32)
    return str(write_registry(folder, [
        {"name": "tiny", "layout": "imagenet-loc",
         "storage": {"driver": "FileSystem", "path": str(folder / "tiny")}},
        {"name": "photos", "layout": "imagefolder",
         "storage": {"driver": "FileSystem", "path": str(folder / "photos")}}]))


@pytest.fixture(scope="module")
def torch_home(tmp_path_factory) -> str:
    """A hub cache holding IMAGENET1K_V2 as torchvision would have downloaded it: its keys and shapes
    (zeros stored as one element each, so 25M weights cost nothing)."""
    home = tmp_path_factory.mktemp("torch_home")
    path = home / "hub" / "checkpoints" / RESNET50_V2.url.rsplit("/", 1)[1]
    path.parent.mkdir(parents=True)
    with tensors_on_meta():
        state = torchvision.models.resnet50().state_dict()
    torch.save({k: torch.zeros((), dtype=v.dtype).expand(v.shape) for k, v in state.items()}, path)
    return str(home)


def dry_run(registry: str, recipe, torch_home: str, dataset: str) -> tuple[int, dict]:
    """`ddp train RECIPE --dry-run --json` in this process, on `dataset`, 2 images per worker."""
    result = CliRunner().invoke(app, ["train", str(recipe), "--dry-run", "--json", "--registry", registry,
                                      "--set", f"data.dataset={dataset}", "--set", "data.batch_size=2"],
                                env={**CLI_ENV, "TORCH_HOME": torch_home})
    return result.exit_code, json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_every_recipe_dry_runs_clean(registry, torch_home, recipe):
    code, plan = dry_run(registry, recipe, torch_home, "photos" if recipe == FINE_TUNE else "tiny")
    assert code == 0, plan
    assert plan["name"] == recipe.stem and plan["parameters"] > 1_000_000
    assert any(step.startswith("Normalize") for step in plan["augmentation"])
    assert sum(g["parameters"] for g in plan["param_groups"]) <= plan["parameters"]
    assert recipe.read_text().count("# ") >= 20  # every value cited: the sources are in the comments


def test_resnet50_v2_plans_torchvisions_recipe(registry, torch_home):
    code, plan = dry_run(registry, REPO / "configs/recipes/resnet50-v2.toml", torch_home, "tiny")
    assert code == 0, plan
    assert plan["image_size"] == {"train from epoch 1": 176, "val": 224}
    assert plan["val_preprocessing"][:2] == ["Resize(232, bilinear, antialias)", "CenterCrop(224)"]
    assert plan["augmentation"][0].startswith("RepeatedAugmentation(k=4)")
    assert plan["lr"] == pytest.approx(0.125 * plan["global_batch"] / 256)  # 0.5 at 1024
    assert [g["weight_decay"] for g in plan["param_groups"]] == [2e-5, 0.0]


def test_the_fine_tuning_recipe_plans_its_head_and_its_frozen_stem(registry, torch_home):
    code, plan = dry_run(registry, FINE_TUNE, torch_home, "photos")
    assert code == 0, plan
    assert (plan["classes"], plan["weights"], plan["lr"]) == (10, "IMAGENET1K_V2", 0.001)
    by_lr = {(round(g["lr"], 9), g["frozen_epochs"]) for g in plan["param_groups"]}
    assert by_lr == {(0.001, 0), (0.01, 0), (0.001, 2)}  # the body, the head at x10, the stem for 2 epochs
    head = [g for g in plan["param_groups"] if round(g["lr"], 9) == 0.01]
    assert sum(g["parameters"] for g in head) == 2048 * 10 + 10  # the new 10-class fc


def test_the_fine_tuning_recipe_without_its_weights_says_where_to_put_them(registry, tmp_path):
    code, error = dry_run(registry, FINE_TUNE, str(tmp_path), "photos")
    expected = tmp_path / "hub" / "checkpoints" / "resnet50-11ad3fa6.pth"
    assert (code, error["exit_code"]) == (3, 3)
    assert str(expected) in error["error"] and RESNET50_V2.url in error["error"]
