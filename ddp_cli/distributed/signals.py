"""Graceful stop: SIGTERM/SIGINT ask every rank to finish its step, checkpoint, and exit 143/130.

A signal only sets a flag. Ranks agree on it with a tiny all-reduce (MAX) on a
CPU gloo group, so they all stop after the same step and nobody is left waiting
in a collective. They agree only every `distributed.stop_check_steps` steps (and
at each checkpoint due anyway and each epoch's end; see `Checkpointer.due`), not
after every step, so the host is not held back to meet the other ranks over TCP
each step: a stop comes at most that many steps after the signal, which
`distributed.stop_grace_s` must cover. Later signals change nothing here: a rank
that left mid-collective or mid-checkpoint would hang its peers and lose the
checkpoint; the launcher answers them (`run.interrupts`: the third aborts).
"""

from __future__ import annotations

import signal

import torch
import torch.distributed as dist

from ddp_cli.distributed.faults import FaultPlan
from ddp_cli.errors import SIGINT, SIGTERM

CODES = {signal.SIGTERM: SIGTERM, signal.SIGINT: SIGINT}


class StopRequest:
    """Installed in each worker; `agreed()` is the collective check, every `stop_check_steps` steps."""

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.group = group
        self.signal = 0
        for sig in CODES:
            signal.signal(sig, self._handle)
        rank = dist.get_rank() if dist.is_initialized() else 0
        self.faults = FaultPlan.from_env(rank, lambda: bool(self.signal))

    def _handle(self, signum: int, frame: object) -> None:
        self.signal = self.signal or signum  # the first signal is the one the run stops on

    def after_step(self, step: int) -> None:
        """Called by every rank after every step: fires a fault `DDP_FAULTS` names for it (tests, chaos)."""
        self.faults.after_step(step)

    def agreed(self) -> int:
        """The signal some rank received (0 if none); the same answer on every rank."""
        flag = torch.tensor([self.signal], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        return int(flag.item())

    @staticmethod
    def exit_code(signum: int) -> int:
        return CODES[signal.Signals(signum)]


def control_group(backend: str) -> dist.ProcessGroup | None:
    """A CPU (gloo) group for small control messages; the default group when it already is gloo."""
    return None if backend == "gloo" else dist.new_group(backend="gloo")
