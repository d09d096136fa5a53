"""Faults on purpose (`DDP_FAULTS`): a signal at a step the caller names, for tests and chaos runs.

A fault timed by watching the log ("send SIGTERM once step 3 is printed") is a race against the
machine: a fast one has passed the step, or the epoch, before the signal lands. Here the rank itself
fires the fault right after the optimiser step named, so it lands at the same step on every machine:

    DDP_FAULTS="sigterm@6"          after global step 6, rank 0 sends SIGTERM to its launcher
    DDP_FAULTS="sigkill@10:1"       after global step 10, rank 1 kills itself (SIGKILL)
    DDP_FAULTS="sigstop@6:1"        after global step 6, rank 1 and its launcher freeze (SIGSTOP): a hung node
    DDP_FAULTS="sigterm@6,sigkill@3:1"   several, comma-separated

SIGTERM and SIGINT go to the launcher (the rank's parent, as a scheduler's signal would) and the rank
waits until the launcher has passed it back, so with `distributed.stop_check_steps = 1` every rank
stops after exactly that step. A fault fires in a launch's first incarnation only (the elastic
agent's restart count 0): a restarted worker that passes the step again carries on.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass

from ddp_cli.errors import ConfigError

VARIABLE = "DDP_FAULTS"
KINDS = {"sigterm": signal.SIGTERM, "sigint": signal.SIGINT, "sigkill": signal.SIGKILL,
         "sigstop": signal.SIGSTOP}
FORWARD_WAIT_S = 30.0  # how long a rank waits for its launcher to pass a signal back


@dataclass(frozen=True)
class Fault:
    kind: str
    step: int
    rank: int = 0


def parse_faults(text: str) -> list[Fault]:
    """`kind@step[:rank]`, comma-separated; anything else is a one-line error naming the variable."""
    faults = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        kind, _, where = item.partition("@")
        step, _, rank = where.partition(":")
        if kind not in KINDS or not step.isdigit() or not (rank or "0").isdigit():
            raise ConfigError(f"{VARIABLE}: cannot read {item!r}; write kind@step[:rank] with kind one of "
                              f"{', '.join(KINDS)} (e.g. {VARIABLE}=sigterm@6 or sigkill@10:1)")
        faults.append(Fault(kind, int(step), int(rank or 0)))
    return faults


class FaultPlan:
    """This rank's faults from the environment; `after_step` fires the one due at a step, if any."""

    def __init__(self, faults: list[Fault], rank: int, signalled: Callable[[], bool]) -> None:
        first_incarnation = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)) == 0
        self.due = {f.step: f for f in faults if f.rank == rank} if first_incarnation else {}
        self.signalled = signalled  # whether this rank's stop request has received a signal

    @classmethod
    def from_env(cls, rank: int, signalled: Callable[[], bool]) -> FaultPlan:
        return cls(parse_faults(os.environ.get(VARIABLE, "")), rank, signalled)

    def after_step(self, step: int) -> None:
        fault = self.due.pop(step, None)
        if fault is None:
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
