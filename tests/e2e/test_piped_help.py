"""Help read through a pipe its reader closes early (`ddp train --help | head`) exits 0, for every
command: rich, which draws the help, answers the closed pipe by exiting 1 (`cli.ddp.main`)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from conftest import REPO, every_command

pytestmark = pytest.mark.slow

ENV = {**os.environ, "PYTHONPATH": str(REPO)}


def test_every_commands_help_into_a_closed_pipe_exits_0():
    """A pipe whose reader is gone before the first write: every write fails (`| head -1` lets the
    first lines through and only a race decides whether a later write meets the closed end)."""
    read, write = os.pipe()
    os.close(read)
    codes = {}
    try:
        for path, command in every_command():
            args = [*path] if hasattr(command, "commands") and path else [*path, "--help"]
            done = subprocess.run([sys.executable, "-m", "ddp_cli", *args], stdout=write,
                                  stderr=subprocess.PIPE, env=ENV, cwd=REPO, text=True, timeout=60)
            codes[" ".join(("ddp", *args))] = (done.returncode, done.stderr[-300:])
    finally:
        os.close(write)
    assert {k: v for k, v in codes.items() if v != (0, "")} == {}
    assert len(codes) > 20 and "ddp datasets" in codes  # a group without a command shows its help too


def test_train_help_piped_to_head_exits_0_under_pipefail():
    """As the user typed it."""
    line = f"{sys.executable} -m ddp_cli train --help | head -1"
    done = subprocess.run(["bash", "-o", "pipefail", "-c", line], capture_output=True, env=ENV, cwd=REPO,
                          text=True, timeout=60)
    assert done.returncode == 0 and done.stderr == "" and done.stdout.strip() == ""  # rich's first: blank
