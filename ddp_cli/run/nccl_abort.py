"""A rank that NCCL took down: what NCCL said, read back from the rank's log.

NCCL's collective failures never reach Python: ProcessGroupNCCL's watchdog thread finds a
collective that timed out or failed, and takes the whole process down (an uncaught
`c10::DistBackendError`, std::terminate, SIGABRT), as does its heartbeat monitor when the watchdog
itself hangs. The launcher sees only a rank killed by SIGABRT; the reason is in the rank's stderr,
in torch's words (torch 2.14, ProcessGroupNCCL.cpp) and, with NCCL_DEBUG=WARN (`run.logenv`), in
NCCL's own `NCCL WARN` lines:

    terminate called after throwing an instance of 'c10::DistBackendError'
      what():  [PG ID 0 PG GUID 0(default_pg) Rank 1] Process group watchdog thread terminated with
      exception: [Rank 1] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=9,
      OpType=ALLREDUCE, ...) ran for 600043 milliseconds before timing out.
    node1:4242:4300 [1] misc/socket.cc:50 NCCL WARN socketProgress: Connection closed by remote peer ...
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from ddp_cli.errors import INTERNAL, PEER_LOST

TAIL_BYTES = 256 * 1024  # where the abort's lines are: the end of a log that may be long
# torch's account of the abort, most specific first: (pattern, what it means)
ABORTS = (
    (re.compile(r"Watchdog caught collective operation timeout: (.+?)(?: before timing out)?\.?$", re.M),
     "a collective timed out (a peer stopped answering within distributed.timeout_s)"),
    (re.compile(r"(ProcessGroupNCCL's watchdog got stuck for \d+ seconds)", re.M),
     "the watchdog itself hung (a NCCL or CUDA call that never returned)"),
    (re.compile(r"NCCL error: (.+)$", re.M), "a collective failed"),
)
# NCCL's error strings (ncclGetErrorString) for failures of NCCL itself or of its use: a bug
NCCL_BUGS = ("invalid usage", "invalid argument", "internal error")
WARN = re.compile(r"NCCL WARN (.+)$", re.M)
LAST_ERROR = re.compile(r"^Last error:\s*\n(.+)$", re.M)


@dataclass(frozen=True)
class NcclAbort:
    """What NCCL's watchdog found, and the exit code it means (CLI.md)."""

    what: str  # "a collective timed out (...)"
    detail: str  # torch's words for it: the collective, or NCCL's error string
    cause: str  # NCCL's own reason (its first WARN line, else its last error); may be empty

    @property
    def exit_code(self) -> int:
        """A peer lost or hung (5), unless NCCL says it was used wrongly or failed itself (1)."""
        return INTERNAL if any(bug in self.detail for bug in NCCL_BUGS) else PEER_LOST

    def message(self, rank: int, log: Path) -> str:
        cause = f"; NCCL: {self.cause}" if self.cause else ""
        bug = " (a bug in ddp, torch or NCCL)" if self.exit_code == INTERNAL else ""
        return (f"worker rank {rank} was aborted by NCCL's watchdog: {self.what}{bug}: {self.detail}"
                f"{cause} (see {log})")


def read_abort(log: Path) -> NcclAbort | None:
    """NCCL's account of why it took the rank down, from its stderr log; None without one (a plain
    SIGABRT, or a log that is not there: rank 0's stderr on a terminal)."""
    try:
        with log.open("rb") as f:
            f.seek(max(0, f.seek(0, 2) - TAIL_BYTES))
            text = f.read().decode(errors="replace")
    except OSError:
        return None
    return parse_abort(text)


def parse_abort(text: str) -> NcclAbort | None:
    for pattern, what in ABORTS:
        found = pattern.search(text)
        if found:
            cause = WARN.search(text) or LAST_ERROR.search(text)
            return NcclAbort(what, found.group(1).strip(), cause.group(1).strip() if cause else "")
    return None
