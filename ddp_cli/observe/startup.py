"""Where start-up time goes: wall-clock marks from the `ddp` command to the first optimisation step.

A run starts in one process (the launcher: config, index, checks, hand-off)
and trains in others (the workers), so the marks are `time.time()` stamps,
comparable across the processes of one machine, and the launcher's travel to
its workers in `$DDP_STARTUP`. Each mark is the time since the previous one,
under the name of the phase it ends; the first is measured from the start of
the process (from /proc, so interpreter and imports count too).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

STARTUP_ENV = "DDP_STARTUP"


def process_started() -> float:
    """When this process started (wall clock, to /proc's 10 ms); now where there is no /proc."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, IndexError, ValueError):
        return time.time()
    return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))


class StartupClock:
    """Phases of start-up in order, each in seconds; closed by `finish` at the first step."""

    def __init__(self, phases: dict[str, float] | None = None, last: float | None = None) -> None:
        self.phases = dict(phases or {})
        self.last = process_started() if last is None else last
        self.done = False

    @classmethod
    def inherited(cls) -> StartupClock:
        """A worker's clock: its launcher's marks, continued; a restarted worker's own start-up only
        (its launcher's marks would count the failed attempt too)."""
        handed = os.environ.get(STARTUP_ENV)
        if not handed or int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)) > 0:
            return cls()
        state = json.loads(handed)
        clock = cls(state["phases"], state["last"])
        clock.mark("launch", at=process_started())
        return clock

    def mark(self, phase: str, at: float | None = None) -> None:
        """End `phase` now (or `at`), added to it if named before; nothing once the first step is done."""
        if self.done:
            return
        now = time.time() if at is None else at
        self.phases[phase] = self.phases.get(phase, 0.0) + now - self.last
        self.last = now

    def finish(self, phase: str) -> dict[str, float] | None:
        """End the last phase; the start-up by phase with its total, the first time only."""
        if self.done:
            return None
        self.mark(phase)
        self.done = True
        return self.seconds()

    def seconds(self) -> dict[str, float]:
        return {**{k: round(v, 3) for k, v in self.phases.items()},
                "total": round(sum(self.phases.values()), 3)}

    def hand_over(self) -> None:
        """Pass the marks so far to the workers this process starts next."""
        os.environ[STARTUP_ENV] = json.dumps({"phases": self.phases, "last": self.last})

    def line(self) -> str:
        """start-up 7.9 s to the first step: index 2.1, hand-off 0.3, ..."""
        parts = ", ".join(f"{name.replace('_', ' ')} {s:.1f}" for name, s in self.phases.items())
        return f"start-up {sum(self.phases.values()):.1f} s to the first step: {parts}"
