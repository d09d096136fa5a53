"""SPACE.toml read against the run config: every mistake is exit 2 before any trial, naming the file
and the key; a good space gives the distributions Optuna samples from."""

from __future__ import annotations

from pathlib import Path

import pytest

from ddp_cli.config import RunConfig, load_config
from ddp_cli.errors import USAGE, ConfigError
from ddp_cli.sweep.space import Param, load_space

REPO = Path(__file__).resolve().parents[2]
BASE = load_config(REPO / "configs" / "demo.toml")


def space(tmp_path: Path, text: str, base: RunConfig = BASE):
    path = tmp_path / "space.toml"
    path.write_text(text)
    return load_space(path, base)


def refused(tmp_path: Path, text: str) -> str:
    with pytest.raises(ConfigError) as err:
        space(tmp_path, text)
    assert err.value.exit_code == USAGE
    assert str(err.value).startswith(str(tmp_path / "space.toml"))
    return str(err.value)


def test_the_shipped_demo_space_reads_with_its_kinds_of_range():
    got = load_space(REPO / "configs" / "demo-space.toml", BASE)
    kinds = {p.key: p for p in got.params}
    assert kinds["optim.lr_per_256"].log and not kinds["optim.lr_per_256"].integer
    assert kinds["optim.momentum"].step == 0.05 and kinds["optim.momentum"].grid() == [0.8, 0.85, 0.9, 0.95]
    assert kinds["optim.label_smoothing"].choices == (0.0, 0.1)
    assert (got.metric, got.direction) == ("top1", "maximize")
    assert got.sampler == {"name": "tpe", "seed": 0, "n_startup_trials": 6}
    assert got.pruner == {"name": "asha", "min_resource": 1, "reduction_factor": 2,
                          "min_early_stopping_rate": 1}
    assert load_space(REPO / "configs" / "demo-space.toml", BASE).pruner != space_defaults()


def test_defaults_and_nested_tables(tmp_path):
    got = space(tmp_path, '[params.optim]\nlr_per_256 = { low = 0.1, high = 1.0 }\n'
                          '[objective]\nmetric = "loss"\n')
    assert [p.key for p in got.params] == ["optim.lr_per_256"]
    assert (got.metric, got.direction) == ("loss", "minimize")  # loss: minimised unless told otherwise
    assert got.sampler["name"] == "tpe" and got.pruner["name"] == "asha"


def test_an_unknown_key_names_it_with_a_did_you_mean(tmp_path):
    message = refused(tmp_path, '[params]\n"optim.lr_per_265" = { low = 0.1, high = 1.0 }\n')
    assert "optim.lr_per_265: unknown key" in message and "did you mean 'lr_per_256'" in message
    message = refused(tmp_path, '[params]\n"optm.lr" = { low = 0.1, high = 1.0 }\n')
    assert "optm.lr" in message and "'optim'" in message
    assert "a section, not a key" in refused(tmp_path, '[params]\n"optim" = { choices = [1] }\n')


@pytest.mark.parametrize("spec, words", [
    ('"optim.label_smoothing" = { low = 0.0, high = 1.5 }', ["optim.label_smoothing", "1.5"]),
    ('"train.epochs" = { low = 0.5, high = 3.0 }', ["train.epochs", "0.5"]),
    ('"optim.name" = { choices = ["sgd", "adamx"] }', ["optim.name", "adamx"]),
    ('"data.batch_size" = { low = 0, high = 64, step = 16 }', ["data.batch_size", "= 0"]),
])
def test_a_value_the_key_refuses_is_named(tmp_path, spec, words):
    message = refused(tmp_path, f"[params]\n{spec}\n")
    assert all(word in message for word in words), message
    assert "the config refuses this value" in message


@pytest.mark.parametrize("text, words", [
    ('[params]\n"optim.lr_per_256" = { low = 1.0, high = 0.1 }\n', ["below high"]),
    ('[params]\n"optim.lr_per_256" = { low = 0.0, high = 1.0, log = true }\n', ["log range needs low > 0"]),
    ('[params]\n"optim.lr_per_256" = { low = 0.1, hihg = 1.0 }\n', ["'hihg'", "did you mean 'high'"]),
    ('[params]\n"optim.lr_per_256" = 0.3\n', ["give a range"]),
    ('[parms]\n', ["[parms]", "did you mean 'params'"]),
    ('[params]\n', ["[params] names no key"]),
    ('[params]\n"optim.lr_per_256" = { low = 0.1, high = 1.0 }\n[pruner]\nname = "hyperband"\n',
     ["hyperband", "asha"]),
    ('[params]\n"optim.lr_per_256" = { low = 0.1, high = 1.0 }\n[pruner]\nreduction_facter = 2\n',
     ["reduction_facter", "did you mean 'reduction_factor'"]),
    ('[params]\n"optim.lr_per_256" = { low = 0.1, high = 1.0 }\n[objective]\nmetric = "top3"\n', ["top3"]),
])
def test_a_malformed_space_is_refused(tmp_path, text, words):
    message = refused(tmp_path, text)
    assert all(word in message for word in words), message


def test_grid_values_and_a_grid_that_cannot_be():
    assert Param("x", low=0.1, high=0.3, step=0.1).grid() == [0.1, 0.2, 0.3]
    assert Param("n", low=4, high=12, step=4, integer=True).grid() == [4, 8, 12]
    with pytest.raises(ConfigError, match="a grid needs choices or a step"):
        Param("x", low=0.1, high=0.3).grid()


def test_each_param_suggests_within_its_range():
    import optuna

    got = load_space(REPO / "configs" / "demo-space.toml", BASE)
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=1))
    for _ in range(20):
        trial = study.ask()
        values = {p.key: p.suggest(trial) for p in got.params}
        assert 0.05 <= values["optim.lr_per_256"] <= 3.0
        assert values["optim.label_smoothing"] in (0.0, 0.1)
        assert values["optim.momentum"] in (0.8, 0.85, 0.9, 0.95)
        BASE.resolved(values)  # every sampled set is a valid run config
        study.tell(trial, 0.0)


def test_an_int_range_suggests_ints(tmp_path):
    import optuna

    got = space(tmp_path, '[params]\n"schedule.warmup_epochs" = { low = 0, high = 2 }\n')
    assert got.params[0].integer and got.params[0].grid() == [0, 1, 2]
    trial = optuna.create_study().ask()
    assert isinstance(got.params[0].suggest(trial), int)


def space_defaults() -> dict:
    """asha's defaults, as a space without [pruner] options gets them: rungs at epochs 3, 9, ..."""
    from ddp_cli.sweep.space import PRUNERS

    return {"name": "asha", **PRUNERS["asha"]}


def test_asha_defaults_put_the_first_rung_after_warmup(tmp_path):
    got = space(tmp_path, '[params]\n"optim.lr_per_256" = { low = 0.1, high = 1.0 }\n')
    assert got.pruner == space_defaults() == {"name": "asha", "min_resource": 1, "reduction_factor": 3,
                                              "min_early_stopping_rate": 1}
