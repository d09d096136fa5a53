"""`data.workers = "auto"` (the rule, on made-up inputs) and the start-up clock's bookkeeping."""

from __future__ import annotations

import pytest

from ddp_cli.config import DataConfig, config_from_dict
from ddp_cli.config.resolve import prefetch_for
from ddp_cli.data.pipeline.autotune import LoaderChoice, choose_workers
from ddp_cli.errors import ConfigError
from ddp_cli.observe.startup import STARTUP_ENV, StartupClock


def test_gpu_ranks_give_every_core_but_one_to_loaders():
    assert choose_workers(8, "cuda", decode=3.0, model=None)[0] == 7
    assert choose_workers(1, "cuda", decode=3.0, model=None)[0] == 1


def test_cpu_ranks_load_in_process_with_one_core_or_a_small_gain():
    assert choose_workers(1, "cpu", decode=50.0, model=1.0)[0] == 0
    workers, rule = choose_workers(4, "cpu", decode=3.0, model=300.0)  # gain 9/312 ~ 3%
    assert workers == 0 and "3%" in rule


def test_cpu_ranks_give_decoding_its_share_of_the_cores():
    assert choose_workers(2, "cpu", decode=5.0, model=5.0)[0] == 1  # share 1, gain 5/15
    assert choose_workers(8, "cpu", decode=10.0, model=30.0)[0] == 2  # share 8 * 10 / 40
    assert choose_workers(4, "cpu", decode=100.0, model=1.0)[0] == 3  # at most cores - 1


def test_prefetch_keeps_four_batches_queued_per_rank():
    assert [prefetch_for(w) for w in (0, 1, 2, 3, 8)] == [2, 4, 2, 2, 2]


def test_numbers_as_set_are_kept_and_auto_is_accepted_where_ints_were():
    choice = LoaderChoice.of(DataConfig(workers=3, prefetch_factor=2), None)
    assert (choice.workers, choice.prefetch_factor, choice.decode_ms, choice.rule) == (3, 2, None,
                                                                                     "data.workers as set")
    measured = LoaderChoice(1, 0, "the rule", cores_per_rank=2, decode_ms=3.0)
    assert LoaderChoice.of(DataConfig(workers=1, prefetch_factor=4), measured) == LoaderChoice(
        1, 4, "the rule", cores_per_rank=2, decode_ms=3.0)
    assert DataConfig(workers="auto").workers == "auto"
    with pytest.raises(ConfigError, match="data.workers"):
        config_from_dict({"data": {"workers": -1}})


def test_startup_phases_add_up_and_stop_at_the_first_step():
    clock = StartupClock(last=100.0)
    clock.mark("index", at=102.0)
    clock.mark("launch", at=103.5)
    clock.mark("index", at=104.0)  # a phase named again adds up
    assert clock.finish("first_step") is not None
    assert clock.finish("first_step") is None  # the first step only
    clock.mark("later")
    assert list(clock.phases) == ["index", "launch", "first_step"]
    assert clock.phases["index"] == pytest.approx(2.5)
    assert clock.seconds()["total"] == pytest.approx(sum(clock.phases.values()), abs=1e-3)
    assert clock.line().startswith("start-up ") and "index 2.5, launch 1.5" in clock.line()


def test_workers_continue_the_launchers_clock_unless_restarted(monkeypatch):
    monkeypatch.setenv(STARTUP_ENV, "")  # restored after the test
    StartupClock({"index": 1.0}, last=200.0).hand_over()
    worker = StartupClock.inherited()
    assert list(worker.phases) == ["index", "launch"]
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert StartupClock.inherited().phases == {}
