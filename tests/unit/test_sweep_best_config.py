"""best.toml, the sweep's best trial as a config `ddp train` takes as is, from wherever it is written."""

from __future__ import annotations

import tomllib
from pathlib import Path
from types import SimpleNamespace

import pytest

from ddp_cli.config import config_from_dict, load_config
from ddp_cli.config.train import TrainConfig
from ddp_cli.models.user_model import with_located_model
from ddp_cli.sweep.report import FINAL_EPOCHS, best_config_text
from ddp_cli.sweep.study import SweepOptions, base_config

MODEL = "import torch\n\ndef make(num_classes=10):\n    return torch.nn.Linear(4, num_classes)\n"


def test_best_toml_names_a_model_file_of_the_sweep_config_wherever_it_is_written(tmp_path, monkeypatch):
    (tmp_path / "configs" / "nets").mkdir(parents=True)
    (tmp_path / "configs" / "nets" / "tiny.py").write_text(MODEL)
    config = tmp_path / "configs" / "run.toml"
    config.write_text('[data]\ndataset = "demo"\n[model]\nname = "nets/tiny.py:make"\n')
    monkeypatch.chdir(tmp_path)  # the sweep runs from the project's root, its config in configs/
    opts = SweepOptions(config=Path("configs/run.toml"), space=tmp_path / "space.toml",
                        overrides=["optim.lr_per_256=0.2"])
    raw = base_config(opts, with_located_model(load_config(opts.config, opts.overrides), opts.config))
    study = SimpleNamespace(study_name="s", user_attrs={"ddp_config": raw})
    trial = SimpleNamespace(number=3, value=0.9, params={"optim.label_smoothing": 0.05})
    best = tmp_path / "sweeps" / "s" / "best.toml"
    best.parent.mkdir(parents=True)
    best.write_text(best_config_text(study, trial))
    cfg = with_located_model(load_config(best), best)  # as `ddp train best.toml` reads it
    assert cfg.model.name == f"{tmp_path / 'configs' / 'nets' / 'tiny.py'}:make"
    assert cfg.model.source.sha256  # located: the file, hashed as any run's
    assert (cfg.optim.lr_per_256, cfg.optim.label_smoothing) == (0.2, 0.05)


@pytest.mark.parametrize(("final", "params", "epochs"), [
    (6, {"optim.label_smoothing": 0.05}, 6),  # the config file's own train.epochs
    (None, {"optim.label_smoothing": 0.05}, TrainConfig().epochs),  # unset in the file: the default
    (6, {"train.epochs": 4}, 4),  # searched: the winner's
])
def test_best_toml_trains_for_the_final_runs_epochs_not_a_quick_searchs(final, params, epochs):
    raw = {"data": {"dataset": "demo"}, "train": {"epochs": 2}}  # the sweep's --set train.epochs=2
    study = SimpleNamespace(study_name="s", user_attrs={"ddp_config": raw, FINAL_EPOCHS: final})
    text = best_config_text(study, SimpleNamespace(number=3, value=0.9, params=params))
    assert config_from_dict(tomllib.loads(text)).train.epochs == epochs
    assert f"to train again for {epochs} epochs" in text.splitlines()[0]
    assert raw["train"] == {"epochs": 2}  # the study's record untouched
