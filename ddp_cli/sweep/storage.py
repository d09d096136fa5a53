"""Where a study lives: an Optuna RDB storage (SQLite in the sweep dir by default, or any URL Optuna
takes: PostgreSQL, MySQL), opened with heartbeats so that a trial whose sweep process died is found,
marked failed and queued again with the same parameters.
"""

from __future__ import annotations

import random
import time
import warnings
from collections.abc import Callable
from typing import Any

from ddp_cli.errors import ALSO_IN, ConfigError, DataError, require_extra, require_module

HEARTBEAT_S = 10  # a running trial's sweep process says it is alive this often
GRACE_S = 60  # ... and a trial silent for longer is stale: failed, and run again
RETRIES = 3  # how often one set of parameters is run again after its trial was cut
DRIVERS = {"postgresql": ALSO_IN["sweep"][0], "postgres": ALSO_IN["sweep"][0]}  # (module, package) by scheme


def masked(url: str) -> str:
    """`url` with any password replaced by ***: what is printed and written down."""
    try:
        from sqlalchemy.engine import make_url

        return make_url(url).render_as_string(hide_password=True)
    except Exception:  # not a URL at all: open_storage says so
        return url


def open_storage(url: str, heartbeat: bool = True) -> Any:
    """The `optuna.storages.RDBStorage` at `url`; a missing extra or driver is exit 2, a storage that
    cannot be reached exit 3, each one line naming the (masked) URL."""
    require_extra("sweep", "ddp sweep")
    scheme = url.split(":", 1)[0].split("+", 1)[0]
    if scheme in DRIVERS and "+" not in url.split(":", 1)[0]:
        require_module(*DRIVERS[scheme], "sweep", f"--storage {masked(url)}")
    import optuna
    from sqlalchemy.exc import ArgumentError, NoSuchModuleError

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    warnings.filterwarnings("ignore", "Heartbeat of storage")  # ddp sweeps beat themselves (study.py)
    engine = {"connect_args": {"timeout": 60}} if scheme == "sqlite" else {"pool_pre_ping": True}
    beats = {"heartbeat_interval": HEARTBEAT_S, "grace_period": GRACE_S,
             "heartbeat_stale_trial_callback": requeue} \
        if heartbeat else {}
    try:
        return first_to_make_the_schema(
            lambda: optuna.storages.RDBStorage(url, engine_kwargs=engine, **beats))
    except (ArgumentError, NoSuchModuleError, ValueError) as e:
        raise ConfigError(f"--storage {masked(url)}: not a storage URL Optuna takes ({e}); e.g. "
                          "sqlite:///sweep.db or postgresql://user:password@host/db") from None
    except Exception as e:
        raise DataError(f"--storage {masked(url)}: cannot open the study storage: "
                        f"{type(e).__name__}: {str(e).splitlines()[0]}") from None


def first_to_make_the_schema(opening: Callable[[], Any], tries: int = 5) -> Any:
    """`opening()`, again after a moment when it lost the race to make a new database's tables to another
    sweep process starting at the same time (PostgreSQL says IntegrityError); then the tables are there."""
    from sqlalchemy.exc import IntegrityError, ProgrammingError

    for _ in range(tries - 1):
        try:
            return opening()
        except (IntegrityError, ProgrammingError):
            time.sleep(0.5 + random.random())
    return opening()


def requeue(study: Any, trial: Any) -> None:
    """A cut trial run again: queued with its parameters, RETRIES times at most for one set of them.
    (The study's storage calls it for a trial silent past its grace period.)"""
    retries = trial.user_attrs.get("ddp_retries", 0)
    if retries < RETRIES:
        study.enqueue_trial(trial.params,
                            user_attrs={"ddp_retry_of": trial.number, "ddp_retries": retries + 1})


def cut_trials(trials: list[Any]) -> set[int]:
    """The numbers of the trials that were cut and queued again (`requeue`)."""
    return {t.user_attrs["ddp_retry_of"] for t in trials if "ddp_retry_of" in t.user_attrs}
