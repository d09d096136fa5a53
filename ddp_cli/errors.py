"""The error hierarchy: every known failure carries the exit code of CLI.md.

One mapping in one place: the CLI turns a `DdpError` into one line on stderr
and its `exit_code`; anything else is a bug (exit 1).
"""

from __future__ import annotations

import importlib.util
import re

OK = 0
INTERNAL = 1
USAGE = 2
DATA = 3
DIVERGED = 4
PEER_LOST = 5
WRITE = 6
SIGINT = 130
SIGTERM = 143


class DdpError(Exception):
    """A failure the user can act on; `str(err)` is the one-line message."""

    exit_code = INTERNAL

    def __init__(self, message: str, exit_code: int | None = None) -> None:
        super().__init__(one_line(message))
        if exit_code is not None:
            self.exit_code = exit_code


class ConfigError(DdpError):
    """Bad flag, TOML syntax, schema violation, unknown dataset or model."""

    exit_code = USAGE


class DataError(DdpError):
    """Missing root or split, unreadable image, missing or refused credentials."""

    exit_code = DATA


class DivergedError(DdpError):
    """Non-finite loss; the last good checkpoint is kept."""

    exit_code = DIVERGED


class PeerLost(DdpError):
    """A rank or node was lost (its process or connection gone) or stopped answering (timed out)."""

    exit_code = PEER_LOST


class WriteError(DdpError):
    """The storage refused a write: no space, over quota, read-only, no permission, an I/O error."""

    exit_code = WRITE


class WorkerFailed(DdpError):
    """A worker exited with this code; it already printed its own message (may be empty)."""


def one_line(message: str) -> str:
    """`message` with control characters written as escapes (`\\n`, `\\x1b`): a key, a path or a value
    quoted from a user's file stays on the message's one line and cannot drive the terminal."""
    return re.sub(r"[\x00-\x08\x0a-\x1f\x7f]", lambda m: repr(m.group())[1:-1], message)


LINE_MAX = 250  # an internal error's summary: the whole message, with where to read more, stays < 500


def summary(e: BaseException) -> str:
    """`Type: first line` of an unexpected error, cut to LINE_MAX characters: its traceback belongs in a
    log, not on the console. For an error a DataLoader raised again from a loader process (its message
    pastes the loader's whole traceback), the loader's own last line and the process it came from."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    if len(lines) > 2 and lines[1].startswith("Original Traceback"):
        where = re.search(r" in (.+?)\.?$", lines[0])
        text = lines[-1] + (f" (in {where.group(1)})" if where else "")
    else:
        text = f"{type(e).__name__}: {lines[0]}" if lines else type(e).__name__
    return text if len(text) <= LINE_MAX else text[:LINE_MAX - 3] + "..."


def did_you_mean(word: str, known: list[str] | tuple[str, ...]) -> str:
    """A ' (did you mean x?)' hint, or the known names when nothing is close."""
    import difflib

    close = difflib.get_close_matches(word, list(known), n=3, cutoff=0.6)
    if close:
        return f" (did you mean {', '.join(repr(c) for c in close)}?)"
    names = ", ".join(sorted(known)[:12]) + (", ..." if len(known) > 12 else "")
    return f" (known: {names})"


DISTRIBUTION = "ddp-cli"  # pyproject's [project] name: what `pip install` takes
# Each optional feature's extra (pyproject's [project.optional-dependencies]): the module it
# imports and the package that provides it.
EXTRAS: dict[str, tuple[str, str]] = {
    "s3": ("s3fs", "s3fs"),
    "tensorboard": ("tensorboard", "tensorboard"),
    "wandb": ("wandb", "wandb"),
    "report": ("matplotlib", "matplotlib"),
    "export": ("onnxscript", "onnxscript"),  # torch.onnx's exporter; it brings onnx
    "safetensors": ("safetensors", "safetensors"),
    "timm": ("timm", "timm"),
    "parquet": ("pyarrow", "pyarrow"),
    "sweep": ("optuna", "optuna"),
    "mlflow": ("mlflow", "mlflow"),
}
# The modules an extra brings beside its main one (`require_module` checks each where it is needed): the
# PostgreSQL driver of ddp sweep's storages (psycopg 3, SQLAlchemy 2.1's default for postgresql://)
ALSO_IN: dict[str, tuple[tuple[str, str], ...]] = {"sweep": (("psycopg", "psycopg"),)}


def require_extra(extra: str, what: str, otherwise: str = "") -> None:
    """Refuse `what` (exit 2, one line naming the install) when the package of `extra` is missing.

    The core install leaves out what only one feature needs; without this check the feature
    would fail deep inside as an ImportError, reported as a bug.
    """
    require_module(*EXTRAS[extra], extra, what, otherwise)


def require_module(module: str, package: str, extra: str, what: str, otherwise: str = "") -> None:
    """`require_extra` for a module of an extra beside its main one (the sweep's PostgreSQL driver)."""
    if importlib.util.find_spec(module) is None:
        alternative = f" or {otherwise}" if otherwise else ""
        raise ConfigError(f"{what}: the {package} package is not installed; "
                          f"pip install '{DISTRIBUTION}[{extra}]'{alternative}")
