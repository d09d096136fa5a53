"""`ddp init DIR`: a starter run config and data.toml, so a wheel user (no checkout) can train.

The files ship inside the package (`ddp_cli/templates/`, the checkout's configs/demo.toml and
data.toml, kept identical by a test). The registry's demo path is relative, and relative paths
resolve against the registry's own folder, so the demo is built under DIR on first use.
"""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path
from typing import Any

from ddp_cli.errors import ConfigError
from ddp_cli.io import write_error

TEMPLATES = ("demo.toml", "data.toml")


def write_starter(folder: Path) -> dict[str, Any]:
    """Write the templates into `folder` (made if missing); never overwrite a file there."""
    folder = Path(folder).expanduser().resolve()
    targets = [folder / name for name in TEMPLATES]
    for target in targets:  # all checked before any is written: a refusal leaves nothing behind
        if target.exists():
            raise exists(target)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        for target in targets:
            with target.open("x") as out:  # "x": not even a file that appeared since the check
                out.write(template(target.name))
    except FileExistsError as e:  # DIR is a file, or a file appeared meanwhile
        raise exists(Path(e.filename)) from e
    except OSError as e:  # a refused write (read-only, no permission, disk full) is exit 6, as anywhere
        raise write_error(e, e.filename or folder) or ConfigError(
            f"{e.filename or folder}: cannot write there ({e.strerror}); choose another folder") from e
    return {"dir": str(folder), "files": [str(t) for t in targets]}


def exists(path: Path) -> ConfigError:
    return ConfigError(f"{path}: already exists; ddp init never overwrites a file "
                       "(move it away or choose another folder)")


def template(name: str) -> str:
    """The text of a shipped template (from the installed package, wheel or checkout)."""
    return (files("ddp_cli") / "templates" / name).read_text()
