"""A model of the user's own (`ddp_cli.models.user_model`): resolution from the config's folder, what each
failure says (exit 2, naming it and its first error line), model.kwargs and num_classes, the checks
every rule of fine-tuning makes of it, and the warning when its file changed since the run."""

from __future__ import annotations

import logging
import sys
import uuid
from pathlib import Path

import pytest
import torch
from synthetic import OWN_NET

from ddp_cli.config import load_config
from ddp_cli.errors import USAGE, ConfigError
from ddp_cli.models import build_model, check_model, classifier_head
from ddp_cli.models.user_model import changed, factory, with_located_model
from ddp_cli.train.checkpoint_model import warn_if_changed

NET = OWN_NET + """
def anything(**kwargs):
    return Net(**kwargs)

def fixed():
    return Net(1000)

def broken(num_classes):
    raise ValueError("width must be even\\nsecond line")

def not_a_model(num_classes):
    return 3
"""


def config(folder: Path, name: str, *sets: str):
    (folder / "run.toml").write_text(f'[model]\nname = "{name}"\n[data]\nimage_size = 8\nval_resize = 8\n')
    return with_located_model(load_config(folder / "run.toml", list(sets)), folder / "run.toml")


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    """A config folder holding nets/net.py and a package of a name no other test imports."""
    (tmp_path / "nets").mkdir()
    (tmp_path / "nets/net.py").write_text(NET)
    package = tmp_path / f"pkg_{uuid.uuid4().hex[:8]}"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "zoo.py").write_text(NET)
    return tmp_path


def package(folder: Path) -> str:
    return next(p.name for p in folder.iterdir() if p.name.startswith("pkg_"))


def test_a_file_is_made_absolute_from_the_config_folder_with_its_hash(folder, monkeypatch, tmp_path_factory):
    monkeypatch.chdir(tmp_path_factory.mktemp("elsewhere"))  # the config's folder counts, not the cwd
    cfg = config(folder, "nets/net.py:make", "model.kwargs.width=6")
    net = folder / "nets/net.py"
    assert cfg.model.name == f"{net}:make"
    assert cfg.model.source.root == str(net.parent) and len(cfg.model.source.sha256) == 64
    model = build_model(cfg.model, 10)
    assert model.classify.out_features == 10 and model.classify.in_features == 6


def test_a_module_is_found_beside_the_config_and_imported_from_there_in_a_fresh_process(folder, monkeypatch,
                                                                                       tmp_path_factory):
    monkeypatch.chdir(tmp_path_factory.mktemp("elsewhere"))
    name = f"{package(folder)}.zoo:make"
    cfg = config(folder, name)
    assert cfg.model.name == name and cfg.model.source.root == str(folder)
    assert cfg.model.source.sha256 is None
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p != str(folder)])  # a worker: not on it yet
    assert build_model(cfg.model, 3).classify.out_features == 3
    assert sys.path[0] == str(folder)


@pytest.mark.parametrize(("name", "words"), [
    ("nets/missing.py:make", ["missing.py: no such file", "relative to the run config's folder"]),
    ("no_such_pkg_x.zoo:make", ["cannot import no_such_pkg_x.zoo", "ModuleNotFoundError: No module named"]),
    ("nets/net.py:mak", ["has no 'mak'", "did you mean 'make'"]),
    ("nets/net.py:broken", ["raised ValueError: width must be even;"]),
    ("nets/net.py:not_a_model", ["returned a int, not a torch.nn.Module"]),
    ("nets/net.py:fixed", ["gives shape (2, 1000) for 2 images, not (2, 10)"]),
    ("nets/net.py:make 2", ["is not a model reference"]),
])
def test_each_failure_is_a_config_error_naming_the_model_and_its_first_line(folder, name, words):
    with pytest.raises(ConfigError) as caught:
        check_model(config(folder, name), 10)
    message = str(caught.value)
    assert caught.value.exit_code == USAGE and message.startswith(("model.name", f"{folder / 'run.toml'}"))
    assert all(word in message for word in words), message
    assert "second line" not in message


def test_a_syntax_error_in_the_file_is_named_with_its_line(folder):
    (folder / "nets/bad.py").write_text("def make(num_classes):\n    return (\n")
    with pytest.raises(ConfigError, match=r"cannot import .*bad\.py \(SyntaxError: .*line"):
        build_model(config(folder, "nets/bad.py:make").model, 10)


@pytest.mark.parametrize(("factory_name", "kwargs", "error"), [
    ("make", "model.kwargs.depth=3", "takes no keyword 'depth'; it takes width"),
    ("make", "model.kwargs.num_classes=3", "num_classes is set by ddp"),
    ("anything", "model.kwargs.width=5", None),  # **kwargs: anything goes, num_classes passed too
])
def test_kwargs_are_checked_against_the_factory(folder, factory_name, kwargs, error):
    cfg = config(folder, f"nets/net.py:{factory_name}", kwargs)
    if error:
        with pytest.raises(ConfigError, match=error):
            build_model(cfg.model, 10)
    else:
        assert build_model(cfg.model, 10).classify.in_features == 5


def test_fine_tuning_rules_hold_for_it_and_refuse_what_it_lacks(folder, tmp_path):
    weights = tmp_path / "w.pt"
    torch.save(build_model(config(folder, "nets/net.py:make").model, 10).state_dict(), weights)
    cfg = config(folder, "nets/net.py:make", f"model.weights={weights}", "model.freeze=['body.0']",
                 "optim.head_lr_mult=10")
    model = check_model(cfg, 10)
    assert classifier_head(model) == "classify"
    assert not model.body[0].weight.requires_grad and model.body[1].weight.requires_grad
    with pytest.raises(ConfigError, match="has no module 'body.9'"):
        check_model(config(folder, "nets/net.py:make", "model.freeze=['body.9']"), 10)
    with pytest.raises(ConfigError, match="DEFAULT is a torchvision weight name"):
        check_model(config(folder, "nets/net.py:make", "model.weights=DEFAULT"), 10)
    with pytest.raises(ConfigError, match="optim.layer_decay: layer-wise LR decay needs a ViT"):
        check_model(config(folder, "nets/net.py:make", "optim.layer_decay=0.7"), 10)


def test_the_head_is_what_get_classifier_names_and_a_model_without_one_is_refused():
    from torch import nn

    class HeadFirst(nn.Module):
        def __init__(self):
            super().__init__()
            self.head, self.proj = nn.Linear(4, 10), nn.Linear(3, 4)

        def get_classifier(self):
            return self.head

    assert classifier_head(HeadFirst()) == "head"
    with pytest.raises(ConfigError, match="no recognisable classifier head.*get_classifier"):
        classifier_head(nn.Sequential(nn.Flatten()), "mine")


def test_an_edited_file_is_a_warning_naming_both_hashes(folder, caplog):
    cfg = config(folder, "nets/net.py:make")
    then = cfg.model.source.sha256
    assert changed(cfg.model.name, then) is None
    (folder / "nets/net.py").write_text(NET + "\n# edited\n")
    with caplog.at_level(logging.WARNING, logger="ddp"):
        warn_if_changed(cfg.model, folder / "last.pt")
    now = config(folder, "nets/net.py:make").model.source.sha256
    assert f"sha256 {then} then, {now} now" in caplog.text and str(folder / "last.pt") in caplog.text


def test_a_factory_is_imported_once_per_process(folder):
    name = f"{folder / 'nets/net.py'}:make"
    assert factory(name, None) is factory(name, None)
