"""Pruning decisions at epoch ends (the trial's side, against a real study storage), the Trainer
stopping only before its last epoch, and a killed sweep's trial found, failed and queued again."""

from __future__ import annotations

import logging
import os
import subprocess
from types import SimpleNamespace

import optuna
import pytest

from ddp_cli.sweep.pruning import EpochGate, build_pruner
from ddp_cli.sweep.storage import open_storage
from ddp_cli.sweep.study import counted, owner, recover
from ddp_cli.train.trainer import Trainer

ASHA = {"name": "asha", "min_resource": 1, "reduction_factor": 3, "min_early_stopping_rate": 0}


@pytest.fixture
def study(tmp_path):
    """A study in SQLite whose first three trials reported epoch 1 at 0.9, 0.8, 0.7 and completed."""
    url = f"sqlite:///{tmp_path / 'study.db'}"
    made = optuna.create_study(storage=open_storage(url), study_name="s", direction="maximize",
                               pruner=build_pruner(ASHA))
    for value in (0.9, 0.8, 0.7):
        trial = made.ask()
        trial.suggest_float("x", 0, 1)
        gate(url, trial._trial_id, ASHA).should_prune(value, 1)
        made.tell(trial, value)
    return url, made


def gate(url: str, trial_id: int, pruner: dict) -> EpochGate:
    spec = {"storage": url, "study": "s", "trial": trial_id, "number": 9, "metric": "top1", "pruner": pruner}
    return EpochGate(spec, SimpleNamespace(is_main=True))


@pytest.mark.parametrize("pruner", [ASHA, {"name": "median", "n_startup_trials": 2, "n_warmup_steps": 0}])
def test_a_trial_behind_the_others_at_an_epoch_end_is_pruned(study, pruner):
    url, made = study
    behind, ahead = made.ask(), made.ask()
    assert gate(url, behind._trial_id, pruner).should_prune(0.1, 1) is True
    assert gate(url, ahead._trial_id, pruner).should_prune(0.95, 1) is False
    reported = made._storage.get_trial(behind._trial_id).intermediate_values
    assert reported == {1: 0.1}  # the epoch's value is in the study, for the pruner of later trials


def test_no_pruner_never_prunes(study):
    url, made = study
    assert gate(url, made.ask()._trial_id, {"name": "none"}).should_prune(0.0, 1) is False
    assert isinstance(build_pruner({"name": "none"}), optuna.pruners.NopPruner)


def test_a_storage_that_fails_costs_the_pruning_only_and_is_said_once(tmp_path, caplog):
    broken = gate(f"sqlite:///{tmp_path / 'missing' / 'dir' / 'x.db'}", 1, {"name": "none"})
    with caplog.at_level(logging.WARNING, "ddp"):
        assert broken.should_prune(0.5, 1) is False
        assert broken.should_prune(0.5, 2) is False
    warnings = [r for r in caplog.records if "cannot report epoch 1" in r.getMessage()]
    assert len(warnings) == 1 and len(caplog.records) == 1


def test_the_trainer_stops_after_an_epoch_the_gate_names_but_never_after_its_last():
    asked = []
    trainer = SimpleNamespace(cfg=SimpleNamespace(train=SimpleNamespace(epochs=4)), stopped_at=None,
                              checkpointer=SimpleNamespace(wait=lambda: asked.append("wait")),
                              stop_after_epoch=lambda val, epoch: asked.append(epoch) or True)
    assert Trainer.stopping_after(trainer, {"top1": 0.1}, 4) is False  # the last epoch: reported, not cut
    assert trainer.stopped_at is None
    assert Trainer.stopping_after(trainer, {"top1": 0.1}, 2) is True
    assert trainer.stopped_at == 2 and asked == [4, 2, "wait"]  # its checkpoint on disk before the end
    trainer.stop_after_epoch = None
    assert Trainer.stopping_after(trainer, {"top1": 0.1}, 1) is False


@pytest.mark.processes  # a process that has ended, for its pid
def test_a_trial_whose_sweep_process_died_is_failed_and_queued_again_with_its_params(study):
    url, made = study
    dead = subprocess.Popen(["true"])
    dead.wait()
    cut, live, remote = made.ask(), made.ask(), made.ask()
    for trial, who in ((cut, {**owner(), "pid": dead.pid}), (live, owner()),
                       (remote, {**owner(), "host": "another-node"})):
        trial.suggest_float("x", 0, 1)
        trial.set_user_attr("ddp_owner", who)
    params = made._storage.get_trial(cut._trial_id).params
    assert counted(made) == 6
    assert recover(made, made._storage) == [cut.number]
    states = {t.number: t.state.name for t in made.get_trials()}
    assert states[cut.number] == "FAIL" and states[live.number] == states[remote.number] == "RUNNING"
    retry = made.get_trials(states=(optuna.trial.TrialState.WAITING,))
    assert len(retry) == 1 and retry[0].system_attrs["fixed_params"] == params  # again, the same values
    assert counted(made) == 5  # the cut one no longer counts; its retry will when it runs
    again = made.ask()
    again.set_user_attr("ddp_owner", owner())  # as the sweep does at once
    assert again.number == retry[0].number and again.suggest_float("x", 0, 1) == params["x"]
    assert recover(made, made._storage) == []  # found once
    assert os.getpid() == owner()["pid"]


def test_a_storage_whose_tables_another_sweep_was_making_is_opened_again(monkeypatch):
    from sqlalchemy.exc import IntegrityError

    from ddp_cli.sweep import storage

    monkeypatch.setattr(storage.time, "sleep", lambda s: None)
    calls = []

    def opening():
        calls.append(1)
        if len(calls) < 3:
            raise IntegrityError("INSERT INTO version_info", {}, Exception("duplicate key"))
        return "storage"

    assert storage.first_to_make_the_schema(opening) == "storage" and len(calls) == 3
    calls.clear()
    with pytest.raises(IntegrityError):
        storage.first_to_make_the_schema(opening, tries=2)  # fails twice: the second failure is raised
