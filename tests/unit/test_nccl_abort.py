"""A rank NCCL's watchdog took down (SIGABRT) is reported as the collective failure it was, with
NCCL's reason from the rank's log; other deaths by signal as before. The logs are torch 2.14's and
NCCL's wording (strings of libtorch_cuda.so and libnccl.so.2)."""

from __future__ import annotations

import os
import signal

import pytest
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from ddp_cli.cli.clikit import configure_logging
from ddp_cli.errors import INTERNAL, PEER_LOST
from ddp_cli.run.launch import failure
from ddp_cli.run.logenv import LOG_ENV
from ddp_cli.run.logs import RankLogs

PG = "[PG ID 0 PG GUID 0(default_pg) Rank 1]"
E = "[rank1]:[E1126 01:23:45.678901234 ProcessGroupNCCL.cpp"
WORK = "WorkNCCL(SeqNum=9, OpType=ALLREDUCE, NumelIn=11689512, NumelOut=11689512, Timeout(ms)=600000)"
TERMINATE = f"terminate called after throwing an instance of 'c10::DistBackendError'\n  what():  {PG} " \
    "Process group watchdog thread terminated with exception: "
TIMED_OUT = f"{PG} Watchdog caught collective operation timeout: {WORK} ran for 600043 milliseconds " \
    "before timing out."
TIMEOUT = "\n".join([
    "epoch 1 step 40 loss 2.31",
    f"{E}:685] {TIMED_OUT}",
    f"{E}:2168] {PG} failure detected by watchdog at work sequence id: 9 PG status: last enqueued work: 9, "
    "last completed work: 8",
    f"{E}:722] {PG} Some NCCL operations have failed or timed out. Due to the asynchronous nature of CUDA "
    "kernels, subsequent GPU operations might run on corrupted/incomplete data.",
    f"{E}:728] {PG} To avoid data inconsistency, we are taking the entire process down.",
    f"{TERMINATE}{TIMED_OUT}",
    "Exception raised from checkTimeout at /pytorch/torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:688 "
    "(most recent call first):",
    "frame #0: c10::Error::Error(c10::SourceLocation, std::string) + 0x98 (0x7f3c1c5b9446 in libc10.so)",
])
PEER_GONE = "\n".join([
    "gpu-b:4242:4300 [1] misc/socket.cc:50 NCCL WARN socketProgress: Connection closed by remote peer "
    "gpu-a<48152>",
    "gpu-b:4242:4300 [1] NCCL INFO transport/net_socket.cc:539 -> 6",
    f"{TERMINATE}NCCL error: remote process exited or there was a network error, NCCL version 2.27.5",
    "ncclRemoteError: A call failed possibly due to a network error or a remote process exiting prematurely.",
    "Last error:",
    "socketProgress: Connection closed by remote peer gpu-a<48152>",
    "Exception raised from checkForNCCLErrorsInternal at "
    "/pytorch/torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:2391 (most recent call first):",
])
STUCK = (f"[rank1]:[F1126 01:23:45.678901234 ProcessGroupNCCL.cpp:1540] {PG} ProcessGroupNCCL's watchdog "
         "got stuck for 480 seconds without making progress in monitoring enqueued collectives. This "
         "typically indicates a NCCL/CUDA API (e.g., CudaEventDestroy) hang blocking the watchdog, \n")
MISUSE = "\n".join([
    f"{TERMINATE}NCCL error: invalid usage (run with NCCL_DEBUG=WARN for details), NCCL version 2.27.5",
    "ncclInvalidUsage: This usually reflects invalid usage of NCCL library.",
    "Last error:",
    "Duplicate GPU detected : rank 1 and rank 0 both on CUDA device 1b000",
])
PLAIN = "epoch 1 step 40 loss 2.31\nFatal Python error: Aborted\n\nThread 0x7f3c (most recent call first):\n"


def died(tmp_path, log: str | None, sig: signal.Signals = signal.SIGABRT, rank: int = 1):
    """`failure` for rank `rank` killed by `sig`, its stderr log holding `log` (None: no file)."""
    logs = RankLogs(tmp_path / "logs", live_console=True)
    logs.reify({0: {"RANK": "0"}, 1: {"RANK": str(rank)}})  # rank 0's stderr: the terminal
    if log is not None:
        logs.stderr_files[rank].write_text(log)
    proc = ProcessFailure(local_rank=1, pid=4242, exitcode=-sig, error_file=str(tmp_path / "none.json"))
    return failure(tmp_path, ChildFailedError("ddp_cli.run.worker", {rank: proc}), logs.stderr_files)


@pytest.mark.parametrize(("log", "words", "code"), [
    (TIMEOUT, ["a collective timed out (a peer stopped answering within distributed.timeout_s)",
               f": {WORK} ran for 600043 milliseconds ("], PEER_LOST),
    (PEER_GONE, ["a collective failed: remote process exited or there was a network error, NCCL version 2.27",
                 "; NCCL: socketProgress: Connection closed by remote peer gpu-a<48152> ("], PEER_LOST),
    (PEER_GONE.replace("gpu-b:4242:4300 [1] misc/socket.cc:50 NCCL WARN", "NCCL_DEBUG unset:"),
     ["NCCL: socketProgress: Connection closed by remote peer gpu-a<48152>"], PEER_LOST),  # its last error
    (STUCK, ["the watchdog itself hung (a NCCL or CUDA call that never returned): ProcessGroupNCCL's "
             "watchdog got stuck for 480 seconds ("], PEER_LOST),
    (MISUSE, ["a collective failed (a bug in ddp, torch or NCCL): invalid usage",
              "NCCL: Duplicate GPU detected : rank 1 and rank 0 both on CUDA device 1b000"], INTERNAL),
], ids=["timeout", "peer-gone", "peer-gone-no-warn", "watchdog-stuck", "misuse"])
def test_a_rank_nccls_watchdog_aborted_is_reported_with_nccls_reason(tmp_path, log, words, code):
    error = died(tmp_path, log)
    message = str(error)
    assert message.startswith("worker rank 1 was aborted by NCCL's watchdog: ") and "\n" not in message
    assert all(w in message for w in words), message
    assert message.endswith(f"(see {tmp_path / 'logs' / 'rank1.stderr.log'})")
    assert error.exit_code == code and "out-of-memory" not in message


@pytest.mark.parametrize(("log", "sig", "rank"), [
    (PLAIN, signal.SIGABRT, 1),  # an abort that is not NCCL's
    (TIMEOUT, signal.SIGKILL, 1),  # only an abort is NCCL's doing
    (None, signal.SIGABRT, 0),  # rank 0's stderr on a terminal: no log to read
], ids=["plain-abort", "kill", "no-log"])
def test_other_deaths_by_signal_are_reported_as_before(tmp_path, log, sig, rank):
    """Only a SIGKILL suggests the out-of-memory killer (it sends nothing else); an abort is native code's."""
    error = died(tmp_path, log, sig, rank)
    hint = ("the out-of-memory killer? see dmesg" if sig == signal.SIGKILL
            else "an abort in native code (torch, a CUDA library): see its log")
    assert str(error) == f"worker rank {rank} was killed by {sig.name} ({hint})"
    assert error.exit_code == PEER_LOST


def test_nccls_warn_lines_are_kept_unless_the_user_chose_a_level(monkeypatch):
    for name in LOG_ENV:  # restored after the test
        monkeypatch.delenv(name, raising=False)
    configure_logging(verbose=False)
    assert os.environ["NCCL_DEBUG"] == "WARN"
    monkeypatch.setenv("NCCL_DEBUG", "TRACE")
    configure_logging(verbose=False)
    assert os.environ["NCCL_DEBUG"] == "TRACE"


def test_a_rank_killed_by_sigbus_points_at_dev_shm(tmp_path):
    """A rank writing to a shared-memory segment that /dev/shm could not back dies by SIGBUS."""
    message = str(died(tmp_path, PLAIN, signal.SIGBUS))
    assert message.startswith("worker rank 1 was killed by SIGBUS (a bus error: most often /dev/shm full")
