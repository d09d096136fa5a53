"""`DDP_FAULTS`: what it reads, and which rank fires what at which step (the firing itself:
tests/unit/test_stop_agreement.py, with the real signal and handler)."""

from __future__ import annotations

import signal

import pytest

from ddp_cli.distributed import faults
from ddp_cli.distributed.faults import Fault, FaultPlan, parse_faults
from ddp_cli.errors import ConfigError


def test_faults_are_read_as_kind_at_step_on_rank():
    assert parse_faults("sigterm@6, sigkill@10:1,") == [Fault("sigterm", 6, 0), Fault("sigkill", 10, 1)]
    assert parse_faults("") == []


@pytest.mark.parametrize("text", ["sigterm", "sigterm@", "sigterm@x", "sighup@3", "sigkill@3:r",
                                  "sigterm@-1", "sigkill@3:1/x"])
def test_an_unreadable_fault_is_one_line_naming_the_variable_and_the_form(text):
    with pytest.raises(ConfigError, match=r"DDP_FAULTS: cannot read .*; write kind@step\[:rank\]\[/restart"):
        parse_faults(text)


def plan(text: str, rank: int, monkeypatch, restarts: int = 0) -> tuple[FaultPlan, list]:
    kills = []
    monkeypatch.setenv("DDP_FAULTS", text)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", str(restarts))
    monkeypatch.setattr(faults.os, "kill", lambda pid, sig: kills.append(sig))
    return FaultPlan.from_env(rank, lambda: True), kills


def test_each_fault_fires_once_on_its_rank_after_its_step(monkeypatch):
    zero, kills = plan("sigterm@2,sigkill@3:1", 0, monkeypatch)
    for step in (1, 2, 2, 3):
        zero.after_step(step)
    assert kills == [signal.SIGTERM]
    one, kills = plan("sigterm@2,sigkill@3:1", 1, monkeypatch)
    for step in (1, 2, 3, 3):
        one.after_step(step)
    assert kills == [signal.SIGKILL]


def test_a_restarted_worker_passing_the_step_again_carries_on(monkeypatch):
    again, kills = plan("sigkill@3", 0, monkeypatch, restarts=1)
    again.after_step(3)
    assert kills == []


def test_a_sigstop_freezes_the_launcher_then_the_rank(monkeypatch):
    """A hung node: its launcher stops too, so it cannot notice and report the rank; the rank last."""
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "t")
    stop, kills = plan("sigstop@4", 0, monkeypatch)
    sent = []
    monkeypatch.setattr(faults.os, "kill", lambda pid, sig: sent.append((pid, sig)))
    stop.after_step(4)
    assert sent == [(faults.os.getppid(), signal.SIGSTOP), (faults.os.getpid(), signal.SIGSTOP)]


def test_a_fault_for_a_later_incarnation_fires_there_only(monkeypatch):
    """One launch, two kills: the first in the first incarnation, the second once the agent restarted."""
    assert parse_faults("sigkill@12:1/1") == [Fault("sigkill", 12, 1, 1)]
    first, kills = plan("sigkill@5:1,sigkill@12:1/1", 1, monkeypatch, restarts=0)
    for step in (5, 12):
        first.after_step(step)
    assert kills == [signal.SIGKILL]
    second, kills = plan("sigkill@5:1,sigkill@12:1/1", 1, monkeypatch, restarts=1)
    for step in (5, 12):
        second.after_step(step)
    assert kills == [signal.SIGKILL]


def test_diskfull_fills_a_small_disk_only_and_needs_it_named(monkeypatch, tmp_path):
    monkeypatch.delenv("DDP_FAULTS_DISK", raising=False)
    with pytest.raises(ConfigError, match="needs DDP_FAULTS_DISK"):
        parse_faults("diskfull@3")
    monkeypatch.setenv("DDP_FAULTS_DISK", str(tmp_path))
    usage = faults.shutil.disk_usage(tmp_path)
    if usage.total > faults.DISK_MAX:  # the test machine's real disk: refused, untouched
        with pytest.raises(ConfigError, match="only a disk of at most"):
            faults.fill_disk(str(tmp_path))
        assert not (tmp_path / faults.BALLAST).exists()
    Usage = type(usage)
    written = []

    class Disk:
        def __init__(self, *args):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def write(self, data):
            if len(written) == 3:
                raise OSError(faults.errno.ENOSPC, "No space left on device")
            written.append(len(data))

        def flush(self):
            pass

    monkeypatch.setattr(faults.shutil, "disk_usage", lambda path: Usage(64 << 20, 64 << 20, 0))
    monkeypatch.setattr(faults, "open", Disk, raising=False)
    faults.fill_disk(str(tmp_path))
    assert written == [1 << 20] * 3  # written until the disk refused
