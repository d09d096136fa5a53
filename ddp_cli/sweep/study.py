"""`ddp sweep`: the search loop. Ask the study for a trial, run it as `ddp train` (trials.py), tell
the study how it ended, until the study holds --trials finished trials or --timeout has passed.

A study resumes where it stopped: the same --sweep-dir (or --study) opens the same storage. A
trial its sweep process did not see to the end (killed) is marked failed and queued again with the
same parameters: at once when that process is known dead (this host), after the heartbeat's grace
period otherwise (another node). Several sweep processes share one study through an RDB storage:
each asks for its own trial, so no trial runs twice.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import psutil

from ddp_cli.config import RunConfig, apply_override, load_config
from ddp_cli.config.model_names import is_user_model
from ddp_cli.data.registry import load_registry
from ddp_cli.errors import ConfigError, DdpError
from ddp_cli.io import write_text
from ddp_cli.models.user_model import with_located_model
from ddp_cli.observe.mlflow_sink import PARENT_ENV, MlflowSink
from ddp_cli.observe.report import served_records
from ddp_cli.sweep import trials
from ddp_cli.sweep.pruning import TRIAL_ENV, build_pruner
from ddp_cli.sweep.report import BEST_CONFIG, FINAL_EPOCHS, best_trial, write_best_config, write_plots
from ddp_cli.sweep.space import Space, load_space
from ddp_cli.sweep.storage import cut_trials, masked, open_storage, requeue
from ddp_cli.userfiles import parse_toml, read_text

log = logging.getLogger("ddp")
SWEEP_FILE = "sweep.json"  # in the sweep dir: its study and storage, for a resume by --sweep-dir
DATABASE = "study.db"
TRIAL_FAILS = (2, 4)  # a trial's exit codes that fail only that trial (its values refused, diverged)
FINISHED = ("COMPLETE", "PRUNED", "RUNNING")  # trials that count towards --trials (`counts`)
FAILS_IN_A_ROW = 3  # failed trials in a row that say the fault is not the values tried


@dataclass(frozen=True)
class SweepOptions:
    config: Path
    space: Path
    trials: int = 20
    timeout: float | None = None
    study: str | None = None
    storage: str | None = None
    sweep_dir: Path | None = None
    overrides: list[str] = field(default_factory=list)
    registry: str | None = None


@dataclass(frozen=True)
class Place:
    folder: Path
    study: str
    storage: str


def default_storage(folder: Path) -> str:
    return f"sqlite:///{folder / DATABASE}"


def place(opts: SweepOptions, base: RunConfig) -> Place:
    """The sweep dir, study name and storage URL: those of the sweep dir given (or of the newest one
    of the study named, under runs/), else new ones (runs/sweep-NAME-YYYYmmdd-HHMMSS, SQLite in it)."""
    stamp = f"{datetime.now():%Y%m%d-%H%M%S}"
    folder = opts.sweep_dir
    if folder is None and opts.study:
        found = sorted(Path("runs").glob(f"sweep-{opts.study}-*/{SWEEP_FILE}"))
        folder = found[-1].parent if found else Path("runs") / f"sweep-{opts.study}-{stamp}"
    folder = (folder or Path("runs") / f"sweep-{base.name}-{stamp}").resolve()
    saved = json.loads((folder / SWEEP_FILE).read_text()) if (folder / SWEEP_FILE).is_file() else {}
    storage = opts.storage or saved.get("storage") or default_storage(folder)
    if not opts.storage and "***" in storage:
        raise ConfigError(f"{folder}: its study is in {storage}; give --storage URL (with its password)")
    return Place(folder, opts.study or saved.get("study") or f"{base.name}-{stamp}", storage)


def written(config: Path) -> dict[str, Any]:
    return parse_toml(read_text(config, ConfigError), str(config), ConfigError)


def base_config(opts: SweepOptions, base: RunConfig) -> dict[str, Any]:
    """The sweep's config as the user wrote it, with its --set: what the best config is written from,
    in the sweep's folder or wherever `sweep report --out` says. So a model file's path, relative to the
    config's folder as written, is made absolute, as `base` (the config read) holds it."""
    raw = written(opts.config)
    for item in opts.overrides:
        apply_override(raw, item)
    if is_user_model(base.model.name):
        raw.setdefault("model", {})["name"] = base.model.name
    return raw


def build_sampler(space: Space, seed: int) -> Any:
    import optuna

    sampler = space.sampler
    if sampler["name"] == "grid":
        return optuna.samplers.GridSampler({p.key: p.grid() for p in space.params}, seed=seed)
    if sampler["name"] == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    return optuna.samplers.TPESampler(seed=seed, n_startup_trials=sampler["n_startup_trials"])


def owner() -> dict[str, Any]:
    """This process, as a trial's owner: told apart from a later process with the same pid."""
    me = psutil.Process()
    return {"host": socket.gethostname(), "pid": me.pid, "started": round(me.create_time(), 2)}


def owner_gone(who: Any) -> bool:
    """The sweep process that owned a trial is known dead: it ran on this host and is not running."""
    if not isinstance(who, dict) or who.get("host") != socket.gethostname():
        return False
    try:
        return round(psutil.Process(who["pid"]).create_time(), 2) != who.get("started")
    except psutil.NoSuchProcess:
        return True


def recover(study: Any, storage: Any) -> list[int]:
    """Trials cut by the death of their sweep process: failed, and queued again (same parameters).
    Returns their numbers. (`storage`: the study's, whose calls take a trial's id.)"""
    import optuna
    from optuna.trial import TrialState

    optuna.storages.fail_stale_trials(study)  # another node's, silent past the grace period
    cut = []
    for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        if owner_gone(trial.user_attrs.get("ddp_owner")):
            storage.set_trial_user_attr(trial._trial_id, "ddp_failure", "cut: its sweep process ended")
            if storage.set_trial_state_values(trial._trial_id, TrialState.FAIL):
                requeue(study, storage.get_trial(trial._trial_id))
                cut.append(trial.number)
    return cut


def counts(trial: Any, cut: set[int]) -> bool:
    """Whether `trial` counts towards --trials: finished or running, or failed but not cut and queued
    again (its retry counts instead)."""
    return trial.state.name in FINISHED or (trial.state.name == "FAIL" and trial.number not in cut)


def counted(study: Any) -> int:
    """Trials that count towards --trials (`counts`)."""
    every = study.get_trials(deepcopy=False)
    cut = cut_trials(every)
    return sum(counts(t, cut) for t in every)


def claims(study: Any, trial: Any, total: int) -> bool:
    """Whether `trial`, just asked, is within --trials: fewer than `total` trials made before it (the
    storage's trial ids, given in the order the trials were made, on one transaction each) count or are
    queued. Sweep processes that checked `counted` at once each ask one; this rule keeps the first
    `total` of all of them, whichever process asked, so a shared study runs exactly --trials."""
    every = study.get_trials(deepcopy=False)
    cut = cut_trials(every)
    ahead = [t for t in every if t._trial_id < trial._trial_id]
    return sum(counts(t, cut) or t.state.name == "WAITING" for t in ahead) < total


def objective_value(run_dir: Path, space: Space) -> float | None:
    """The best epoch's validation metric of a run (the space's direction decides best), of the weights
    its best.pt holds: the value its pruner was told each epoch, and `ddp report`'s best_top1."""
    values = [r[space.metric] for r in served_records(run_dir)[1]] if (run_dir / "metrics.jsonl").is_file() \
        else []
    if not values:
        return None
    return max(values) if space.direction == "maximize" else min(values)


class Sweep:
    def __init__(self, opts: SweepOptions, progress: Callable[[dict[str, Any]], None]) -> None:
        self.opts, self.progress = opts, progress
        self.base = with_located_model(load_config(opts.config, opts.overrides), opts.config)
        self.space = load_space(opts.space, self.base)  # every check made before any trial
        load_registry(opts.registry).get(self.base.data.dataset)
        self.where = place(opts, self.base)
        self.failures: list[tuple[int, str]] = []
        self.in_a_row = 0  # trials failed in a row: FAILS_IN_A_ROW of them stop the sweep
        self.storage: Any = None  # the study's (open), and the sweep's MLflow run id, if any
        self.parent_id: str | None = None

    def open(self) -> Any:
        import optuna

        where = self.where
        where.folder.mkdir(parents=True, exist_ok=True)
        self.storage = open_storage(where.storage)
        study = optuna.create_study(
            storage=self.storage, study_name=where.study, direction=self.space.direction,
            sampler=build_sampler(self.space, self.space.sampler["seed"]),
            pruner=build_pruner(self.space.pruner), load_if_exists=True)
        if study.direction.name.lower() != self.space.direction:
            raise ConfigError(f"{self.opts.space}: direction {self.space.direction} but study {where.study} "
                              f"{study.direction.name.lower()}s; start a new study")
        if "ddp_config" not in study.user_attrs:
            study.set_user_attr("ddp_config", base_config(self.opts, self.base))
            # the final run's epochs: the config file's own, not a quick search's --set (None: the default)
            study.set_user_attr(FINAL_EPOCHS, written(self.opts.config).get("train", {}).get("epochs"))
            study.set_user_attr("ddp_space", self.space.as_dict())
        saved = {"study": where.study, "storage": masked(where.storage), "config": str(self.opts.config),
                 "space": str(self.opts.space)}
        write_text(where.folder / SWEEP_FILE, json.dumps(saved, indent=2) + "\n")
        return study

    def run(self) -> dict[str, Any]:
        study = self.open()
        for number in recover(study, self.storage):
            log.info(f"trial {number} was cut by the end of its sweep process: failed, queued again")
        tracking = self.parent_run()
        self.parent_id = tracking.wait_for_run() if tracking else None  # for the trials to nest under
        started = time.monotonic()
        while counted(study) < self.total():
            if self.opts.timeout and time.monotonic() - started > self.opts.timeout:
                break
            row = self.one_trial(study)
            if row is None:  # other processes sharing the study took the last trials
                break
            self.progress(row)
            self.in_a_row = self.in_a_row + 1 if row["state"] == "failed" else 0
            if self.in_a_row == FAILS_IN_A_ROW:
                code, error = self.failures[-1]
                raise DdpError(f"{FAILS_IN_A_ROW} trials in a row failed, the last: {error} (logs: "
                               f"{self.where.folder / 'logs'})", code)
        return self.finish(study, tracking)

    def total(self) -> int:
        if self.space.sampler["name"] != "grid":
            return self.opts.trials
        points = 1
        for param in self.space.params:
            points *= len(param.grid())
        return min(self.opts.trials, points)

    def one_trial(self, study: Any) -> dict[str, Any] | None:
        """Ask, run and tell one trial; None when the trial asked is past --trials (`claims`): it goes
        back to the study's queue unrun, for a later sweep with more --trials."""
        from optuna.trial import TrialState

        trial = study.ask()
        if not claims(study, trial, self.total()):
            self.storage.set_trial_state_values(trial._trial_id, TrialState.WAITING)
            return None
        trial.set_user_attr("ddp_owner", owner())
        self.storage.record_heartbeat(trial._trial_id)
        if self.space.sampler["name"] != "grid":  # trial N samples with seed + N: a resumed or shared
            study.sampler = build_sampler(self.space, self.space.sampler["seed"] + trial.number)  # study too
        params = {p.key: p.suggest(trial) for p in self.space.params}
        run_dir = self.where.folder / f"trial-{trial.number:04d}"
        trial.set_user_attr("run_dir", str(run_dir))
        spec = {"storage": self.where.storage, "study": self.where.study, "trial": trial._trial_id,
                "number": trial.number, "metric": self.space.metric, "pruner": self.space.pruner}
        env = {TRIAL_ENV: json.dumps(spec)} | ({PARENT_ENV: self.parent_id} if self.parent_id else {})
        opts = self.opts
        command = trials.train_command(opts.config, opts.overrides, params, run_dir, opts.registry)
        started = time.monotonic()
        try:
            outcome = trials.run(command, env, self.where.folder / "logs" / f"trial-{trial.number:04d}.log",
                                 lambda: self.storage.record_heartbeat(trial._trial_id))
        except (KeyboardInterrupt, SystemExit) as stop:
            self.cut(study, trial, f"interrupted (exit {trials.interrupted_code(stop)})")
            raise
        seconds = time.monotonic() - started
        trial.set_user_attr("seconds", round(seconds, 1))
        return self.tell(study, trial, outcome, run_dir) | {"params": params, "seconds": seconds}

    def tell(self, study: Any, trial: Any, outcome: trials.Outcome, run_dir: Path) -> dict[str, Any]:
        from optuna.trial import TrialState

        row = {"trial": trial.number, "run_dir": str(run_dir)}
        if outcome.code == 0 and outcome.pruned_at:
            study.tell(trial, state=TrialState.PRUNED)
            return row | {"state": "pruned", "epochs": outcome.pruned_at,
                          "value": self.storage.get_trial(trial._trial_id).value}
        value = objective_value(run_dir, self.space) if outcome.code == 0 else None
        if value is not None:
            study.tell(trial, value)
            return row | {"state": "complete", "value": value, "epochs": self.base.train.epochs}
        error = outcome.result.get("error") or outcome.error or "no validation record"
        trial.set_user_attr("ddp_failure", f"exit {outcome.code}: {error}")
        study.tell(trial, state=TrialState.FAIL)
        self.failures.append((outcome.code, error))
        if outcome.code not in (0, *TRIAL_FAILS):
            raise DdpError(f"trial {trial.number} failed: {error} (log: {self.where.folder / 'logs'}); the "
                           f"same command resumes the sweep", outcome.code)
        return row | {"state": "failed", "value": None, "error": error, "exit_code": outcome.code}

    def cut(self, study: Any, trial: Any, why: str) -> None:
        """A trial this process stopped (Ctrl-C, SIGTERM): failed, and queued again for the resume."""
        from optuna.trial import TrialState

        trial.set_user_attr("ddp_failure", why)
        study.tell(trial, state=TrialState.FAIL)
        requeue(study, self.storage.get_trial(trial._trial_id))

    def parent_run(self) -> MlflowSink | None:
        """The sweep's own MLflow run, which each trial's run nests under ([logging.mlflow] asks)."""
        settings = self.base.logging.mlflow
        if not settings:
            return None
        return MlflowSink(settings.model_copy(update={"run_name": f"sweep-{self.where.study}"}),
                          self.where.folder, {"study": self.where.study, **self.space.as_dict()["params"]})

    def finish(self, study: Any, tracking: MlflowSink | None) -> dict[str, Any]:
        from optuna.trial import TrialState

        counts = {s.lower(): len(study.get_trials(deepcopy=False, states=(TrialState[s],)))
                  for s in ("COMPLETE", "PRUNED", "FAIL")}
        best = best_trial(study)
        if best is None and self.failures:
            code, error = self.failures[0]
            raise DdpError(f"no trial of study {self.where.study} finished; the first failed: {error}", code)
        config = write_best_config(study, self.where.folder / BEST_CONFIG) if best else None
        plots = write_plots(study, self.where.folder)[0] if importlib.util.find_spec("matplotlib") else {}
        if tracking:
            if best:
                tracking.write({"split": "sweep", "step": best.number, self.space.metric: best.value})
            for path in [config, *plots.values()]:
                if path:
                    tracking.attach(Path(path))
            tracking.close()
        return {
            "study": self.where.study, "storage": masked(self.where.storage),
            "sweep_dir": str(self.where.folder),
            "best": {"trial": best.number, "value": best.value, "params": best.params, "config": str(config)}
            if best else None,
            "trials": {"complete": counts["complete"], "pruned": counts["pruned"], "failed": counts["fail"]},
        }


def sweep(opts: SweepOptions, progress: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    """`ddp sweep`: run the study to --trials finished trials (or --timeout); its summary."""
    return Sweep(opts, progress).run()
