"""With --json, a failing command's last stdout line is {"error", "exit_code"}; stderr keeps its line.

One case per exit code a command meets before any worker starts (2, 3, 1) and a usage
error; exit 4 through a real run: tests/e2e/test_observability.py.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ddp_cli.cli import app, main
from ddp_cli.cli.commands import datasets

CLI_ENV = {"LOGLEVEL": "CRITICAL", "TORCH_CPP_LOG_LEVEL": "FATAL", "DDP_LOG_LEVEL": "INFO"}


def invoke(*args: str):
    return CliRunner().invoke(app, list(args), env=CLI_ENV)


def error_object(stdout: str, stderr: str, code: int) -> dict:
    """The last stdout line, checked against the one stderr line."""
    error = json.loads(stdout.strip().splitlines()[-1])
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, stderr
    assert error.keys() == {"error", "exit_code"} and error["exit_code"] == code
    assert lines[0].endswith(error["error"].removeprefix("internal error (a bug): "))
    return error


def test_bad_config_exit_2(tmp_path, demo_registry):
    config = tmp_path / "run.toml"
    config.write_text("[optim]\nmomentun = 0.9\n")
    result = invoke("train", str(config), "--registry", str(demo_registry), "--dry-run", "--json")
    assert result.exit_code == 2
    error = error_object(result.stdout, result.stderr, 2)
    assert "optim.momentun: unknown key (did you mean 'momentum'?)" in error["error"]
    plain = invoke("train", str(config), "--registry", str(demo_registry), "--dry-run")
    assert plain.exit_code == 2 and plain.stdout == ""  # without --json, nothing on stdout


def test_missing_data_root_exit_3(tmp_path):
    registry = tmp_path / "data.toml"
    registry.write_text('data_config_version = 1\n[[datasets]]\nname = "gone"\nlayout = "imagefolder"\n'
                        '[datasets.storage]\ndriver = "FileSystem"\npath = "nowhere"\n')
    config = tmp_path / "run.toml"
    config.write_text('[data]\ndataset = "gone"\n')
    result = invoke("train", str(config), "--registry", str(registry), "--dry-run", "--json")
    assert result.exit_code == 3
    assert "nowhere" in error_object(result.stdout, result.stderr, 3)["error"]


def test_internal_error_exit_1_one_line_traceback_in_a_file(monkeypatch, demo_registry):
    """A bug's message of many lines (a DataLoader pastes a loader's whole traceback into its own) is its
    type and first line on the console and in the JSON error, each < 500 characters; the traceback is
    in the file the line names."""
    def broken(registry):
        raise RuntimeError("boom\n" + "  File 'deep.py', line 1, in frame\n" * 200)

    monkeypatch.delenv("DDP_DEBUG", raising=False)
    monkeypatch.setattr(datasets, "datasets_list", broken)
    result = invoke("datasets", "list", "--registry", str(demo_registry), "--json")
    assert result.exit_code == 1
    error = error_object(result.stdout, result.stderr, 1)
    assert error["error"].startswith("internal error (a bug): RuntimeError: boom; its traceback: ")
    assert len(error["error"]) < 500 and len(result.stderr.strip()) < 500
    kept = Path(error["error"].rsplit(": ", 1)[1])
    try:
        assert "deep.py" in kept.read_text() and "Traceback" in kept.read_text()
    finally:
        kept.unlink()


@pytest.mark.parametrize("json_flag", [["--json"], []], ids=["json", "plain"])
def test_usage_error_exit_2(json_flag, monkeypatch, capsys):
    """Through the real entry point: click refuses the flag before the command runs."""
    monkeypatch.setattr(sys, "argv", ["ddp", "train", "run.toml", *json_flag, "--nprocs", "2"])
    with pytest.raises(SystemExit) as exited:
        main()
    assert exited.value.code == 2
    captured = capsys.readouterr()
    if json_flag:
        assert "No such option: --nprocs" in error_object(captured.out, captured.err, 2)["error"]
    else:
        assert captured.out == "" and "No such option: --nprocs" in captured.err


def test_a_loader_process_error_is_summed_up_by_its_own_last_line():
    """What a DataLoader raises in the rank for a loader process's error: the loader's last line, and
    the process it came from; long first lines are cut."""
    from ddp_cli.errors import LINE_MAX, summary

    pasted = RuntimeError("Caught RuntimeError in DataLoader worker process 3.\nOriginal Traceback (most "
                          "recent call last):\n  File \"x.py\", line 2, in f\n    g()\nRuntimeError: "
                          "unable to allocate shared memory(shm) for file </torch_1_2_3>")
    assert summary(pasted) == ("RuntimeError: unable to allocate shared memory(shm) for file </torch_1_2_3> "
                               "(in DataLoader worker process 3)")
    assert summary(KeyError("k")) == "KeyError: 'k'"
    assert len(summary(ValueError("x" * 5000))) == LINE_MAX
