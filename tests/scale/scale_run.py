"""Many `ddp train` launchers on loopback, for `make test-scale`: start them, watch their processes
(memory per rank, open files per process), and collect what each one said."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


@dataclass
class Launcher:
    rank: int
    proc: subprocess.Popen
    out: Path
    err: Path

    def result(self) -> dict | None:
        lines = self.out.read_text().strip().splitlines()
        return json.loads(lines[-1]) if lines else None

    def tree(self) -> list[int]:
        """This launcher's pid and its workers' (its children)."""
        return [self.proc.pid, *children(self.proc.pid)]

    def kill(self) -> None:
        for pid in self.tree():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def children(pid: int) -> list[int]:
    try:
        return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def launch(n: int, nproc: int, endpoint: str, run_dir: Path, nnodes: str, args: list[str], logs: Path,
           env: dict | None = None) -> list[Launcher]:
    logs.mkdir(parents=True, exist_ok=True)
    full = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **(env or {})}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID"):
        full.pop(name, None)
    launchers = []
    for rank in range(n):
        out, err = logs / f"node{rank}.out", logs / f"node{rank}.err"
        proc = subprocess.Popen([sys.executable, "-m", "ddp_cli", "train", *args, "--run-dir", str(run_dir),
                                 "--nnodes", nnodes, "--node-rank", str(rank), "--rdzv-endpoint", endpoint,
                                 "--nproc-per-node", str(nproc), "--json", "--quiet"],
                                cwd=REPO, env=full, stdout=out.open("w"), stderr=err.open("w"),
                                start_new_session=True)
        launchers.append(Launcher(rank, proc, out, err))
    return launchers


@dataclass
class Watch:
    """Samples every launcher's and worker's memory (PSS: shared pages counted once across processes)
    and open file descriptors while the launchers run."""

    launchers: list[Launcher]
    pss_mb: dict[int, float] = field(default_factory=dict)  # the largest seen, per worker pid
    fds: dict[str, int] = field(default_factory=lambda: {"launcher": 0, "worker": 0})
    stop: threading.Event = field(default_factory=threading.Event)

    def __enter__(self) -> Watch:
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()

    def _run(self) -> None:
        while not self.stop.wait(0.5):
            for launcher in self.launchers:
                self._sample(launcher.proc.pid, "launcher")
                for pid in children(launcher.proc.pid):
                    self._sample(pid, "worker")

    def _sample(self, pid: int, kind: str) -> None:
        with contextlib.suppress(OSError, ValueError):
            self.fds[kind] = max(self.fds[kind], len(os.listdir(f"/proc/{pid}/fd")))
            if kind == "worker":
                rollup = Path(f"/proc/{pid}/smaps_rollup").read_text()
                pss = next(int(line.split()[1]) for line in rollup.splitlines() if line.startswith("Pss:"))
                self.pss_mb[pid] = max(self.pss_mb.get(pid, 0), pss / 1024)


def wait_all(launchers: list[Launcher], timeout: float) -> list[int | None]:
    deadline = time.monotonic() + timeout
    for launcher in launchers:
        with contextlib.suppress(subprocess.TimeoutExpired):
            launcher.proc.wait(max(1.0, deadline - time.monotonic()))
    codes = [launcher.proc.poll() for launcher in launchers]
    for launcher in launchers:
        launcher.kill()
    return codes
