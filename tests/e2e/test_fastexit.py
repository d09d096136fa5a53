"""Leaving fast: the exit code survives, output is flushed, a stuck clean-up cannot hang a process."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = """
import time
from ddp_cli.fastexit import exit_if_stuck, run_and_exit

def main():
    print("saved", flush=False)
    with exit_if_stuck(9, 60):
        pass  # finishes: the timer is cancelled
    with exit_if_stuck(7, {stuck}):
        time.sleep(30)  # a clean-up that never returns
    raise SystemExit(3)

run_and_exit(main)
"""


def run(script: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=20)


def test_a_stuck_block_exits_with_the_code_given_and_output_is_flushed():
    result = run(SCRIPT.format(stuck=0.5))
    assert result.returncode == 7 and result.stdout == "saved\n"


def test_otherwise_the_code_of_sys_exit_is_kept():
    result = run(SCRIPT.format(stuck=60).replace("time.sleep(30)", "pass"))
    assert result.returncode == 3 and result.stdout == "saved\n"
