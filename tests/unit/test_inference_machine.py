"""A checkpoint is validated, predicted and exported on the machine at hand, not the one that trained
it: backend "auto", precision the checkpoint's where this machine computes it natively, else "auto",
and --precision over both (issue 26). The whole command on the demo:
tests/e2e/test_gpu_checkpoint_on_cpu.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import CLI_ENV
from typer.testing import CliRunner

from ddp_cli.cli import app
from ddp_cli.cli.commands import checkpoints
from ddp_cli.config import RunConfig
from ddp_cli.errors import ConfigError
from ddp_cli.models import TinyResNet
from ddp_cli.preflight import validation_workers
from ddp_cli.run.launch import LaunchOptions
from ddp_cli.train import precision
from ddp_cli.train.checkpoint import save_checkpoint
from ddp_cli.train.checkpoint_model import Trained, load_trained


def gpu_checkpoint(path: Path, trained_in: str = "fp16") -> Trained:
    """A checkpoint of 8 GPUs' run: nccl named, fp16 (or `trained_in`)."""
    cfg = RunConfig.model_validate({"model": {"name": "resnet_tiny"}, "data": {"image_size": 32},
                                    "train": {"precision": trained_in},
                                    "distributed": {"backend": "nccl", "nproc_per_node": 8}})
    save_checkpoint({"model": TinyResNet(3).state_dict(), "final": {"top1": 0.5},
                     "config": cfg.model_dump(mode="json"), "classes": ["a", "b", "c"],
                     "descriptions": ["a", "b", "c"], "dataset": {"name": "d"}}, path)
    return load_trained(path)


@pytest.fixture()
def no_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def test_an_fp16_nccl_checkpoint_runs_on_a_cpu_machine(tmp_path, no_gpu):
    trained = gpu_checkpoint(tmp_path / "c.pt")
    cfg = checkpoints.inference_config(trained, None, None)
    assert (cfg.distributed.backend, cfg.train.precision) == ("auto", "auto")
    workers, _ = validation_workers(cfg, 3, LaunchOptions(nproc_per_node=1))  # refused (exit 2) before
    assert (workers.backend, workers.device) == ("gloo", "cpu")
    assert workers.native_precision == precision.native_precision(torch.device("cpu"))


@pytest.mark.parametrize(("native", "expected"), [(True, "bf16"), (False, "auto")])
def test_bf16_is_kept_where_this_cpu_computes_it(tmp_path, no_gpu, monkeypatch, native, expected):
    monkeypatch.setattr(precision, "native_bf16", lambda device: native)
    trained = gpu_checkpoint(tmp_path / "c.pt", "bf16")
    assert checkpoints.inference_config(trained, None, None).train.precision == expected


def test_fp16_is_kept_on_a_gpu_machine(tmp_path, monkeypatch):
    monkeypatch.setattr("ddp_cli.distributed.setup.cuda_devices", lambda: 2)
    trained = gpu_checkpoint(tmp_path / "c.pt")
    assert checkpoints.inference_config(trained, None, None).train.precision == "fp16"


def test_precision_flag_overrides_and_fp16_without_a_gpu_names_the_flag(tmp_path, no_gpu):
    trained = gpu_checkpoint(tmp_path / "c.pt")
    assert checkpoints.inference_config(trained, 16, None, "fp32").train.precision == "fp32"
    assert checkpoints.inference_config(trained, 16, None, "bf16").data.batch_size == 16
    with pytest.raises(ConfigError, match="--precision fp16: needs a CUDA GPU"):
        checkpoints.inference_config(trained, None, None, "fp16")


def test_such_a_checkpoint_exports_on_the_cpu(tmp_path, no_gpu):
    gpu_checkpoint(tmp_path / "c.pt")
    result = CliRunner().invoke(app, ["export", "--checkpoint", str(tmp_path / "c.pt"), "--format",
                                      "state_dict", "--out", str(tmp_path / "m.pt"), "--json"], env=CLI_ENV)
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout.strip().splitlines()[-1])["format"] == "state_dict"


@pytest.mark.parametrize("command", ["validate", "predict"])
def test_the_precision_flag_reaches_the_command_and_a_bad_value_is_a_usage_error(tmp_path, no_gpu, command):
    gpu_checkpoint(tmp_path / "c.pt")
    args = [command, "--checkpoint", str(tmp_path / "c.pt"), "--json"]
    bad = CliRunner().invoke(app, [*args, "--precision", "fp64"], env=CLI_ENV)
    assert bad.exit_code == 2 and "--precision fp64: use auto or fp32 or bf16 or fp16" in bad.output
    fp16 = CliRunner().invoke(app, [*args, "--precision", "fp16"], env=CLI_ENV)  # no GPU here: refused
    assert fp16.exit_code == 2 and "--precision fp16: needs a CUDA GPU" in fp16.output
