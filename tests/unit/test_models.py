"""The model zoo: every torchvision classifier by name, input sizes checked, weights from a file."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ddp_cli.config import RunConfig, config_from_dict
from ddp_cli.config.resolve import Facts, resolve
from ddp_cli.errors import ConfigError, DataError
from ddp_cli.models import (
    build_model,
    check_model,
    classifier_head,
    known_models,
    load_weights,
    read_weights,
    tensors_on_meta,
)
from ddp_cli.models.families import takes_any_size
from ddp_cli.train.checkpoint import save_checkpoint

NATIVE_SIZE = {"inception_v3": 299}  # torchvision's training size, where it is not 224


def run_config(name: str, size: int = 224, **data) -> RunConfig:
    """Resolved as preflight hands it to `check_model`: the sizes the run will use are known."""
    cfg = config_from_dict({"model": {"name": name}, "train": {"epochs": 4},
                            "data": {"image_size": size, **data}})
    return resolve(cfg, Facts(takes_any_size=takes_any_size(name)))


def test_every_torchvision_classifier_builds_with_the_data_sets_class_count():
    """On the meta device: shapes only, so all ~80 models (vit_h_14 has 632M weights) take seconds."""
    names = [n for n in known_models() if n != "resnet_tiny"]
    assert {"resnet18", "resnet152", "resnext50_32x4d", "efficientnet_v2_s", "inception_v3",
            "squeezenet1_0", "vgg19_bn", "convnext_tiny", "vit_b_16", "regnet_y_128gf"} <= set(names)
    for name in names:
        size = NATIVE_SIZE.get(name, 224)
        with tensors_on_meta():
            model = build_model(run_config(name, size).model, 17, size).eval()
        with torch.no_grad():
            out = model(torch.empty(1, 3, size, size, device="meta"))
        assert tuple(out.shape) == (1, 17), name  # what check_model proves, one forward per model
        head = model.get_submodule(classifier_head(model))  # what optim.head_lr_mult scales
        assert getattr(head, "out_features", getattr(head, "out_channels", None)) == 17, name


@pytest.mark.parametrize(("name", "size"), [("inception_v3", 75), ("googlenet", 64), ("vit_b_16", 64),
                                            ("resnet_tiny", 32)])
def test_real_models_train_and_return_plain_logits(name, size):
    """Auxiliary heads are off: training mode returns one logits tensor, as the trainer expects."""
    torch.manual_seed(0)
    model = build_model(run_config(name, size).model, 5, size).train()
    out = model(torch.randn(2, 3, size, size))
    assert isinstance(out, torch.Tensor) and out.shape == (2, 5)


@pytest.mark.parametrize(("name", "size", "data", "message"), [
    ("inception_v3", 64, {"progressive": False}, "inception_v3 cannot take 64x64 images"),
    ("inception_v3", 96, {}, "cannot take 48x48 images .*data.min_image_size, progressive resizing's first "
                             "crop: raise it, or set data.progressive = false"),
    ("alexnet", 32, {"progressive": False}, "alexnet cannot take 32x32 images"),
    ("vit_b_16", 40, {}, "cannot be built for data.image_size = 40"),  # not a multiple of 16
    ("maxvit_t", 160, {}, "cannot be built for data.image_size = 160"),
    ("vit_b_16", 224, {"val_image_size": 256}, "takes only data.image_size = 224"),
    ("vit_b_32", 224, {"min_image_size": 160, "ramp_epochs": [1, 2]}, "unset data.min_image_size"),
    ("alexnet", 224, {"min_image_size": 32, "ramp_epochs": [1, 3]}, "alexnet cannot take 32x32"),
])
def test_sizes_a_model_cannot_take_are_config_errors(name, size, data, message):
    with pytest.raises(ConfigError, match=message) as info:
        check_model(run_config(name, size, **data), 10)
    assert info.value.exit_code == 2 and "model.name" in str(info.value)


def test_unknown_model_names_close_matches():
    with pytest.raises(ConfigError, match="resnet50"):
        check_model(run_config("resnet5O"), 10)


# --- initial weights from a file ---------------------------------------------------------------


def tiny(classes: int, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return build_model(run_config("resnet_tiny", 32).model, classes)


def with_weights(path, new_head: bool = False) -> RunConfig:
    return config_from_dict({"model": {"name": "resnet_tiny", "weights": str(path), "new_head": new_head},
                             "data": {"image_size": 32}, "train": {"epochs": 1}})


def same(a: nn.Module, b: nn.Module, prefix: str = "") -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return all(torch.equal(sa[k], sb[k]) for k in sa if k.startswith(prefix))


@pytest.mark.parametrize("form", ["state_dict", "ddp_checkpoint", "wrapped_names", "nested"])
def test_weights_load_from_a_state_dict_or_a_ddp_checkpoint(tmp_path, form):
    source, path = tiny(3, seed=1), tmp_path / "w.pt"
    state = source.state_dict()
    if form == "state_dict":
        torch.save(state, path)
    elif form == "ddp_checkpoint":
        save_checkpoint({"model": state, "epoch": 3}, path)
    elif form == "wrapped_names":  # saved from a DDP-wrapped, compiled model
        torch.save({f"module._orig_mod.{k}": v for k, v in state.items()}, path)
    else:
        torch.save({"state_dict": state, "epoch": 3}, path)
    cfg = with_weights(path)
    check_model(cfg, 3)
    target = tiny(3, seed=2)
    assert not same(target, source)
    load_weights(target, cfg.model, 3)
    assert same(target, source)


def test_a_head_for_another_class_count_needs_new_head(tmp_path):
    path = tmp_path / "w.pt"
    source = tiny(10, seed=1)
    torch.save(source.state_dict(), path)
    with pytest.raises(ConfigError, match="10-class head.*3 classes.*model.new_head = true"):
        check_model(with_weights(path), 3)
    cfg = with_weights(path, new_head=True)
    check_model(cfg, 3)
    target, fresh = tiny(3, seed=2), tiny(3, seed=2)
    load_weights(target, cfg.model, 3)
    assert same(target, source, "stages") and same(target, source, "stem")
    assert same(target, fresh, "head")  # left as initialised


def test_weights_of_another_model_are_refused_naming_the_keys(tmp_path):
    path = tmp_path / "w.pt"
    torch.save(nn.Linear(3, 3).state_dict(), path)
    with pytest.raises(ConfigError, match="not fit resnet_tiny: missing stem.0.weight.*unexpected weight"):
        check_model(with_weights(path), 3)
    state = tiny(3, seed=1).state_dict()
    state["stem.0.weight"] = torch.zeros(8, 3, 3, 3)
    torch.save(state, path)
    with pytest.raises(ConfigError, match=r"stem.0.weight is \(8, 3, 3, 3\) in the file"):
        check_model(with_weights(path), 3)


def test_weights_files_that_are_missing_unsafe_or_empty(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        read_weights(str(tmp_path / "absent.pt"))
    unsafe = tmp_path / "unsafe.pt"
    torch.save({"w": torch.zeros(1), "code": nn.Linear(1, 1)}, unsafe)  # a pickled module object
    with pytest.raises(DataError, match="refused"):
        read_weights(str(unsafe))
    empty = tmp_path / "empty.pt"
    torch.save({"epoch": 3}, empty)
    with pytest.raises(DataError, match="holds no tensors"):
        read_weights(str(empty))
