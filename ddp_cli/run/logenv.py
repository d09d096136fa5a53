"""Log levels for ddp and torch, through the environment: light (no torch), so the CLI sets them
before anything imports torch, and the launcher applies them to torch's loggers.

torch's Python warnings (the elastic agent's, torch.distributed's) help on a
first GPU run and show by default; its info chatter only with -v. c10d's C++
log stays at FATAL without -v: at WARNING it also prints its ERROR lines, each
with a C++ stack dump, for failures ddp reports itself in one line (a
rendezvous that cannot connect); the C++ warning worth having, a gloo socket
bound to a loopback host name, preflight prints itself
(`network.warn_loopback_host`). What never shows without -v is the agent's
own echo of a worker failure (a traceback of its wait, "Closing process ..."):
ddp reports the failure once, in one line, with its cause.

NCCL's own log stays at WARN ($NCCL_DEBUG; NCCL prints nothing unset): its WARN lines are the
reason for a failed collective, which ddp reads back from the rank's log when NCCL's watchdog has
taken the rank down (`run.nccl_abort`); with -v, NCCL's INFO (interfaces, transports) too.
"""

from __future__ import annotations

import logging
import os

# (default, with -v) of ddp's level ($DDP_LOG_LEVEL), torch.distributed.elastic's Python loggers'
# ($LOGLEVEL, read as they are created), c10d's C++ ($TORCH_CPP_LOG_LEVEL) and NCCL's ($NCCL_DEBUG),
# for this process and the workers; the CLI sets them (`clikit.configure_logging`)
LOG_ENV = {"DDP_LOG_LEVEL": ("INFO", "DEBUG"), "LOGLEVEL": ("WARNING", "DEBUG"),
           "TORCH_CPP_LOG_LEVEL": ("FATAL", "INFO"), "NCCL_DEBUG": ("WARN", "INFO")}
TORCH_LOGGERS = ("torch.distributed", "torch.multiprocessing")  # the agent; its forked workers' context


class AgentEchoes(logging.Filter):
    """Drops the elastic agent's own account of a failure (`launch.failure` names it once, with its
    cause): its "failed (exitcode ...)" with the traceback of the agent's wait, "Closing process ..."
    or "Terminating process ..." (forked workers) for each survivor, the death-signal and exit-barrier
    lines."""

    ECHOES = ("failed (exitcode", "Closing process", "Terminating process", "Received %s death signal",
              "Got termination signal", "Error waiting on exit barrier")

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.ECHOES)


ECHO_FILTER = AgentEchoes()


def quiet_torch_logs() -> None:
    """torch.distributed's Python log lines at $LOGLEVEL (set by the CLI: warnings, or everything
    with --verbose); below DEBUG, without the agent's echo of failures we report ourselves."""
    level = os.environ.get("LOGLEVEL", "WARNING")
    names = {n for n in logging.root.manager.loggerDict if n.startswith(TORCH_LOGGERS)}
    for name in names | set(TORCH_LOGGERS):
        logger = logging.getLogger(name)
        logger.setLevel(level)
        if level == "DEBUG":
            logger.removeFilter(ECHO_FILTER)
        else:
            logger.addFilter(ECHO_FILTER)  # a set: adding it twice keeps one
