"""Files that survive a kill: atomic writes, fsync, sha256, and loads that run no pickled code.

The lowest layer: checkpoints, the job folder and manifests all write through
`atomic_write`, and every `torch.load` goes through `load_plain`.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from ddp_cli.errors import DataError

CHECKPOINT_FORMAT = 1  # the marker a ddp checkpoint carries as its "format" key


class HashingFile:
    """A write-only file that hashes and counts what passes through it (no second read of the file)."""

    def __init__(self, file: IO[bytes]) -> None:
        self.file, self.digest, self.size = file, hashlib.sha256(), 0

    def write(self, data: bytes) -> int:
        self.digest.update(data)
        self.size += len(data)
        return self.file.write(data)

    def flush(self) -> None:
        self.file.flush()


def atomic_write(path: Path, write: Callable[[IO[bytes]], Any]) -> tuple[str, int]:
    """Call `write(file)` on a temp file beside `path`, then rename it into place; (sha256, bytes).

    A kill at any instant leaves either the old file or the new one, never half of one.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            hashing = HashingFile(f)
            write(hashing)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
    return hashing.digest.hexdigest(), hashing.size


def write_text(path: Path, text: str) -> None:
    atomic_write(path, lambda f: f.write(text.encode()))


def fsync_dir(folder: Path) -> None:
    """Make renames in `folder` durable (a crash after this cannot undo them)."""
    dir_fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def load_plain(path: Path) -> Any:
    """Load with `weights_only=True`: tensors, numbers, strings and containers, nothing else.

    torch is imported here, not at the top: the index build reads and writes files through this
    module in a process that must not import torch (`index_build.IndexBuild`)."""
    import torch

    try:
        with warnings.catch_warnings():  # an altered byte reads as an odd pickle protocol: the error says it
            warnings.filterwarnings("ignore", message="Detected pickle protocol")
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise DataError(f"{path}: refused, it holds more than plain data (weights_only load): "
                        f"{_first_line(e)}") from e
    except Exception as e:  # a cut-short or altered file trips torch's zip reader or unpickler anywhere
        raise DataError(f"{path}: unreadable or truncated checkpoint ({_first_line(e)})") from e


def _first_line(e: Exception) -> str:
    """The first line of `e`'s message, or its class where it has none (an empty file: EOFError())."""
    return next(iter(str(e).splitlines()), type(e).__name__)


def is_checkpoint(state: Any) -> bool:
    return isinstance(state, dict) and state.get("format") == CHECKPOINT_FORMAT
