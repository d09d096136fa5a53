"""A model of the user's own: `model.name = "package.module:factory"` or `"path/to/file.py:factory"`.

`locate` runs when the run config is read (it knows the config's folder):
a file is made absolute and hashed, a module's folder found (the config's
folder, else the working directory) by path alone, nothing imported. Both go
into the resolved config (`model.name`, `model.source`), so every process
that builds the model (the launcher's meta-device check, forked or spawned
workers on any node, `validate`, `predict` and `export` from a checkpoint
whose config holds them) imports it from the same place, through `factory`.
An import that fails or a factory that raises is a ConfigError (exit 2)
naming it and the first line of its error.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.machinery
import importlib.util
import inspect
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ddp_cli.config import RunConfig
from ddp_cli.config.model_names import is_user_model
from ddp_cli.config.model_names import parse_reference as parse
from ddp_cli.errors import ConfigError, did_you_mean
from ddp_cli.io import sha256_of
from ddp_cli.userfiles import user_path


def locate(name: str, folder: Path) -> tuple[str, dict[str, str | None]]:
    """`model.name` and `model.source` resolved for the run config in `folder`: a file made absolute with
    its sha256 (its folder the import root, as for a script); a module's root is `folder` or the working
    directory, whichever holds its top package (None: found on sys.path as it is)."""
    ref = parse(name)
    if ref.is_file:
        path = (folder / user_path(ref.target, "model.name")).resolve()
        if not path.is_file():
            raise ConfigError(f"model.name: {path}: no such file (a path is relative to the run config's "
                              f"folder, {folder.resolve()})")
        return f"{path}:{ref.factory}", {"root": str(path.parent), "sha256": sha256_of(path)}
    top = ref.target.split(".")[0]
    for root in (folder.resolve(), Path.cwd().resolve()):
        if importlib.machinery.PathFinder.find_spec(top, [str(root)]) is not None:
            return name, {"root": str(root), "sha256": None}
    return name, {"root": None, "sha256": None}


def with_located_model(cfg: RunConfig, config: Path) -> RunConfig:
    """`cfg`, read from the file `config`, with a model of the user's own located from that file's folder
    (`locate`): every process that builds it later, wherever it starts, imports it from there, and
    validate, predict and export know the file's sha256. Any other model: `cfg` as it is."""
    if not is_user_model(cfg.model.name):
        return cfg
    try:
        name, source = locate(cfg.model.name, Path(config).parent)
    except ConfigError as e:  # the model's file: named with the config that names it
        raise ConfigError(f"{config}: {e}") from e
    return cfg.resolved({"model.name": name, "model.source": source})


def changed(name: str, sha256: str | None) -> str | None:
    """A warning when `name`'s file is no longer the one hashed as `sha256` (the run's), else None."""
    if not (sha256 and is_user_model(name)):
        return None
    ref = parse(name)
    if not (ref.is_file and Path(ref.target).is_file()):
        return None
    now = sha256_of(Path(ref.target))
    if now == sha256:
        return None
    return (f"model.name: {ref.target} changed since the run was checked (sha256 {sha256} then, {now} now); "
            "the model built from it may not be the one that was trained")


def factory(name: str, root: str | None) -> Callable[..., Any]:
    """The callable `name` refers to, its module imported with `root` first on sys.path."""
    ref = parse(name)
    if root and root not in sys.path:
        sys.path.insert(0, root)
    module = import_file(Path(ref.target)) if ref.is_file else import_module(ref.target)
    found: Any = module
    for part in ref.factory.split("."):
        if not hasattr(found, part):
            names = [n for n in vars(module) if not n.startswith("_")]
            raise ConfigError(f"model.name: {ref.target} has no {ref.factory!r}"
                              f"{did_you_mean(part, names)}; name a function or class it defines")
        found = getattr(found, part)
    if not callable(found):
        raise ConfigError(f"model.name: {name} is a {type(found).__name__}, not a callable returning a model")
    return found


def import_module(target: str) -> Any:
    try:
        return importlib.import_module(target)
    except Exception as e:  # the user's code: anything it raises on import
        raise ConfigError(f"model.name: cannot import {target} ({describe(e)}); put it beside the run "
                          "config, in the working directory or on PYTHONPATH") from e


def import_file(path: Path) -> Any:
    """The module of the file at `path`, executed once per process (kept in sys.modules under a name of
    its own, so its classes have a module tracing and pickling can find)."""
    key = f"ddp_model_file_{hashlib.sha1(str(path).encode()).hexdigest()[:8]}_{path.stem}"
    if key in sys.modules:
        return sys.modules[key]
    spec = importlib.util.spec_from_file_location(key, path)
    if spec is None or spec.loader is None or not path.is_file():
        raise ConfigError(f"model.name: {path}: no such file; restore it or point model.name elsewhere")
    module = importlib.util.module_from_spec(spec)
    sys.modules[key] = module
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        del sys.modules[key]
        raise ConfigError(f"model.name: cannot import {path} ({describe(e)}); fix the file") from e
    return module


def call(name: str, make: Callable[..., Any], num_classes: int, kwargs: dict[str, Any]) -> Any:
    """`make(num_classes=..., **kwargs)` (num_classes only where it takes it); what it raises is a
    ConfigError naming it and its first line."""
    takes = accepted(make)
    if "num_classes" in kwargs:
        raise ConfigError("model.kwargs: num_classes is set by ddp (the data set's class count); remove it")
    unknown = [key for key in kwargs if takes is not None and key not in takes]
    if unknown:
        raise ConfigError(f"model.kwargs: {name} takes no keyword {unknown[0]!r}; it takes "
                          f"{', '.join(k for k in takes or [] if k != 'num_classes') or 'none'}")
    extra = {"num_classes": num_classes} if takes is None or "num_classes" in takes else {}
    try:
        return make(**extra, **kwargs)
    except Exception as e:
        raise ConfigError(f"model.name: {name} raised {describe(e)}; fix the factory or model.kwargs") from e


def accepted(make: Callable[..., Any]) -> list[str] | None:
    """The keyword names `make` takes; None when it takes any (**kwargs) or its signature is unknown."""
    try:
        params = inspect.signature(make).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return [p.name for p in params if p.kind in named]


def describe(error: BaseException) -> str:
    """An exception as its type and first line: what a one-line error can carry of the user's code."""
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__
