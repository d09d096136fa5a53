"""The commands that need no model start without importing torch (seconds), through the real
console-script entry point (pyproject's `ddp`), each in a fresh interpreter."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib

import pytest
from conftest import REPO

pytestmark = pytest.mark.processes  # each test starts an interpreter

# runs `ddp ARGS` as the console script does, then reports (on stderr: stdout is the command's) whether
# it imported torch, and the registry (which `commands`, loaded lazily, imports when it runs);
# entry_point exits through os._exit, so the report is printed by a hook
PROBE = """
import atexit, json, os, sys
import ddp_cli.fastexit as fastexit
exit_now = fastexit.exit_now
def report(code):
    sys.stderr.write(json.dumps({m: m in sys.modules for m in ("torch", "ddp_cli.data.registry")}) + "\\n")
    exit_now(code)
fastexit.exit_now = report
from ddp_cli.cli import entry_point
sys.argv = ["ddp", *sys.argv[1:]]
entry_point()
"""


def ddp_probe(*args: str) -> tuple[subprocess.CompletedProcess, dict[str, bool]]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    result = subprocess.run([sys.executable, "-c", PROBE, *args], capture_output=True, text=True, env=env,
                            cwd=REPO, timeout=120)
    return result, json.loads(result.stderr.strip().splitlines()[-1])


@pytest.mark.parametrize("args", [("--help",), ("--version",), ("train", "--help"),
                                  ("bench", "step", "--help")])
def test_help_and_version_load_neither_torch_nor_the_commands(args):
    result, imported = ddp_probe(*args)
    assert result.returncode == 0, result.stderr
    assert imported == {"torch": False, "ddp_cli.data.registry": False}


def test_datasets_list_goes_through_commands_without_torch(demo_registry):
    result, imported = ddp_probe("datasets", "list", "--registry", str(demo_registry), "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.strip().splitlines()[-1])[0]["name"] == "demo"
    assert imported == {"torch": False, "ddp_cli.data.registry": True}


def test_the_console_script_names_the_entry_point():
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["ddp"] == "ddp_cli.cli:entry_point"
    result, _ = ddp_probe("--version")
    assert result.stdout.startswith("ddp ")
