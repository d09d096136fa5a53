"""torchrun's spellings on `ddp train`, `-v` after a command's name, and `ddp init`, in-process."""

from __future__ import annotations

import json
import logging
import os

import pytest
from conftest import REPO
from typer.testing import CliRunner

from ddp_cli.cli import app
from ddp_cli.cli.commands import datasets, training

CLI_ENV = {"LOGLEVEL": "CRITICAL", "TORCH_CPP_LOG_LEVEL": "FATAL", "DDP_LOG_LEVEL": "INFO"}
DEMO = str(REPO / "configs/demo.toml")


def invoke(*args: str):
    return CliRunner().invoke(app, list(args), env=CLI_ENV)


@pytest.fixture()
def root_level():
    """-v sets the root logger's level; put it back for the tests that follow."""
    level = logging.getLogger().level
    yield
    logging.getLogger().setLevel(level)


@pytest.fixture()
def launch_options(monkeypatch):
    """`train --dry-run` stops at the plan, which reports the launch options it was given."""
    def plan(cfg, build, run_dir, opts, resume, location):
        return vars(opts)

    monkeypatch.setattr(training, "plan", plan)


def test_a_real_dry_run_in_torchruns_spelling_with_v_at_the_end(demo_registry, root_level):
    result = invoke("train", DEMO, "--registry", str(demo_registry), "--set", "data.workers=0",
                    "--nproc_per_node", "1", "--standalone", "--max_restarts", "1", "--dry-run", "--json",
                    "-v")
    assert result.exit_code == 0, result.output
    plan = json.loads(result.stdout.strip().splitlines()[-1])
    assert plan["world_size"] == 1 and plan["nproc_per_node"] == 1
    assert logging.getLogger().level == logging.DEBUG


@pytest.mark.parametrize(("flags", "expected"), [
    (["--nproc_per_node", "3", "--node_rank", "1", "--rdzv_endpoint", "n0:29400", "--rdzv_id", "j",
      "--max_restarts", "2", "--nnodes", "1:2"],
     {"nproc_per_node": 3, "node_rank": 1, "rdzv_endpoint": "n0:29400", "rdzv_id": "j", "max_restarts": 2,
      "nnodes": 2, "min_nodes": 1}),
    (["--master_addr", "10.0.0.1", "--master_port", "29500", "--nnodes", "2", "--node-rank", "1"],
     {"rdzv_endpoint": "10.0.0.1:29500", "rdzv_id": None, "nnodes": 2, "node_rank": 1}),
    (["--master-addr", "::1", "--master-port", "29500", "--rdzv-id", "mine"],
     {"rdzv_endpoint": "[::1]:29500", "rdzv_id": "mine"}),
    (["--standalone", "--nproc-per-node", "2"], {"nproc_per_node": 2, "nnodes": 1, "rdzv_endpoint": None}),
], ids=["underscores", "master-addr-port", "ipv6-own-id", "standalone"])
def test_torchrun_spellings_map_to_ddps_options(flags, expected, demo_registry, launch_options):
    result = invoke("train", DEMO, "--registry", str(demo_registry), *flags, "--dry-run", "--json")
    assert result.exit_code == 0, result.output
    opts = json.loads(result.stdout.strip().splitlines()[-1])
    assert {key: opts[key] for key in expected} == expected


@pytest.mark.parametrize(("flags", "needle"), [
    (["--standalone", "--nnodes", "2", "--rdzv-endpoint", "n0:1"], "--standalone means this node alone"),
    (["--standalone", "--rdzv_endpoint", "n0:1"], "--rdzv-endpoint n0:1 contradicts it"),
    (["--master-addr", "n0"], "--master-addr needs --master-port too"),
    (["--master_port", "29500"], "--master-port needs --master-addr too"),
    (["--master-addr", "n0", "--master-port", "1", "--rdzv-endpoint", "n1:2"], "give only one of them"),
], ids=["standalone-nnodes", "standalone-endpoint", "addr-alone", "port-alone", "addr-and-endpoint"])
def test_torchrun_spellings_that_contradict_are_exit_2(flags, needle, demo_registry, launch_options):
    result = invoke("train", DEMO, "--registry", str(demo_registry), *flags, "--dry-run")
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], result.stderr


def test_verbose_after_the_name_turns_on_debug_logging(monkeypatch, demo_registry, root_level):
    seen = {}

    def listing(registry):
        seen.update(level=logging.getLogger().level, torch=os.environ["LOGLEVEL"])
        return []

    monkeypatch.setattr(datasets, "datasets_list", listing)
    assert invoke("datasets", "list", "--registry", str(demo_registry), "--json").exit_code == 0
    assert seen["torch"] == "CRITICAL"  # quiet without -v
    assert invoke("datasets", "list", "--registry", str(demo_registry), "--json", "--verbose").exit_code == 0
    assert seen == {"level": logging.DEBUG, "torch": "DEBUG"}


def test_init_writes_the_starter_and_never_overwrites(tmp_path):
    pytest.importorskip("ddp_cli.cli.starter")
    result = invoke("init", str(tmp_path / "start"), "--json")
    assert result.exit_code == 0, result.output
    written = json.loads(result.stdout.strip().splitlines()[-1])
    assert written["dir"] == str(tmp_path / "start")
    assert written["files"] and all((tmp_path / "start" / os.path.basename(f)).is_file()
                                    for f in written["files"])
    again = invoke("init", str(tmp_path / "start"))
    assert again.exit_code == 2 and "already exists" in again.stderr
