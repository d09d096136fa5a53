"""A worker process's life, however the elastic agent started it: forked from the launcher
(`forked`) or spawned as `python -m ddp_cli.run.worker JOB_DIR` (`main`); see `run.launch.worker_start`.

It joins the process group, runs its one job (`run.training` or `run.inference_jobs`), and ends with
an exit code: a failure is recorded for the launcher (`fail`), a peer lost on the way is told apart
from this rank's own failure, and the worker dies with its launcher rather than live on as an orphan.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import signal
import sys
import threading
import time
import traceback
from pathlib import Path

import torch.distributed as dist

from ddp_cli.data.pipeline.sharedmem import exhausted, ran_out
from ddp_cli.distributed.heartbeat import Heartbeat, describe_loss
from ddp_cli.distributed.peer_loss import lost_a_peer
from ddp_cli.distributed.setup import setup, teardown
from ddp_cli.errors import INTERNAL, PEER_LOST, SIGINT, USAGE, DdpError, WriteError, summary
from ddp_cli.fastexit import exit_if_stuck, exit_now
from ddp_cli.io import WRITE_ONLY, write_error
from ddp_cli.observe.startup import StartupClock
from ddp_cli.run.inference_jobs import predict_job, validate_job
from ddp_cli.run.jobs import read_job, record_error, write_result
from ddp_cli.run.logs import write_traceback
from ddp_cli.run.training import train_job
from ddp_cli.run.writers import writes_folder

log = logging.getLogger("ddp")
LAUNCHED = "DDP_LAUNCHED"  # set by our launcher for its workers
TEARDOWN_S = 30  # destroying the process group may wait on peers; the results are saved by then


def run_job(folder: Path, startup: StartupClock) -> int:
    """Run the job in this process (already inside a torchrun-style environment); its exit code.
    `startup` times a training job's phases up to its first step."""
    code = job_outcome(folder, startup)
    with exit_if_stuck(code, TEARDOWN_S):
        teardown()
    return code


def job_outcome(folder: Path, startup: StartupClock) -> int:
    """Run the job; its exit code, any failure recorded for the launcher."""
    rank, cfg, ctx, pulse = int(os.environ.get("RANK", 0)), None, None, None
    try:
        cfg, entry, index, job = read_job(folder)
        startup.mark("read_job")
        ctx = setup(cfg.distributed.backend, cfg.distributed.timeout_s)
        pulse = Heartbeat.start(ctx, cfg.distributed.timeout_s)
        startup.mark("process_group")
        writes = writes_folder(folder, ctx)
        if job.mode == "train":
            result = train_job(cfg, ctx, folder, entry, index, job, startup, writes)
        elif job.mode == "predict":
            result = predict_job(cfg, ctx, folder, entry, index, job, writes)
        else:
            result = validate_job(cfg, ctx, entry, index, job)
        if writes and result is not None:  # every node's launcher reports it (results are reduced, the
            write_result(folder, result)  # same); None: a finished run's result.json stays as it was
        dist.barrier()  # a node that reads rank 0's copy, once it is there
        return 0
    except DdpError as e:
        return fail(folder, rank, e.exit_code, str(e), original=True)
    except KeyboardInterrupt:
        return SIGINT
    except Exception as e:
        if ran_out(e) and cfg:  # a loader's batch found /dev/shm full: a setting, not a bug
            ranks = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
            return fail(folder, rank, USAGE, str(exhausted(cfg.data, ranks)), original=True)
        if lost_a_peer(e):  # not original: a failure recorded elsewhere comes first
            log.debug("rank %d: lost a peer: %s", rank, e)
            message = (describe_loss(e, pulse.silent() if pulse else [], ctx, cfg.distributed.timeout_s)
                       if ctx else f"rank {rank} lost a peer while joining the process group "
                       f"({str(e).splitlines()[0]})")
            return fail(folder, rank, PEER_LOST, message, original=False)
        refused = write_error(e, errnos=WRITE_ONLY)  # a write no wrapper named: the file the error names
        if refused is not None:
            return fail(folder, rank, refused.exit_code, str(refused), original=True)
        if os.environ.get("DDP_DEBUG") == "1":
            traceback.print_exc()
        log_file = write_traceback(folder, rank, e)
        where = f"; its traceback: {log_file}" if log_file else ""
        return fail(folder, rank, INTERNAL, f"internal error on rank {rank} (a bug): {summary(e)}{where}",
                    original=True)


def fail(folder: Path, rank: int, exit_code: int, message: str, original: bool) -> int:
    """Record the failure for the launcher, which prints the original one once.

    Under an external torchrun there is no launcher of ours, so say it here; and where the record
    cannot be written either (the disk that failed the run is full), say it on stderr, which the
    launcher shows with the exit code.
    """
    try:
        record_error(folder, rank, exit_code, message, original)
    except WriteError:
        say(f"error: {message}")
        return exit_code
    if LAUNCHED not in os.environ and original:
        say(f"error: {message}")
    return exit_code


def say(line: str) -> None:
    """A line on stderr, which may itself be a file on the disk that failed the run (the rank's log):
    then it is lost, and the exit code alone tells the launcher."""
    with contextlib.suppress(OSError):
        print(line, file=sys.stderr, flush=True)


def die_with_launcher(poll_s: float = 1.0) -> None:
    """Exit when the process that started this worker is gone (killed with SIGKILL, say).

    The elastic agent starts workers in sessions of their own, so killing the
    launcher's process group does not reach them; without this they would live
    on as orphans, blocked in a collective until the process-group timeout.
    """
    launcher = os.getppid()

    def watch() -> None:
        while os.getppid() == launcher:
            time.sleep(poll_s)
        os._exit(INTERNAL)  # no cleanup to wait for: the group is gone with the launcher

    threading.Thread(target=watch, name="ddp-launcher-watch", daemon=True).start()


def work(job_dir: str) -> int:
    """The worker's life, however it was started: its exit code."""
    logging.basicConfig(level=os.environ.get("DDP_LOG_LEVEL", "INFO"), format="%(message)s")
    startup = StartupClock.inherited()
    startup.mark("worker_imports")
    die_with_launcher()
    return run_job(Path(job_dir), startup)


def forked(job_dir: str) -> None:
    """The agent's function entrypoint for workers forked from the launcher.

    Made like a spawned worker first: a session of its own (a terminal's Ctrl-C
    reaches the launcher, which passes it on once) and the default signal
    handlers (not the agent's, inherited by the fork). A failure exits with its
    code; success returns, as the agent waits for a return value, once the
    loader processes are gone (they ignore SIGTERM, so multiprocessing's exit
    would wait on them forever; their work is done).
    """
    os.setsid()
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        code = work(job_dir)
    except BaseException:  # multiprocessing's own exit would wait forever on the loaders, peers on us
        exit_now(INTERNAL)
    if code:
        exit_now(code)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # torch's handler would call their deaths failures
    for loader in multiprocessing.active_children():
        loader.kill()


def main() -> None:
    exit_now(work(sys.argv[1]))


if __name__ == "__main__":
    main()
