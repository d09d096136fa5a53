"""One trial as a process: `ddp train CONFIG --set KEY=VALUE... --run-dir DIR --json --quiet` on all
of the node's workers, its output in the sweep dir's logs/, and its outcome read back.

The trial's `ddp train` gets a session of its own (the sweep passes a Ctrl-C or a SIGTERM on, once)
and is told to stop (SIGTERM) when the sweep process dies, even by SIGKILL: it never outlives the
sweep. While it runs, `beat` is called every HEARTBEAT_S: the study's heartbeat of the trial.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tomli_w

from ddp_cli.errors import SIGINT, SIGTERM
from ddp_cli.sweep.storage import HEARTBEAT_S

PR_SET_PDEATHSIG = 1
STOP_WAIT_S = 120  # a trial told to stop saves its checkpoint first; then it is killed


@dataclass(frozen=True)
class Outcome:
    code: int
    result: dict[str, Any]  # `ddp train --json`'s document ({} when it printed none)
    error: str  # the trial's last error line, for a failed one

    @property
    def pruned_at(self) -> int | None:
        return self.result.get("pruned_at_epoch")


def toml_value(value: Any) -> str:
    """`value` as `--set` reads it (TOML value syntax)."""
    return tomli_w.dumps({"v": value})[4:].strip()


def train_command(config: Path, overrides: list[str], params: dict[str, Any], run_dir: Path,
                  registry: str | None) -> list[str]:
    sets = [*overrides, *(f"{key}={toml_value(value)}" for key, value in params.items())]
    return [sys.executable, "-m", "ddp_cli", "train", str(config), *(a for s in sets for a in ("--set", s)),
            "--run-dir", str(run_dir), "--resume", "never", "--json", "--quiet",
            *(["--registry", registry] if registry else [])]


# looked up here, not in the child: between fork and exec only the call itself runs
PRCTL = ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else None


def stop_with_parent() -> None:
    """In the trial's process before it runs: SIGTERM when the sweep dies (Linux's parent-death signal)."""
    if PRCTL is not None:
        PRCTL(PR_SET_PDEATHSIG, signal.SIGTERM)


def run(command: list[str], env: dict[str, str], log: Path, beat: Callable[[], None]) -> Outcome:
    """Run the trial to its end; a Ctrl-C or SIGTERM of the sweep is passed on, waited for (the trial
    saves its checkpoint), and raised again as KeyboardInterrupt / SystemExit(143)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    out = log.with_suffix(".json")
    with open(log, "ab") as err, open(out, "wb") as stdout:
        process = subprocess.Popen(command, stdout=stdout, stderr=err, env={**os.environ, **env},
                                   start_new_session=True, preexec_fn=stop_with_parent)
        previous = signal.signal(signal.SIGTERM, exit_on_sigterm)
        try:
            while True:
                try:
                    code = process.wait(HEARTBEAT_S)
                    break
                except subprocess.TimeoutExpired:
                    beat()
        except (KeyboardInterrupt, SystemExit) as stop:
            stop_trial(process, signal.SIGINT if isinstance(stop, KeyboardInterrupt) else signal.SIGTERM)
            raise
        finally:
            signal.signal(signal.SIGTERM, previous)
    return Outcome(code, last_json(out), last_error(log))


def stop_trial(process: subprocess.Popen, sig: int) -> None:
    """`sig` to the trial's process group, then SIGKILL if it has not ended in STOP_WAIT_S."""
    try:
        os.killpg(process.pid, sig)
        process.wait(STOP_WAIT_S)
    except ProcessLookupError:
        return
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(SIGTERM)


def interrupted_code(stop: BaseException) -> int:
    return SIGINT if isinstance(stop, KeyboardInterrupt) else SIGTERM


def last_json(path: Path) -> dict[str, Any]:
    lines = path.read_text(errors="replace").strip().splitlines() if path.is_file() else []
    try:
        document = json.loads(lines[-1]) if lines else {}
    except json.JSONDecodeError:
        return {}
    return document if isinstance(document, dict) else {}


def last_error(log: Path) -> str:
    """The trial's error line (`error: ...`), else its last line."""
    lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()] \
        if log.is_file() else []
    errors = [line for line in lines if line.startswith("error:")]
    return (errors or lines or [""])[-1].removeprefix("error:").strip()[:500]
