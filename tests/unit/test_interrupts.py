"""The launcher's answer to SIGINT/SIGTERM (`run.interrupts`), press by press, and the worker's: only the
first signal counts (a second one made a rank leave mid-collective: its peers and the checkpoint hung)."""

from __future__ import annotations

import signal

import pytest
from torch.distributed.elastic.multiprocessing.api import SignalException

from ddp_cli.distributed.signals import StopRequest
from ddp_cli.run import interrupts


@pytest.fixture
def killed(monkeypatch):
    """The abort's kills, recorded instead of sent."""
    calls: list[bool] = []
    monkeypatch.setattr(interrupts, "kill_workers", lambda: calls.append(True))
    return calls


def test_the_first_signal_stops_the_second_waits_the_third_aborts_each_said(killed, capsys):
    answer = interrupts.Interrupts(grace_s=120)
    with pytest.raises(SignalException) as first:
        answer.handle(signal.SIGINT, None)
    assert first.value.sigval == signal.SIGINT  # what the agent passes on to the workers
    said = capsys.readouterr().err
    assert said == "SIGINT: stopping: the workers finish their step and write a checkpoint\n"
    answer.handle(signal.SIGINT, None)
    said = capsys.readouterr().err
    assert said == ("SIGINT again: still stopping, waiting for the checkpoint (at most "
                    "distributed.stop_grace_s "
                    "= 120 s); a third signal aborts without it\n")
    assert not killed and not answer.aborted
    answer.handle(signal.SIGTERM, None)
    assert killed == [True] and answer.aborted == signal.SIGTERM
    assert "SIGTERM a third time: aborting" in capsys.readouterr().err
    answer.handle(signal.SIGINT, None)  # more presses: the abort is under way
    assert killed == [True]


def test_the_handlers_are_the_launchers_only_while_the_agent_runs():
    before = {sig: signal.getsignal(sig) for sig in interrupts.STOP_SIGNALS}
    with interrupts.handled(30) as answer:
        assert all(signal.getsignal(sig) == answer.handle for sig in interrupts.STOP_SIGNALS)
    assert {sig: signal.getsignal(sig) for sig in interrupts.STOP_SIGNALS} == before


def test_a_worker_stops_on_its_first_signal_and_stays_on_it():
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        stop = StopRequest(None)
        stop._handle(signal.SIGTERM, None)
        stop._handle(signal.SIGINT, None)  # no exit mid-step: the stop in progress goes on
        assert stop.signal == signal.SIGTERM
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)
