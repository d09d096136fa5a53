"""Preflight's own rules (ddp_cli/preflight.py), called directly: the workers a torchrun started,
--resume, model.weights made absolute, SyncBatchNorm on CPU. The whole preflight is met through
the CLI in test_cli_errors, test_gpus and test_shared_memory."""

from __future__ import annotations

import pytest
import torch

from ddp_cli import preflight
from ddp_cli.config import ModelConfig, RunConfig
from ddp_cli.distributed.setup import DistContext
from ddp_cli.errors import ConfigError


def test_joined_workers_are_the_local_ones_on_world_over_local_nodes():
    ctx = DistContext(rank=5, world_size=12, local_rank=1, local_world_size=4, device=torch.device("cpu"),
                      backend="gloo")
    cfg = RunConfig().resolved({"distributed.backend": "gloo", "train.precision": "fp32"})
    workers = preflight.joined_workers(cfg, ctx)
    assert workers == preflight.Workers(nproc=4, nnodes=3, backend="gloo", device="cpu", precision="fp32")
    assert workers.world_size == 12


@pytest.mark.parametrize("resume", ["auto", "never"])
def test_resume_auto_and_never_pass_as_they_are(resume):
    assert preflight.checked_resume(resume) == resume


def test_resume_a_file_is_made_absolute_and_a_missing_one_is_a_config_error(tmp_path, monkeypatch):
    (tmp_path / "c.pt").write_bytes(b"x")
    monkeypatch.chdir(tmp_path)
    assert preflight.checked_resume("c.pt") == str(tmp_path / "c.pt")
    with pytest.raises(ConfigError, match=r"^--resume gone\.pt: no such checkpoint; use auto, never or a"):
        preflight.checked_resume("gone.pt")
    with pytest.raises(ConfigError, match="no such checkpoint"):
        preflight.checked_resume(str(tmp_path))  # a folder is not a checkpoint


def test_a_weights_file_is_made_absolute_and_a_weight_name_stays_a_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = RunConfig().resolved({"model.weights": "w/model.pt"})
    assert preflight.with_weights_path(cfg).model.weights == str(tmp_path / "w" / "model.pt")
    named = RunConfig().resolved({"model.weights": "DEFAULT"})
    assert preflight.with_weights_path(named) is named
    bare = RunConfig()
    assert preflight.with_weights_path(bare) is bare


def test_sync_batchnorm_is_refused_on_cpu_only():
    on = ModelConfig(sync_batchnorm=True)
    with pytest.raises(ConfigError, match=r"^model\.sync_batchnorm: torch's SyncBatchNorm runs on CUDA only"):
        preflight.check_sync_batchnorm(on, "cpu")
    preflight.check_sync_batchnorm(on, "cuda")
    preflight.check_sync_batchnorm(ModelConfig(sync_batchnorm=False), "cpu")
