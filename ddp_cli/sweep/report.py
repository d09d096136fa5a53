"""What a study found: a row per trial, the best trial's config as a TOML `ddp train` takes as is, and
Optuna's pictures (optimisation history, parameter importances, parallel coordinates) as PNGs.
"""

from __future__ import annotations

import copy
import logging
import warnings
from pathlib import Path
from typing import Any

import tomli_w

from ddp_cli.config import apply_override, config_from_dict
from ddp_cli.errors import ConfigError, require_extra
from ddp_cli.io import write_text
from ddp_cli.sweep.trials import toml_value

log = logging.getLogger("ddp")
BEST_CONFIG = "best.toml"
FINAL_EPOCHS = "ddp_final_epochs"  # a study's user attr: train.epochs of the config file, without --set
PLOTS = {"history": "plot_optimization_history", "importances": "plot_param_importances",
         "parallel_coordinate": "plot_parallel_coordinate"}


def best_trial(study: Any) -> Any:
    """The complete trial with the best value (the study's direction), or None."""
    from optuna.trial import TrialState

    done = [t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)) if t.value is not None]
    if not done:
        return None
    pick = max if study.direction.name == "MAXIMIZE" else min
    return pick(done, key=lambda t: t.value)


def rows(study: Any) -> list[dict[str, Any]]:
    """Each trial: number, state, value, params, epochs reached, wall time, run dir."""
    out = []
    for trial in study.get_trials(deepcopy=False):
        seconds = trial.user_attrs.get("seconds")
        if seconds is None and trial.datetime_start and trial.datetime_complete:
            seconds = (trial.datetime_complete - trial.datetime_start).total_seconds()
        out.append({"trial": trial.number, "state": trial.state.name.lower(), "value": trial.value,
                    "params": trial.params, "epochs": max(trial.intermediate_values, default=None),
                    "seconds": seconds, "run_dir": trial.user_attrs.get("run_dir"),
                    **({"error": trial.user_attrs["ddp_failure"]}
                       if "ddp_failure" in trial.user_attrs else {})})
    return out


def best_config_text(study: Any, trial: Any) -> str:
    """The sweep's config (as written, with its --set) with the trial's values, for the final run: its
    train.epochs the config file's own (FINAL_EPOCHS; unset there: the default), not a quick search's
    --set, unless the space searched train.epochs. Checked as the run config it is, so `ddp train`
    takes it as is."""
    raw = copy.deepcopy(study.user_attrs.get("ddp_config"))
    if not isinstance(raw, dict):
        raise ConfigError(f"study {study.study_name}: not made by `ddp sweep` (no config of its own)")
    searched = raw.get("train", {}).get("epochs")
    if FINAL_EPOCHS in study.user_attrs:  # a study made before it was recorded keeps the search's
        raw.setdefault("train", {}).pop("epochs", None)
        if study.user_attrs[FINAL_EPOCHS] is not None:
            raw["train"]["epochs"] = study.user_attrs[FINAL_EPOCHS]
        if not raw["train"]:
            del raw["train"]
    for key, value in trial.params.items():
        apply_override(raw, f"{key}={toml_value(value)}")
    epochs = config_from_dict(raw, f"study {study.study_name}'s best config").train.epochs
    ran = trial.params.get("train.epochs", searched)
    note = "" if ran in (None, epochs) else f" (the search's trials ran {ran})"
    header = (f"# The best trial ({trial.number}, value {trial.value}) of study {study.study_name}, "
              f"to train again for {epochs} epochs{note}:\n#   ddp train {BEST_CONFIG}\n")
    return header + tomli_w.dumps(raw)


def write_best_config(study: Any, out: Path) -> Path | None:
    trial = best_trial(study)
    if trial is None:
        return None
    write_text(out, best_config_text(study, trial))
    return out


def write_plots(study: Any, folder: Path) -> tuple[dict[str, str], dict[str, str]]:
    """The PNGs that the trials so far allow (paths), and why the others were left out (importances need
    two complete trials, for instance). Needs matplotlib (the report extra)."""
    require_extra("report", "ddp sweep's plots")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import optuna.visualization.matplotlib as vis

    written, skipped = {}, {}
    for name, function in PLOTS.items():
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # optuna's ExperimentalWarning on each call
                axes = getattr(vis, function)(study)
            figure = (axes.flat[0] if hasattr(axes, "flat") else axes).get_figure()
            figure.set_size_inches(9, 6)
            path = folder / f"{name}.png"
            figure.savefig(path, dpi=100, bbox_inches="tight")
            plt.close(figure)
            written[name] = str(path)
        except (ValueError, RuntimeError, ZeroDivisionError) as e:
            skipped[name] = str(e).splitlines()[0] if str(e) else type(e).__name__
            plt.close("all")
    return written, skipped


def report(study: Any, storage: str, folder: Path) -> dict[str, Any]:
    """`ddp sweep report`: the rows, the best trial and its config, the plots, all in `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    best = best_trial(study)
    config = write_best_config(study, folder / BEST_CONFIG)
    plots, skipped = write_plots(study, folder)
    space = study.user_attrs.get("ddp_space", {})
    return {"study": study.study_name, "storage": storage, "metric": space.get("metric", "value"),
            "direction": study.direction.name.lower(), "pruner": space.get("pruner", {}).get("name"),
            "trials": rows(study),
            "best": {"trial": best.number, "value": best.value, "params": best.params, "config": str(config)}
            if best else None,
            "plots": plots, **({"plots_skipped": skipped} if skipped else {})}
