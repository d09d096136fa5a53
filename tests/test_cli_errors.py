"""User mistakes: one line on stderr naming the file/key and the fix, the documented exit code."""

from __future__ import annotations

import pytest
import torch
from conftest import REPO, run_ddp
from typer.testing import CliRunner

from ddp_cli.cli import app

runner = CliRunner()


def invoke(*args: str):
    return runner.invoke(app, list(args))


def one_error_line(result) -> str:
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr
    assert lines[0].startswith("error:")
    return lines[0]


@pytest.fixture()
def config(tmp_path):
    def write(text: str):
        path = tmp_path / "run.toml"
        path.write_text(text)
        return str(path)
    return write


def test_toml_syntax_error_names_file_and_line(config, demo_registry):
    path = config('name = "x"\n[data\nbatch_size = 3\n')
    result = invoke("train", path, "--registry", str(demo_registry), "--dry-run")
    assert result.exit_code == 2
    line = one_error_line(result)
    assert path in line and "line 2" in line


def test_unknown_key_suggests_the_right_one(config, demo_registry):
    result = invoke("train", config("[optim]\nmomentun = 0.9\n"), "--registry", str(demo_registry),
                    "--dry-run")
    assert result.exit_code == 2
    assert "optim.momentun: unknown key (did you mean 'momentum'?)" in one_error_line(result)


def test_bad_value_names_the_key(config, demo_registry):
    result = invoke("train", config("[data]\nbatch_size = -4\n"), "--registry", str(demo_registry),
                    "--dry-run")
    assert result.exit_code == 2
    assert "data.batch_size:" in one_error_line(result)


def test_unknown_dataset_lists_known_names(config, demo_registry):
    result = invoke("train", config('[data]\ndataset = "dmeo"\n'), "--registry", str(demo_registry),
                    "--dry-run")
    assert result.exit_code == 2
    assert "did you mean 'demo'" in one_error_line(result)


def test_unknown_model_suggests_close_names(config, demo_registry):
    result = invoke("train", config('[model]\nname = "resnet35"\n'), "--registry",
                    str(demo_registry), "--dry-run")
    assert result.exit_code == 2
    assert "resnet34" in one_error_line(result)


def test_missing_config_file(demo_registry, tmp_path):
    result = invoke("train", str(tmp_path / "nope.toml"), "--registry", str(demo_registry))
    assert result.exit_code == 2
    assert "nope.toml" in one_error_line(result)


def test_malformed_set_override(config, demo_registry):
    result = invoke("train", config(""), "--registry", str(demo_registry), "--set", "optim.lr",
                    "--dry-run")
    assert result.exit_code == 2
    assert "KEY=VALUE" in one_error_line(result)


def test_missing_data_root_is_a_data_error(config, tmp_path):
    registry = tmp_path / "data.toml"
    registry.write_text('data_config_version = 1\n[[datasets]]\nname = "gone"\nlayout = "imagefolder"\n'
                        '[datasets.storage]\ndriver = "FileSystem"\npath = "nowhere"\n')
    result = invoke("train", config('[data]\ndataset = "gone"\n'), "--registry", str(registry),
                    "--dry-run")
    assert result.exit_code == 3
    assert "nowhere" in one_error_line(result)


def test_validate_missing_and_garbage_checkpoints(tmp_path):
    result = invoke("validate", "--checkpoint", str(tmp_path / "none.pt"))
    assert result.exit_code == 2 and "none.pt" in one_error_line(result)
    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(b"not a checkpoint at all")
    result = invoke("validate", "--checkpoint", str(garbage))
    assert result.exit_code == 3 and "garbage.pt" in one_error_line(result)


def test_error_inside_workers_reaches_the_launcher_once(demo_registry, tmp_path):
    """fp16 on CPU is refused by every worker; the user sees one line and exit 2."""
    assert not torch.cuda.is_available()
    result = run_ddp("train", "configs/demo.toml", "--registry", str(demo_registry), "--run-dir",
                     str(tmp_path / "run"), "--set", "train.precision=fp16", "--set", "data.workers=0",
                     cwd=REPO)
    assert result.returncode == 2, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "fp16 needs CUDA" in errors[0]
    assert "Traceback" not in result.stderr
