"""SPACE.toml: which config keys a sweep varies and over what, what it optimises, how it samples and
prunes. Read and checked whole before any trial runs: a key the run config does not have (with a
did-you-mean), a range or a choice the key refuses, a table or an option that does not exist are
one ConfigError (exit 2) naming the file and the key.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ddp_cli.config import RunConfig, unknown_key
from ddp_cli.errors import ConfigError, did_you_mean
from ddp_cli.userfiles import parse_toml, read_text

TABLES = ("params", "objective", "sampler", "pruner")
METRICS = {"top1": "maximize", "top5": "maximize", "loss": "minimize"}  # each one's natural direction
DIRECTIONS = ("maximize", "minimize")
# each sampler's and pruner's options and their defaults (Optuna's names). asha: a reduction factor of 3,
# not Optuna's 4 (a sweep of tens of trials keeps a third at each rung), and its first rung at epoch
# 1 x 3^1 = 3, not 1: the first epoch is mostly warmup's, its accuracy says little of the last one's
SAMPLERS: dict[str, dict[str, Any]] = {"tpe": {"seed": 0, "n_startup_trials": 10},
                                       "random": {"seed": 0}, "grid": {"seed": 0}}
PRUNERS: dict[str, dict[str, Any]] = {
    "asha": {"min_resource": 1, "reduction_factor": 3, "min_early_stopping_rate": 1},
    "median": {"n_startup_trials": 5, "n_warmup_steps": 1},
    "none": {},
}
RANGE_FIELDS = ("low", "high", "step", "log")


@dataclass(frozen=True)
class Param:
    """One swept key: a range (`low`..`high`, by `step` or on a `log` scale) or a list of `choices`."""

    key: str
    low: float | None = None
    high: float | None = None
    step: float | None = None
    log: bool = False
    choices: tuple[Any, ...] = ()
    integer: bool = False

    def suggest(self, trial: Any) -> Any:
        """This key's value for an Optuna trial (an enqueued trial's fixed value, if it has one)."""
        if self.choices:
            return trial.suggest_categorical(self.key, list(self.choices))
        if self.integer:
            return trial.suggest_int(self.key, int(self.low), int(self.high), step=int(self.step or 1),
                                     log=self.log)
        value = trial.suggest_float(self.key, self.low, self.high, step=self.step, log=self.log)
        return round(value, 12) if self.step else value  # 0.85, not Optuna's 0.8500000000000001

    def grid(self) -> list[Any]:
        """Every value a grid search tries."""
        if self.choices:
            return list(self.choices)
        if self.step is None and not self.integer:
            raise ConfigError(f"[params] {self.key!r}: a grid needs choices or a step for a float range; "
                              "add step = ... or use the tpe or random sampler")
        step = self.step or 1
        count = math.floor((self.high - self.low) / step + 1e-9) + 1
        values = [self.low + i * step for i in range(count)]
        return [int(v) for v in values] if self.integer else [round(v, 12) for v in values]


@dataclass(frozen=True)
class Space:
    params: tuple[Param, ...]
    metric: str = "top1"
    direction: str = "maximize"
    sampler: dict[str, Any] = field(default_factory=lambda: {"name": "tpe", **SAMPLERS["tpe"]})
    pruner: dict[str, Any] = field(default_factory=lambda: {"name": "asha", **PRUNERS["asha"]})

    def as_dict(self) -> dict[str, Any]:
        """What a study keeps of its space (its user attributes), JSON."""
        return {"params": {p.key: describe(p) for p in self.params}, "metric": self.metric,
                "direction": self.direction, "sampler": self.sampler, "pruner": self.pruner}


def describe(param: Param) -> dict[str, Any]:
    """A param as SPACE.toml writes it."""
    if param.choices:
        return {"choices": list(param.choices)}
    spec = {"low": param.low, "high": param.high}
    return spec | ({"step": param.step} if param.step else {}) | ({"log": True} if param.log else {})


def load_space(path: Path, base: RunConfig) -> Space:
    """SPACE.toml read and checked against the run config `base` (the sweep's config with its --set)."""
    raw = parse_toml(read_text(path, ConfigError), str(path), ConfigError)
    where = str(path)
    for table in raw:
        if table not in TABLES:
            raise ConfigError(f"{where}: unknown table [{table}]{did_you_mean(table, TABLES)}")
    params = raw.get("params")
    if not isinstance(params, dict) or not params:
        raise ConfigError(f'{where}: [params] names no key; add e.g. "optim.lr_per_256" = '
                          "{ low = 0.05, high = 2.0, log = true }")
    metric, direction = objective(raw.get("objective", {}), where)
    return Space(
        params=tuple(checked_param(key, spec, base, where) for key, spec in flat_params(params)),
        metric=metric, direction=direction,
        sampler=named_options(raw.get("sampler", {}), SAMPLERS, "tpe", f"{where}: [sampler]"),
        pruner=named_options(raw.get("pruner", {}), PRUNERS, "asha", f"{where}: [pruner]"),
    )


def flat_params(params: dict[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    """(dotted key, spec) of [params], whether keys are quoted (`"optim.lr" = {...}`) or nested tables
    (`[params.optim] lr = {...}`): a spec is a table with a range's or choices' fields."""
    out = []
    for key, value in params.items():
        dotted = f"{prefix}{key}"
        is_spec = not isinstance(value, dict) or not value or set(value) & {*RANGE_FIELDS, "choices"}
        out += [(dotted, value)] if is_spec else flat_params(value, dotted + ".")
    return out


def checked_param(key: str, spec: Any, base: RunConfig, where: str) -> Param:
    label = f"{where}: [params] {key!r}"
    problem = unknown_key(key)
    if problem:
        raise ConfigError(f"{where}: [params] {problem}")
    if not isinstance(spec, dict):
        raise ConfigError(f"{label}: give a range {{ low = ..., high = ... }} or {{ choices = [...] }}, "
                          f"not {spec!r}")
    for name in spec:
        if name not in (*RANGE_FIELDS, "choices"):
            hint = did_you_mean(name, (*RANGE_FIELDS, "choices"))
            raise ConfigError(f"{label}: unknown field {name!r}{hint}")
    param = choices_param(key, spec, label) if "choices" in spec else range_param(key, spec, label)
    for value in param.choices or (param.low, param.high):
        refused(base, key, value, label)
    return param


def choices_param(key: str, spec: dict[str, Any], label: str) -> Param:
    choices = spec["choices"]
    if set(spec) != {"choices"}:
        raise ConfigError(f"{label}: choices stand alone; drop {sorted(set(spec) - {'choices'})}")
    if not isinstance(choices, list) or not choices:
        raise ConfigError(f"{label}: choices must be a non-empty list, e.g. choices = [0.0, 0.1]")
    for value in choices:
        if not isinstance(value, str | int | float | bool):
            raise ConfigError(f"{label}: choice {value!r} is not a number, a string or a boolean")
    return Param(key, choices=tuple(choices))


def range_param(key: str, spec: dict[str, Any], label: str) -> Param:
    if "low" not in spec or "high" not in spec:
        raise ConfigError(f"{label}: a range needs low and high (or give choices = [...])")
    low, high, step, log = spec["low"], spec["high"], spec.get("step"), spec.get("log", False)
    for name, value in (("low", low), ("high", high), ("step", step)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)):
            raise ConfigError(f"{label}: {name} = {value!r} is not a number")
    if not isinstance(log, bool):
        raise ConfigError(f"{label}: log = {log!r}: true or false")
    if not low < high:
        raise ConfigError(f"{label}: low ({low}) must be below high ({high})")
    if step is not None and step <= 0:
        raise ConfigError(f"{label}: step = {step} must be positive")
    if log and low <= 0:
        raise ConfigError(f"{label}: a log range needs low > 0 (low = {low})")
    if log and step is not None:
        raise ConfigError(f"{label}: a range is either log or stepped; drop one of log and step")
    integer = all(isinstance(v, int) for v in (low, high, step) if v is not None)
    return Param(key, low=low, high=high, step=step, log=log, integer=integer)


def refused(base: RunConfig, key: str, value: Any, label: str) -> None:
    """A ConfigError naming the key when the run config does not take `value` for it (its type, its
    bounds, its list of names); a range's two ends stand for the values between them."""
    try:
        base.resolved({key: value}, source=f"{label} = {value!r}")
    except ConfigError as e:
        raise ConfigError(f"{e}; the config refuses this value: change the space's range") from None


def objective(raw: Any, where: str) -> tuple[str, str]:
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: [objective] must be a table")
    for name in raw:
        if name not in ("metric", "direction"):
            hint = did_you_mean(name, ("metric", "direction"))
            raise ConfigError(f"{where}: [objective] unknown key {name!r}{hint}")
    metric = raw.get("metric", "top1")
    if metric not in METRICS:
        raise ConfigError(f"{where}: [objective] metric = {metric!r}: one of {', '.join(METRICS)} "
                          "(the best epoch's validation)")
    direction = raw.get("direction", METRICS[metric])
    if direction not in DIRECTIONS:
        raise ConfigError(f"{where}: [objective] direction = {direction!r}: maximize or minimize")
    return metric, direction


def named_options(raw: Any, kinds: dict[str, dict[str, Any]], default: str, label: str) -> dict[str, Any]:
    """A [sampler] or [pruner] table: its `name` and its options, each checked, defaults filled in."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{label} must be a table")
    name = raw.get("name", default)
    if name not in kinds:
        hint = did_you_mean(str(name), list(kinds))
        raise ConfigError(f"{label} name = {name!r}: one of {', '.join(kinds)}{hint}")
    options = dict(kinds[name])
    for key, value in raw.items():
        if key == "name":
            continue
        if key not in options:
            known = list(options) or ["no options"]
            raise ConfigError(f"{label} {name}: unknown option {key!r}{did_you_mean(key, known)}")
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ConfigError(f"{label} {key} = {value!r}: a whole number >= 0")
        options[key] = value
    if name == "asha" and options["reduction_factor"] < 2:
        raise ConfigError(f"{label} reduction_factor = {options['reduction_factor']}: at least 2")
    if name == "asha" and options["min_resource"] < 1:
        raise ConfigError(f"{label} min_resource = 0: at least 1 (epoch)")
    return {"name": name, **options}
