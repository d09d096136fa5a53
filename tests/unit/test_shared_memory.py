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
    assert sharedmem.loader_bytes(cfg, 8, 2, 8) == 8 * 8 * 2 * 32 * 224 * 224 * 3  # 616 MB on 8 GPUs
    bigger_val = DataConfig(image_size=160, val_image_size=224, batch_size=4)
    assert sharedmem.loader_bytes(bigger_val, 1, 1, 1) == 4 * 224 * 224 * 3


def test_resnet50_in_dockers_default_shm_is_refused_naming_both_sizes_and_the_fix(shm_of):
    shm_of(DOCKER_DEFAULT)
    cfg = load_config(REPO / "configs/resnet50.toml").data
    with pytest.raises(ConfigError) as refused:
        sharedmem.check_shared_memory(cfg, 8, 2, 8)
    message = str(refused.value)
    assert "/dev/shm has 64 MiB free" in message and "need 588 MiB" in message
    assert "docker run --shm-size=1g" in message and "data.workers" in message


def test_enough_shm_or_no_loader_processes_pass(shm_of):
    cfg = load_config(REPO / "configs/resnet50.toml").data
    shm_of(2**30)
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
