"""The study's side of a sweep's trials: a trial its pruner stopped is recorded PRUNED (not COMPLETE),
and sweep processes sharing one study run exactly --trials between them (trials faked: no `ddp train`)."""

from __future__ import annotations

import json
import multiprocessing
import time
from pathlib import Path

import optuna
import pytest

from ddp_cli.config import load_config
from ddp_cli.sweep import study as study_module
from ddp_cli.sweep import trials
from ddp_cli.sweep.storage import open_storage
from ddp_cli.sweep.study import Sweep, SweepOptions
from tests.synthetic import write_registry

SPACE = '[params]\n"optim.lr_per_256" = { low = 0.05, high = 2.0, log = true }\n[pruner]\nname = "none"\n'


def options(tmp_path: Path, n: int) -> SweepOptions:
    (tmp_path / "space.toml").write_text(SPACE)
    demo = {"driver": "FileSystem", "path": str(tmp_path / "demo")}  # never read: the trials are fakes
    registry = write_registry(tmp_path, [{"name": "demo", "layout": "imagenet-loc", "storage": demo}])
    return SweepOptions(config=Path("configs/demo.toml"), space=tmp_path / "space.toml", trials=n,
                        study="shared", storage=f"sqlite:///{tmp_path / 'study.db'}",
                        sweep_dir=tmp_path / "sweep", registry=str(registry))


def fake_run(outcome: trials.Outcome, seconds: float = 0.0):
    """`trials.run` as a trial that ran `seconds` and wrote one validation record (`epoch` 1)."""
    def run(command: list[str], env: dict, log: Path, beat) -> trials.Outcome:
        time.sleep(seconds)
        run_dir = Path(command[command.index("--run-dir") + 1])
        run_dir.mkdir(parents=True, exist_ok=True)
        record = {"split": "val", "epoch": 1, "step": 1, "top1": 0.5, "top5": 0.9, "loss": 1.0}
        (run_dir / "metrics.jsonl").write_text(json.dumps(record) + "\n")
        return outcome
    return run


def test_a_trial_its_pruner_stopped_is_recorded_pruned_not_complete(tmp_path, monkeypatch):
    monkeypatch.setattr(trials, "run", fake_run(trials.Outcome(0, {"pruned_at_epoch": 1}, "")))
    monkeypatch.setattr(study_module, "write_plots", lambda study, folder: ({}, {}))
    sweep = Sweep(options(tmp_path, 1), lambda row: None)
    result = sweep.run()
    assert result["trials"] == {"complete": 0, "pruned": 1, "failed": 0}
    made = optuna.load_study(study_name="shared", storage=open_storage(sweep.where.storage))
    assert [t.state for t in made.get_trials()] == [optuna.trial.TrialState.PRUNED]


def share(opts: SweepOptions, ran) -> None:
    """One sweep process of several on one study: every one passes its --trials check before any asks
    (the check made slow), the way P processes that start together race."""
    checked = study_module.counted

    def slow(study):
        count = checked(study)
        time.sleep(0.5)
        return count

    study_module.counted = slow
    trials.run = fake_run(trials.Outcome(0, {}, ""), 0.2)
    study_module.write_plots = lambda study, folder: ({}, {})
    Sweep(opts, lambda row: ran.put(row["trial"])).run()


@pytest.mark.processes  # three forked sweep processes on one SQLite study
@pytest.mark.parametrize("n", [1, 4])
def test_sweep_processes_sharing_a_study_run_exactly_trials_between_them(tmp_path, n):
    opts = options(tmp_path, n)
    Sweep(opts, lambda row: None).open()  # the study made once, as the first process would
    fork = multiprocessing.get_context("fork")
    ran = fork.Queue()
    processes = [fork.Process(target=share, args=(opts, ran)) for _ in range(3)]
    for process in processes:
        process.start()
    try:
        for process in processes:
            process.join(120)
        assert [p.exitcode for p in processes] == [0, 0, 0]
    finally:
        for process in processes:
            if process.is_alive():
                process.kill()
                process.join()
    made = optuna.load_study(study_name="shared", storage=open_storage(opts.storage))
    states = [t.state.name for t in made.get_trials()]
    assert states.count("COMPLETE") == n
    assert set(states) <= {"COMPLETE", "WAITING"}  # a trial asked past --trials is queued again, unrun
    assert sorted(ran.get(timeout=5) for _ in range(n)) == sorted(
        t.number for t in made.get_trials() if t.state.name == "COMPLETE")


def test_best_toml_holds_the_winners_values_and_the_configs_own_epochs_not_the_searchs(tmp_path, monkeypatch):
    monkeypatch.setattr(trials, "run", fake_run(trials.Outcome(0, {}, "")))
    monkeypatch.setattr(study_module, "write_plots", lambda study, folder: ({}, {}))
    opts = options(tmp_path, 1)
    opts = SweepOptions(**{**vars(opts), "overrides": ["train.epochs=2", "optim.momentum=0.8"]})  # quick
    result = Sweep(opts, lambda row: None).run()
    best = Path(result["best"]["config"])
    cfg = load_config(best)
    assert cfg.train.epochs == load_config(opts.config).train.epochs != 2  # the final run's: demo.toml's
    assert cfg.optim.momentum == 0.8  # the search's other --set kept
    assert cfg.optim.lr_per_256 == result["best"]["params"]["optim.lr_per_256"]
    assert f"to train again for {cfg.train.epochs} epochs (the search's trials ran 2)" in best.read_text()
