"""timm's models (`ddp_cli.models.timm_model`): the name, an unknown architecture or tag, the missing extra,
the pretrained weights read from a test-made Hugging Face cache with the network cut (exit 3 naming the path
and the command when they are missing), their data config applied or overridden, and the plan's line."""

from __future__ import annotations

import json
import socket
import sys
from pathlib import Path

import pytest
import torch
from conftest import ddp_in_process
from safetensors.torch import save_file
from synthetic import write_timm_cache

from ddp_cli.cli.plan import val_preprocessing, weights_data_config
from ddp_cli.config import ModelConfig, load_config
from ddp_cli.config.resolve import resolve
from ddp_cli.data.pipeline.transforms import normalising, to_model_input
from ddp_cli.errors import DATA, USAGE, ConfigError, DataError
from ddp_cli.models import build_model, check_model, classifier_head, initial_weights, load_weights, vit_depth
from ddp_cli.models.timm_model import TimmName, parse
from ddp_cli.preflight import Workers, node_facts

NAME = "timm/test_resnet.r160_in1k"
REPO = "models--timm--test_resnet.r160_in1k"


@pytest.fixture
def hf_home(tmp_path: Path, monkeypatch) -> Path:
    """An empty Hugging Face home of the test's own, and no other cache setting."""
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    return tmp_path / "hf"


@pytest.fixture
def offline(monkeypatch):
    """No connection can be opened: a download attempt fails the test."""
    def refuse(*args, **kwargs):
        raise AssertionError(f"a network connection was attempted: {args}")
    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


def config(folder: Path, name: str = NAME, body: str = "image_size = 32\n", *sets: str):
    (folder / "run.toml").write_text(f'[model]\nname = "{name}"\nweights = "pretrained"\n[data]\n{body}')
    cfg = load_config(folder / "run.toml", list(sets)).resolved({"train.epochs": 1})
    return resolve(cfg, node_facts(cfg, Workers(1, 1, "gloo", "cpu", "fp32")))  # as preflight resolves it


def test_the_name_is_the_architecture_and_an_optional_tag():
    assert parse("timm/resnet50.a1_in1k") == TimmName("resnet50", "a1_in1k")
    assert parse("timm/convnext_tiny").timm_name == "convnext_tiny"
    with pytest.raises(ConfigError, match=r"not a timm model name; give \"timm/<architecture>\""):
        parse("timm/resnet 50")


def test_a_malformed_name_is_refused_when_the_config_is_read(tmp_path):
    (tmp_path / "run.toml").write_text('[model]\nname = "timm/"\n')
    with pytest.raises(ConfigError, match=r"model.name: .*timm/<architecture>") as err:
        load_config(tmp_path / "run.toml")
    assert err.value.exit_code == USAGE


def test_an_unknown_architecture_or_tag_says_timms_close_names():
    with pytest.raises(ConfigError, match=r"timm has no architecture 'resnet5O'.*resnet50"):
        build_model(ModelConfig(name="timm/resnet5O"), 10, 32)
    with pytest.raises(ConfigError, match=r"no pretrained tag 'r160_in1' .*test_resnet.r160_in1k"):
        build_model(ModelConfig(name="timm/test_resnet.r160_in1", weights="pretrained"), 10, 32)


def test_built_by_timm_with_our_class_count_and_kwargs():
    model = build_model(ModelConfig(name=NAME, kwargs={"drop_rate": 0.25}), 7, 32)
    assert model.get_classifier().out_features == 7 and model.drop_rate == 0.25
    assert classifier_head(model) == "fc"  # head LR: timm's get_classifier()
    with pytest.raises(ConfigError, match="num_classes is set by ddp"):
        build_model(ModelConfig(name=NAME, kwargs={"num_classes": 3}), 7, 32)
    with pytest.raises(ConfigError, match=r"model.name: timm/test_resnet.* raised TypeError"):
        build_model(ModelConfig(name=NAME, kwargs={"no_such_keyword": 1}), 7, 32)


def test_layer_decay_counts_a_timm_vits_blocks():
    model = build_model(ModelConfig(name="timm/test_vit"), 10, 160)
    assert vit_depth(model, "test_vit") == len(model.blocks) > 1


def test_without_the_extra_one_line_naming_the_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "timm", None)
    with pytest.raises(ConfigError, match=r"^model.name = 'timm/test_resnet': the timm package is not "
                                          r"installed; pip install 'ddp-cli\[timm\]'$") as err:
        build_model(ModelConfig(name="timm/test_resnet"), 10, 32)
    assert err.value.exit_code == USAGE


@pytest.mark.parametrize("where", ["HF_HOME", "HF_HUB_CACHE"])
def test_missing_weights_exit_3_naming_the_path_and_the_command(hf_home, tmp_path, monkeypatch, where):
    cache = hf_home / "hub"
    if where == "HF_HUB_CACHE":
        cache = tmp_path / "elsewhere"
        monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    with pytest.raises(DataError) as err:
        config(tmp_path)
    assert err.value.exit_code == DATA
    message = str(err.value)
    assert f"no {cache / REPO}/snapshots/<revision>/model.safetensors" in message
    assert "`hf download timm/test_resnet.r160_in1k`" in message and "nothing is downloaded" in message


def test_a_dry_run_without_the_weights_stops_with_one_line_exit_3(hf_home, tmp_path):
    (tmp_path / "run.toml").write_text(f'[model]\nname = "{NAME}"\nweights = "pretrained"\n')
    result = ddp_in_process("train", str(tmp_path / "run.toml"), "--dry-run")
    assert result.returncode == DATA
    line = result.stderr.strip()
    assert "\n" not in line and "`hf download timm/test_resnet.r160_in1k`" in line


def test_missing_weights_are_caught_by_the_launchers_check_too(hf_home, tmp_path):
    write_timm_cache(hf_home)
    cfg = config(tmp_path)
    (hf_home / "hub" / REPO / "refs/main").unlink()  # gone after the config was read
    with pytest.raises(DataError, match=r"not in the local Hugging Face cache"):
        check_model(cfg, 10)


def test_pretrained_weights_load_offline_the_head_fresh(hf_home, tmp_path, offline):
    written = write_timm_cache(hf_home)
    cfg = config(tmp_path)
    assert cfg.model.source.revision == "0" * 40
    check_model(cfg, 10)
    model = build_model(cfg.model, 10, 32)
    load_weights(model, cfg.model, 10)
    state = model.state_dict()
    assert all(torch.equal(state[k], v) for k, v in written.items() if not k.startswith("fc."))
    assert state["fc.weight"].shape == (10, 96)  # a fresh head for our 10 classes, not the file's cut down
    assert not torch.equal(state["fc.weight"], written["fc.weight"][:10])
    same = build_model(cfg.model, 1000, 32)
    load_weights(same, cfg.model, 1000)  # the weights' own class count: their head too
    assert torch.equal(same.state_dict()["fc.weight"], written["fc.weight"])


def test_a_cached_file_missing_a_tensor_is_refused(hf_home, tmp_path):
    written = write_timm_cache(hf_home)
    cfg = config(tmp_path)
    file = next((hf_home / "hub" / REPO / "snapshots").iterdir()) / "model.safetensors"
    save_file({k: v for k, v in written.items() if k != "layer1.0.conv1.weight"}, str(file))
    with pytest.raises(DataError, match=r"do not fit it: missing layer1.0.conv1.weight; fetch them again"):
        load_weights(build_model(cfg.model, 10, 32), cfg.model, 10)


def test_the_weights_data_config_fills_what_the_config_leaves_unset(hf_home, tmp_path):
    write_timm_cache(hf_home, interpolation="bicubic", crop_pct=0.8, input_size=[3, 48, 48],
                     mean=[0.1, 0.2, 0.3], std=[0.4, 0.5, 0.6])
    data = config(tmp_path, body="").data  # no size given: the weights' input size
    assert (data.mean, data.std) == ((0.1, 0.2, 0.3), (0.4, 0.5, 0.6))
    assert (data.val_interpolation, data.val_image_size, data.val_resize) == ("bicubic", 48, 60)
    assert data.image_size == 224  # training keeps ddp's own
    data = config(tmp_path).data  # image_size = 32 given: the val crop follows it, over crop_pct
    assert (data.val_image_size, data.val_resize) == (None, 40)
    assert config(tmp_path, body="val_image_size = 40\n").data.val_resize == 50  # the val crop's
    cfg = config(tmp_path, NAME, "image_size = 32\nval_resize = 36\n", "data.mean=[0.5, 0.5, 0.5]",
                 "data.val_interpolation=bilinear")
    assert (cfg.data.mean, cfg.data.std, cfg.data.val_resize) == ((0.5,) * 3, (0.4, 0.5, 0.6), 36)
    assert cfg.data.val_interpolation == "bilinear"
    assert cfg.model.source.from_weights == ["data.std"]
    assert weights_data_config(cfg) == [
        "data.mean = [0.5, 0.5, 0.5] (from the config)", "data.std = [0.4, 0.5, 0.6] (from the weights)",
        "data.val_interpolation = bilinear (from the config)", "data.val_image_size = 32 (from the config)",
        "data.val_resize = 36 (from the config)"]
    assert val_preprocessing(cfg) == ["Resize(36, bilinear, antialias)", "CenterCrop(32)",
                                      "Normalize(mean=(0.5, 0.5, 0.5), std=(0.4, 0.5, 0.6)) (on the device)"]


def test_pretrained_is_timms_word_and_torchvisions_names_are_not_timms(tmp_path):
    with pytest.raises(ConfigError, match=r"\"pretrained\" is for timm models"):
        initial_weights(ModelConfig(name="resnet_tiny", weights="pretrained"))
    with pytest.raises(ConfigError, match=r"DEFAULT is a torchvision weight name .* or \"pretrained\""):
        initial_weights(ModelConfig(name=NAME, weights="DEFAULT"))


def test_without_the_tag_the_default_one_is_recorded(hf_home, tmp_path):
    write_timm_cache(hf_home)
    assert config(tmp_path, "timm/test_resnet").model.name == NAME


def test_a_snapshot_without_a_data_config_changes_nothing(hf_home, tmp_path):
    write_timm_cache(hf_home)
    (next((hf_home / "hub" / REPO / "snapshots").iterdir()) / "config.json").write_text(json.dumps({}))
    cfg = config(tmp_path)
    assert cfg.data.mean is None and cfg.model.source.from_weights == []
    assert val_preprocessing(cfg)[-1] == "Normalize(ImageNet mean, std) (on the device)"


def test_inputs_are_normalised_by_the_runs_mean_and_std(hf_home, tmp_path):
    write_timm_cache(hf_home)
    pixels = torch.full((1, 2, 2, 3), 255, dtype=torch.uint8)
    x = to_model_input(pixels, torch.device("cpu"), False, normalising(config(tmp_path).data))
    assert torch.allclose(x, torch.ones_like(x))  # (1 - 0.5) / 0.5


def test_a_timm_model_from_scratch_reads_no_cache(hf_home, tmp_path):
    """Only pretrained weights are looked up: a timm model trained from scratch loads with an empty
    Hugging Face cache, its name and data keys as written."""
    (tmp_path / "run.toml").write_text(f'[model]\nname = "{NAME}"\n')
    cfg = load_config(tmp_path / "run.toml")
    assert cfg.model.name == NAME and cfg.model.source is None
