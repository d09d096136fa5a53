"""Loader batches pass through /dev/shm: a node whose /dev/shm cannot hold them is refused before any
worker starts (a container's 64 MB default would be a bus error in the first batch)."""

from __future__ import annotations

import shutil
from collections import namedtuple

import pytest
from conftest import CLI_ENV, REPO
from typer.testing import CliRunner

from ddp_cli.cli import app
from ddp_cli.config import DataConfig, load_config
from ddp_cli.data.pipeline import sharedmem
from ddp_cli.errors import ConfigError

Usage = namedtuple("Usage", "total used free")
DOCKER_DEFAULT = 64 * 2**20


@pytest.fixture()
def shm_of(monkeypatch):
    """/dev/shm of the given size, empty."""
    def size(nbytes: int) -> None:
        real = shutil.disk_usage
        monkeypatch.setattr(sharedmem.shutil, "disk_usage",
                            lambda path: Usage(nbytes, 0, nbytes) if str(path) == "/dev/shm" else real(path))
    return size


def test_what_a_node_holds_is_its_ranks_loaders_batches():
    cfg = load_config(REPO / "configs/resnet50.toml").data  # 32 images of 224 px, 8 loaders, 2 batches each
    batch = 32 * 224 * 224 * 3 + 4096  # the collated images (4.8 MB) and their int64 labels (a whole page)
    # train and val loaders' processes, 2 batches each, and the rank's own: 1.3 GB on 8 GPUs
    assert sharedmem.loader_bytes(cfg, 8, 2, 8) == 8 * (2 * 8 * 2 + 1) * batch
    bigger_val = DataConfig(image_size=160, val_image_size=224, batch_size=4)
    assert sharedmem.loader_bytes(bigger_val, 1, 1, 1) == 3 * (147 * 4096 + 4096)


def test_resnet50_in_dockers_default_shm_is_refused_naming_both_sizes_and_the_fix(shm_of):
    shm_of(DOCKER_DEFAULT)
    cfg = load_config(REPO / "configs/resnet50.toml").data
    with pytest.raises(ConfigError) as refused:
        sharedmem.check_shared_memory(cfg, 8, 2, 8)
    message = str(refused.value)
    assert "/dev/shm has 64 MiB free" in message and "need 1214 MiB" in message
    assert "docker run --shm-size=2g" in message and "data.workers" in message


def test_enough_shm_or_no_loader_processes_pass(shm_of):
    cfg = load_config(REPO / "configs/resnet50.toml").data
    shm_of(2 * 2**30)
    sharedmem.check_shared_memory(cfg, 8, 2, 8)
    shm_of(DOCKER_DEFAULT)
    sharedmem.check_shared_memory(cfg, 0, 2, 8)  # data.workers = 0: batches never leave the rank


def test_no_dev_shm_is_not_guessed(monkeypatch):
    def missing(path):
        raise FileNotFoundError(path)

    monkeypatch.setattr(sharedmem.shutil, "disk_usage", missing)
    sharedmem.check_shared_memory(DataConfig(batch_size=4096, image_size=512), 64, 8, 8)


def test_a_dry_run_meets_the_check_exit_2(shm_of, demo_registry):
    shm_of(64 * 1024)  # 64 KiB: the demo's 2 loaders x 2 batches x 32 images of 32 px do not fit
    result = CliRunner().invoke(app, ["train", "configs/demo.toml", "--registry", str(demo_registry),
                                      "--set", "data.workers=2", "--set", "data.prefetch_factor=2",
                                      "--dry-run"], env=CLI_ENV)
    assert result.exit_code == 2, result.output
    assert "/dev/shm has 0 MiB free" in result.stderr and "--shm-size" in result.stderr


RAN_OUT_IN_A_LOADER = RuntimeError(
    "Caught RuntimeError in DataLoader worker process 0.\nOriginal Traceback (most recent call last):\n"
    "  File \"torch/storage.py\", line 536, in _share_fd_cpu_\nRuntimeError: unable to allocate shared "
    "memory(shm) for file </torch_23992_307118444_7>: No space left on device (28)")


@pytest.mark.parametrize("error", [
    RAN_OUT_IN_A_LOADER,
    RuntimeError("DataLoader worker (pid 7) is killed by signal: Bus error. It is possible that dataloader's "
                 "workers are out of shared memory. Please try to raise your shared memory limit."),
], ids=["loader-could-not-allocate", "loader-killed-by-sigbus"])
def test_shared_memory_running_out_is_told_from_a_bug(error):
    wrapped = ValueError("while training")
    wrapped.__cause__ = error
    assert sharedmem.ran_out(error) and sharedmem.ran_out(wrapped)
    assert not sharedmem.ran_out(OSError(28, "No space left on device", "/runs/x/last.pt"))  # a full disk
    assert not sharedmem.ran_out(RuntimeError("shape mismatch"))


def test_running_out_at_run_time_names_dev_shm_its_size_and_the_fixes(shm_of):
    shm_of(2**20)
    cfg = DataConfig(image_size=32, batch_size=32, workers=2, prefetch_factor=2)
    message = str(sharedmem.exhausted(cfg, 2))
    assert message.startswith("/dev/shm ran out during the run (1 MiB in all, 1 MiB free now; this node's "
                              "loaders need about 2 MiB")
    assert "--shm-size=1g" in message and "data.prefetch_factor" in message and "\n" not in message


def test_a_loader_process_places_its_batch_in_shared_memory_itself():
    """Where a full /dev/shm raises in the loader and reaches the rank (labels included: left to the
    queue's feeder thread, the failure was printed there and the rank waited forever)."""
    from unittest import mock

    import torch

    from ddp_cli.data.pipeline.loaders import collate

    items = [(torch.zeros(4, 4, 3, dtype=torch.uint8), i, "", "") for i in range(3)]
    in_process = collate(items)
    assert not in_process.images.is_shared() and not in_process.labels.is_shared()
    with mock.patch("ddp_cli.data.pipeline.loaders.get_worker_info", return_value=object()):
        in_a_loader = collate(items)
    assert in_a_loader.images.is_shared() and in_a_loader.labels.is_shared()


def test_a_rank_that_meets_a_full_dev_shm_exits_2_with_the_one_line(shm_of, tmp_path, monkeypatch, capsys):
    """The rank's own branch (`run.worker.job_outcome`), not the launcher's: its loader's batch could not be
    placed in a 1 MiB /dev/shm after the run began; the rank records exit 2 and the one line for the
    launcher, never an internal error."""
    import json
    import types

    from resolved import resolved

    from ddp_cli.config import RunConfig
    from ddp_cli.observe.startup import StartupClock
    from ddp_cli.run import worker
    from ddp_cli.run.jobs import Job

    shm_of(2**20)
    cfg = resolved(RunConfig.model_validate({"data": {"dataset": "demo", "workers": 2, "prefetch_factor": 2,
                                                      "image_size": 32, "batch_size": 32}}), loader_workers=2)
    monkeypatch.setattr(worker, "read_job", lambda folder: (cfg, None, None, Job(mode="train")))
    monkeypatch.setattr(worker, "setup", lambda backend, timeout_s: types.SimpleNamespace())
    monkeypatch.setattr(worker.Heartbeat, "start", lambda ctx, timeout_s: None)
    monkeypatch.setattr(worker, "writes_folder", lambda folder, ctx: False)

    def a_batch_that_does_not_fit(*args):
        raise RAN_OUT_IN_A_LOADER

    monkeypatch.setattr(worker, "train_job", a_batch_that_does_not_fit)
    monkeypatch.delenv(worker.LAUNCHED, raising=False)  # no launcher of ours: the rank says it itself
    assert worker.job_outcome(tmp_path, StartupClock()) == 2
    recorded = json.loads((tmp_path / "errors/rank0.json").read_text())
    assert recorded["exit_code"] == 2 and recorded["original"]
    assert recorded["message"].startswith("/dev/shm ran out during the run (1 MiB in all")
    assert "--shm-size" in recorded["message"] and "\n" not in recorded["message"]
    assert capsys.readouterr().err == f"error: {recorded['message']}\n"
