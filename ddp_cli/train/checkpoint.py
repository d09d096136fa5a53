"""Checkpoints: plain data only, written atomically, loaded without running pickled code.

A kill at any instant leaves either the old file or the new one, never half of
one: write a temp file in the same folder, fsync it, rename over the target,
fsync the folder.
"""

from __future__ import annotations

import os
import pickle
import tempfile
from pathlib import Path
from typing import Any

import torch

from ddp_cli.errors import ConfigError, DataError

FORMAT = 1


def atomic_write(path: Path, write: callable) -> None:
    """Call `write(file)` on a temp file beside `path`, then rename it into place."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def save_checkpoint(state: dict[str, Any], path: Path) -> None:
    atomic_write(path, lambda f: torch.save({"format": FORMAT, **state}, f))


def load_plain(path: Path) -> Any:
    """Load with `weights_only=True`: tensors, numbers, strings and containers, nothing else."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise DataError(f"{path}: refused, it holds more than plain data (weights_only load): "
                        f"{str(e).splitlines()[0]}") from e
    except (RuntimeError, EOFError, OSError, ValueError) as e:
        raise DataError(f"{path}: unreadable or truncated checkpoint ({str(e).splitlines()[0]})") from e


def is_checkpoint(state: Any) -> bool:
    return isinstance(state, dict) and state.get("format") == FORMAT


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """A ddp checkpoint, loaded safely (see `load_plain`)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"--checkpoint {path}: no such file; give a .pt from <run>/checkpoints/")
    state = load_plain(path)
    if not is_checkpoint(state):
        raise DataError(f"{path}: not a ddp checkpoint (no format {FORMAT} marker)")
    return state
