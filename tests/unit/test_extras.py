"""A feature whose extra is missing: one line naming `pip install 'ddp-cli[EXTRA]'`, exit 2 (the
real CLI in a venv without them: tests/e2e/test_wheel.py; preflight: tests/e2e/test_preflight.py)."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from ddp_cli.config import LoggingConfig
from ddp_cli.data.registry import DatasetEntry
from ddp_cli.data.sources.demo import load_digits
from ddp_cli.errors import USAGE, ConfigError, require_extra
from ddp_cli.observe.report import plot, summarize
from ddp_cli.observe.sinks import check_sinks


@pytest.fixture
def hide(monkeypatch):
    """Make a module look never installed (`import` fails, find_spec says None) for one test."""
    return lambda module: monkeypatch.setitem(sys.modules, module, None)


def test_the_message_names_the_install_and_the_alternative(hide):
    hide("wandb")
    with pytest.raises(ConfigError) as err:
        require_extra("wandb", "logging.wandb", "remove [logging.wandb]")
    assert err.value.exit_code == USAGE
    assert str(err.value) == ("logging.wandb: the wandb package is not installed; "
                              "pip install 'ddp-cli[wandb]' or remove [logging.wandb]")
    require_extra("s3", "an S3 root")  # installed: nothing to say


def test_an_s3_root_without_s3fs(hide):
    hide("s3fs")
    entry = DatasetEntry(name="bucket", layout="imagenet-loc", storage={"driver": "S3", "path": "s3://b/p"})
    with pytest.raises(ConfigError, match=r"^s3://b/p: the s3fs package is not installed; "
                                          r"pip install 'ddp-cli\[s3\]'$"):
        entry.open()


def test_tensorboard_logging_without_tensorboard(hide):
    hide("tensorboard")
    with pytest.raises(ConfigError, match=r"^logging.tensorboard: .* pip install 'ddp-cli\[tensorboard\]' "
                                          r"or set logging.tensorboard = false$"):
        check_sinks(LoggingConfig(tensorboard=True))
    check_sinks(LoggingConfig())  # not asked for: not needed


def test_the_report_plot_without_matplotlib_the_summary_still_reads(hide, tmp_path):
    hide("matplotlib")
    (tmp_path / "metrics.jsonl").write_text('{"split": "train", "step": 5, "loss": 1.0, "lr": 0.1}\n')
    assert summarize(tmp_path)["steps"] == 5
    with pytest.raises(ConfigError, match=r"^ddp report's plot: the matplotlib package is not installed; "
                                          r"pip install 'ddp-cli\[report\]'$"):
        plot(tmp_path, tmp_path / "report.png")


def test_the_demos_digits_ship_in_the_package_and_equal_scikit_learns(hide):
    """The core builds the demo without scikit-learn, from the very file scikit-learn bundles."""
    from sklearn.datasets import load_digits as sklearn_digits

    reference = sklearn_digits()
    hide("sklearn")
    images, target = load_digits()
    assert np.array_equal(images, reference.images) and np.array_equal(target, reference.target)


def test_a_sweep_without_optuna_and_a_postgresql_storage_without_its_driver(hide):
    from ddp_cli.sweep.storage import open_storage

    hide("psycopg")
    with pytest.raises(ConfigError, match=r"^--storage postgresql://ddp:\*\*\*@db/optuna: the psycopg "
                                          r"package is not installed; pip install 'ddp-cli\[sweep\]'$"):
        open_storage("postgresql://ddp:secret@db/optuna")
    hide("optuna")
    with pytest.raises(ConfigError, match=r"^ddp sweep: the optuna package is not installed; "
                                          r"pip install 'ddp-cli\[sweep\]'$"):
        open_storage("sqlite:///x.db")
