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
                                  "sigterm@-1"])
def test_an_unreadable_fault_is_one_line_naming_the_variable_and_the_form(text):
    with pytest.raises(ConfigError, match=r"DDP_FAULTS: cannot read .*; write kind@step\[:rank\]"):
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
