"""Checkpoints: plain data only, written atomically, loaded without running pickled code.

A kill at any instant leaves either the old file or the new one, never half of
one: write a temp file in the same folder, fsync it, rename over the target,
fsync the folder. Each checkpoint has a sidecar manifest (`<name>.json`: sha256,
size, epoch, step) so that a truncated or altered file is recognised on load
and `--resume auto` can fall back to the previous one.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from ddp_cli.errors import ConfigError, DataError
from ddp_cli.io import CHECKPOINT_FORMAT, atomic_write, fsync_dir, is_checkpoint, load_plain, sha256_of

log = logging.getLogger("ddp")


def save_checkpoint(state: dict[str, Any], path: Path) -> None:
    atomic_write(path, lambda f: torch.save({"format": CHECKPOINT_FORMAT, **state}, f))


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """A ddp checkpoint, loaded safely (see `load_plain`)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"--checkpoint {path}: no such file; give a .pt from <run>/checkpoints/")
    problem = verify(path) if manifest_path(path).exists() else None
    if problem:
        raise DataError(f"{path}: {problem}; use another checkpoint (--resume auto picks a valid one)")
    state = load_plain(path)
    if not is_checkpoint(state):
        raise DataError(f"{path}: not a ddp checkpoint (no format {CHECKPOINT_FORMAT} marker)")
    return state


MANIFEST = ".json"  # sidecar: <checkpoint>.json with sha256, size and position


def write_manifest(path: Path, info: dict[str, Any]) -> None:
    manifest = {"file": path.name, "sha256": sha256_of(path), "bytes": path.stat().st_size, **info}
    atomic_write(manifest_path(path), lambda f: f.write(json.dumps(manifest).encode()))


def manifest_path(path: Path) -> Path:
    return path.with_name(path.name + MANIFEST)


def read_manifest(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(manifest_path(path).read_text())
    except (OSError, ValueError):
        return None


def verify(path: Path) -> str | None:
    """Why `path` cannot be trusted (missing, partial, altered), or None if its manifest matches."""
    manifest = read_manifest(path)
    if manifest is None:
        return "no manifest (partial write?)"
    if not path.is_file() or path.stat().st_size != manifest["bytes"]:
        return "size differs from its manifest (truncated?)"
    if sha256_of(path) != manifest["sha256"]:
        return "sha256 differs from its manifest (corrupt)"
    return None


class CheckpointStore:
    """`checkpoints/`: step-NNNNNNNNN.pt files (the last `keep_last` kept), last.pt and best.pt.

    Every save is a new step file plus its manifest; last.pt and best.pt are then
    hard links to it (a copy where links are not supported), each with its own
    manifest. A kill at any point leaves at least the previous checkpoint valid.
    """

    def __init__(self, folder: Path, keep_last: int) -> None:
        self.folder, self.keep_last = folder, keep_last

    def save(self, state: dict[str, Any], info: dict[str, Any], best: bool) -> Path:
        path = self.folder / f"step-{info['step']:09d}.pt"
        save_checkpoint(state, path)
        write_manifest(path, info)
        for alias in ("last.pt", "best.pt") if best else ("last.pt",):
            self._alias(path, self.folder / alias, info)
        self._prune()
        return path

    def _alias(self, source: Path, alias: Path, info: dict[str, Any]) -> None:
        tmp = alias.with_name(f".{alias.name}.{os.getpid()}.link")
        tmp.unlink(missing_ok=True)
        try:
            os.link(source, tmp)
        except OSError:
            shutil.copyfile(source, tmp)
        os.replace(tmp, alias)
        fsync_dir(self.folder)
        write_manifest(alias, info)

    def _prune(self) -> None:
        for old in self.steps()[: -self.keep_last]:
            old.unlink(missing_ok=True)
            manifest_path(old).unlink(missing_ok=True)

    def steps(self) -> list[Path]:
        return sorted(self.folder.glob("step-*.pt"))

    def latest_valid(self) -> Path | None:
        """The newest checkpoint whose manifest checks out; corrupt or partial ones are skipped."""
        candidates = [p for p in [*self.steps(), self.folder / "last.pt"] if p.exists()]
        ordered = sorted(candidates, key=lambda p: (read_manifest(p) or {}).get("step", -1),
                         reverse=True)
        for path in ordered:
            problem = verify(path)
            if problem is None:
                return path
            log.warning("skipping checkpoint %s: %s", path, problem)
        return None
