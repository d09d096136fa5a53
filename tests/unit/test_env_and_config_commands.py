"""`ddp env` and `ddp config show | schema`, in-process."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from conftest import REPO
from typer.testing import CliRunner

from ddp_cli.cli import app
from ddp_cli.config import RunConfig, load_config
from ddp_cli.config.resolve import Facts, resolve
from ddp_cli.train.precision import native_precision

CLI_ENV = {"LOGLEVEL": "CRITICAL", "TORCH_CPP_LOG_LEVEL": "FATAL", "DDP_LOG_LEVEL": "INFO"}
# the run configs, not a sweep's space beside one (*-space.toml)
CONFIGS = sorted(p for p in (REPO / "configs").glob("*.toml") if not p.name.endswith("-space.toml"))


def invoke(*args: str):
    return CliRunner().invoke(app, list(args), env=CLI_ENV)


def last_line(result) -> dict:
    return json.loads(result.stdout.strip().splitlines()[-1])


def cpu_flags() -> set[str]:
    """The first processor's flags, read here independently of ddp (empty off Linux)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    return next((set(line.split(":", 1)[1].split()) for line in text.splitlines()
                 if line.startswith("flags")), set())


def test_env_json_reports_this_cpus_bf16_and_what_auto_picks():
    result = invoke("env", "--json")
    assert result.exit_code == 0, result.output
    info = last_line(result)
    native = bool(cpu_flags() & {"avx512_bf16", "amx_bf16"})  # machines here differ: some only AVX2
    assert info["cpu"]["bf16_native"] is native
    assert info["cpu"]["bf16_flags"] == sorted(cpu_flags() & {"avx512_bf16", "amx_bf16"})
    assert info["cpu"]["count"] == os.cpu_count() and info["cpu"]["model"]
    assert info["torch"] == torch.__version__ and info["ddp"] and info["torchvision"]
    assert info["backends"]["gloo"] is torch.distributed.is_gloo_available()
    assert info["backends"]["nccl"] is torch.distributed.is_nccl_available()
    if not torch.cuda.is_available():
        assert info["gpus"] == [] and info["backend_auto"] == "gloo" and info["nproc_per_node_auto"] == 1
        assert info["precision_auto"] == native_precision(torch.device("cpu"))
        assert info["precision_auto"] == ("bf16" if native else "fp32")


def test_env_prints_a_table_naming_the_auto_choices():
    result = invoke("env")
    assert result.exit_code == 0, result.output
    for row in ("torch", "CPU bf16", 'precision = "auto"', 'backend = "auto"'):
        assert row in result.stdout


@pytest.fixture()
def nowhere(tmp_path, monkeypatch):
    """No registry and no data set anywhere: `config show` must not need them."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("DDP_DATA_TOML", str(tmp_path / "absent.toml"))
    return tmp_path


def test_config_show_json_needs_no_data_and_has_every_key(nowhere):
    path = REPO / "configs/resnet34.toml"
    result = invoke("config", "show", str(path), "--format", "json")
    assert result.exit_code == 0, result.output
    shown = last_line(result)
    assert shown == load_config(path).model_dump(mode="json")
    assert shown["optim"]["lr"] is None and shown["logging"]["wandb"] is None  # unset keys are there
    assert set(shown) == set(RunConfig.model_fields)


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_config_show_toml_round_trips(nowhere, path):
    sets = ["--set", "train.epochs=3", "--set", "optim.lr=0.5", "--set", 'data.classes=["a", "b"]']
    result = invoke("config", "show", str(path), *sets)
    assert result.exit_code == 0, result.output
    assert "# cache_dir = unset" in result.stdout  # unset keys shown, as comments
    copy = nowhere / "shown.toml"
    copy.write_text(result.stdout)
    expected = load_config(path, sets[1::2])
    assert load_config(copy).model_dump() == expected.model_dump()
    assert expected.train.epochs == 3 and expected.data.classes == ["a", "b"]


def test_config_show_bad_config_is_exit_2_one_line_and_the_error_object(nowhere):
    bad = nowhere / "bad.toml"
    bad.write_text("[optim]\nmomentun = 0.9\n")
    for fmt in ("toml", "json"):
        result = invoke("config", "show", str(bad), "--format", fmt)
        assert result.exit_code == 2
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and "optim.momentun: unknown key" in lines[0]
        if fmt == "json":
            assert last_line(result) == {"error": lines[0].removeprefix("error: "), "exit_code": 2}
        else:
            assert result.stdout == ""
    assert invoke("config", "show", str(bad), "--format", "yaml").exit_code == 2


def test_config_schema_describes_every_section_and_refuses_unknown_keys():
    result = invoke("config", "schema")
    assert result.exit_code == 0, result.output
    schema = json.loads(result.stdout)
    assert schema["$schema"].startswith("https://json-schema.org/")
    assert set(schema["properties"]) == set(RunConfig.model_fields)
    assert schema["additionalProperties"] is False
    assert schema["$defs"]["OptimConfig"]["properties"]["lr_per_256"]["description"]


def test_a_saved_config_show_derives_its_ramp_again_for_its_own_epochs(nowhere):
    """The keys ddp derives when a run starts are shown as derived, not as numbers: a file saved from
    `config show` and given other epochs gets the ramp of those epochs (it once kept [3.2, 8.0])."""
    result = invoke("config", "show", str(REPO / "configs/demo.toml"), "--set", "train.epochs=8")
    assert result.exit_code == 0, result.output
    assert "# ramp_epochs = derived when the run starts" in result.stdout
    assert "# best_metric = derived when the run starts" in result.stdout
    saved = nowhere / "saved.toml"
    saved.write_text(result.stdout)
    longer = resolve(load_config(saved, ["train.epochs=16"]), Facts(steps_per_epoch=22))
    assert longer.data.ramp_epochs == [1.6, 9.6]
