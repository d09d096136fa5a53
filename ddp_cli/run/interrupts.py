"""The launcher's answer to SIGINT/SIGTERM, each one said on stderr: stop, keep stopping, abort.

torch's elastic agent raises `SignalException` on every signal: on the first
it passes the signal to the workers and waits up to `distributed.stop_grace_s`
for them; a second one (Ctrl-C pressed twice) broke that wait, and its clean-up
sent SIGTERM, a second signal to the workers, which then left mid-collective or
mid-checkpoint and hung until the grace ran out and they were killed: 120 s of
silence and no checkpoint. So ddp takes SIGINT/SIGTERM from the agent: the
first is handed to it as before (the workers agree on a step, checkpoint and
exit 130/143); the second is only acknowledged (the stop in progress finishes
its checkpoint); the third aborts: the workers and their loaders are killed at
once and the run ends without the stop's checkpoint.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from types import FrameType

from torch.distributed.elastic.multiprocessing.api import SignalException

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
# The signals torch's agent answers itself (`LaunchConfig.signals_to_handle`): ours are SIGINT and
# SIGTERM, so it keeps only the others of its default list
AGENT_SIGNALS = "SIGHUP,SIGQUIT"


class Interrupts:
    """Counts SIGINT/SIGTERM while the agent runs; `aborted` is the signal that aborted the run, else 0."""

    def __init__(self, grace_s: int) -> None:
        self.grace_s = grace_s
        self.received = 0
        self.aborted = 0

    def handle(self, signum: int, frame: FrameType | None) -> None:
        """Said at once on stderr; the first raises what the agent stops on, the third kills the workers."""
        self.received += 1
        name = signal.Signals(signum).name
        if self.received == 1:
            say(f"{name}: stopping: the workers finish their step and write a checkpoint")
            raise SignalException(f"got signal {signum}", sigval=signal.Signals(signum))
        if self.received == 2:
            say(f"{name} again: still stopping, waiting for the checkpoint (at most distributed.stop_grace_s "
                f"= {self.grace_s} s); a third signal aborts without it")
            return
        if not self.aborted:
            self.aborted = signum
            say(f"{name} a third time: aborting, the workers killed without their stop checkpoint")
            kill_workers()


@contextlib.contextmanager
def handled(grace_s: int) -> Iterator[Interrupts]:
    """SIGINT and SIGTERM answered by an `Interrupts` for the block (the agent's run, launched with
    `signals_to_handle=AGENT_SIGNALS`); the handlers as they were afterwards."""
    interrupts = Interrupts(grace_s)
    saved = {sig: signal.signal(sig, interrupts.handle) for sig in STOP_SIGNALS}
    try:
        yield interrupts
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


def say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def kill_workers() -> None:
    """SIGKILL to every worker of this launcher and its loader processes: the agent starts each worker
    as the leader of a session of its own (forked: `run.worker.forked`; spawned: by torch), so each
    worker's process group holds the worker and its loaders, and nothing else of ours."""
    for pid in children(os.getpid()):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if os.getsid(pid) == pid:
                os.killpg(pid, signal.SIGKILL)


def children(parent: int) -> list[int]:
    """The pids whose parent is `parent` (from /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == parent:
                found.append(int(entry.name))
    return found
