"""Faults on purpose (`DDP_FAULTS`): a signal at a step the caller names, for tests and chaos runs.

A fault timed by watching the log ("send SIGTERM once step 3 is printed") is a race against the
machine: a fast one has passed the step, or the epoch, before the signal lands. Here the rank itself
fires the fault right after the optimiser step named, so it lands at the same step on every machine:

    DDP_FAULTS="sigterm@6"          after global step 6, rank 0 sends SIGTERM to its launcher
    DDP_FAULTS="sigkill@10:1"       after global step 10, rank 1 kills itself (SIGKILL)
    DDP_FAULTS="sigstop@6:1"        after global step 6, rank 1 and its launcher freeze (SIGSTOP): a hung node
    DDP_FAULTS="sigterm@6,sigkill@3:1"   several, comma-separated
    DDP_FAULTS="sigkill@12:1/1"     after global step 12 in the launch's second incarnation (restart 1)
    DDP_FAULTS="diskfull@8"         after global step 8, rank 0 fills the disk that $DDP_FAULTS_DISK is on

SIGTERM and SIGINT go to the launcher (the rank's parent, as a scheduler's signal would) and the rank
waits until the launcher has passed it back, so with `distributed.stop_check_steps = 1` every rank
stops after exactly that step. A fault fires in one incarnation of a launch (the elastic agent's
restart count; 0 unless `/N` says otherwise): a restarted worker that passes the step again carries on,
and a second fault for that incarnation (`/1`) is how one launch meets two kills.

`diskfull` writes a ballast file (`.ddp-fault-ballast`) until the disk refuses, so the run's next
write there meets a real ENOSPC; only on a disk of at most DISK_MAX (a tmpfs made for the purpose),
never on a real one. Removing the ballast is "making room".
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass

from ddp_cli.errors import ConfigError

VARIABLE = "DDP_FAULTS"
DISK_VARIABLE = "DDP_FAULTS_DISK"  # the folder whose disk `diskfull` fills
BALLAST = ".ddp-fault-ballast"
DISK_MAX = 1 << 30  # diskfull refuses a larger disk: it is for a tmpfs made to be filled
KINDS = {"sigterm": signal.SIGTERM, "sigint": signal.SIGINT, "sigkill": signal.SIGKILL,
         "sigstop": signal.SIGSTOP, "diskfull": None}
FORWARD_WAIT_S = 30.0  # how long a rank waits for its launcher to pass a signal back


@dataclass(frozen=True)
class Fault:
    kind: str
    step: int
    rank: int = 0
    restart: int = 0  # the incarnation it fires in (TORCHELASTIC_RESTART_COUNT)


def parse_faults(text: str) -> list[Fault]:
    """`kind@step[:rank][/restart]`, comma-separated; anything else is a one-line error naming the
    variable."""
    faults = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        kind, _, where = item.partition("@")
        where, _, restart = where.partition("/")
        step, _, rank = where.partition(":")
        numbers = (step, rank or "0", restart or "0")
        if kind not in KINDS or not all(n.isdigit() for n in numbers):
            raise ConfigError(f"{VARIABLE}: cannot read {item!r}; write kind@step[:rank][/restart] with kind "
                              f"one of {', '.join(KINDS)} (e.g. {VARIABLE}=sigterm@6 or sigkill@10:1)")
        if kind == "diskfull" and not os.environ.get(DISK_VARIABLE):
            raise ConfigError(f"{VARIABLE}: {item!r} needs {DISK_VARIABLE}, the folder whose disk to fill "
                              "(a small tmpfs: never a real disk)")
        faults.append(Fault(kind, int(step), int(rank or 0), int(restart or 0)))
    return faults


def fill_disk(folder: str) -> None:
    """A ballast file in `folder` grown until its disk refuses (ENOSPC): the disk is full. Refused on a
    disk larger than DISK_MAX."""
    usage = shutil.disk_usage(folder)
    if usage.total > DISK_MAX:
        raise ConfigError(f"{VARIABLE}: diskfull on {folder}, a disk of {usage.total >> 20} MiB: it fills "
                          f"only a disk of at most {DISK_MAX >> 20} MiB (a tmpfs made for the purpose)")
    chunk = b"\0" * (1 << 20)
    with open(os.path.join(folder, BALLAST), "ab") as ballast:
        try:
            while True:
                ballast.write(chunk)
                ballast.flush()
        except OSError as e:
            if e.errno != errno.ENOSPC:
                raise
        with contextlib.suppress(OSError):  # the last partial chunk: what fits
            ballast.write(chunk[: shutil.disk_usage(folder).free])


class FaultPlan:
    """This rank's faults from the environment; `after_step` fires the one due at a step, if any."""

    def __init__(self, faults: list[Fault], rank: int, signalled: Callable[[], bool]) -> None:
        incarnation = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
        self.due = {f.step: f for f in faults if f.rank == rank and f.restart == incarnation}
        self.signalled = signalled  # whether this rank's stop request has received a signal

    @classmethod
    def from_env(cls, rank: int, signalled: Callable[[], bool]) -> FaultPlan:
        return cls(parse_faults(os.environ.get(VARIABLE, "")), rank, signalled)

    def after_step(self, step: int) -> None:
        fault = self.due.pop(step, None)
        if fault is None:
            return
        if fault.kind == "diskfull":
            fill_disk(os.environ[DISK_VARIABLE])
            return
        sig = KINDS[fault.kind]
        launcher = os.getppid() if "TORCHELASTIC_RUN_ID" in os.environ else None  # else: signal itself
        if sig in (signal.SIGTERM, signal.SIGINT):  # a scheduler's: the launcher passes it to every rank
            os.kill(launcher or os.getpid(), sig)
            deadline = time.monotonic() + FORWARD_WAIT_S
            while not self.signalled() and time.monotonic() < deadline:
                time.sleep(0.01)
            return
        if sig == signal.SIGSTOP and launcher:  # the whole node hangs, not the rank alone
            os.kill(launcher, sig)
        os.kill(os.getpid(), sig)
