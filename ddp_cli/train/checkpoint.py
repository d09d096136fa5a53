"""Checkpoints: what goes into one and when (`Checkpointer`), and where they live (`CheckpointStore`).

Plain data only, written atomically (ddp_cli.io), loaded without running
pickled code. Each checkpoint has a sidecar manifest (`<name>.json`: sha256,
size, epoch, step) so that a truncated or altered file is recognised on load
and `--resume auto` can fall back to the previous one.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist

from ddp_cli.config import config_from_dict
from ddp_cli.config.trained_before import as_trained
from ddp_cli.distributed.signals import StopRequest
from ddp_cli.errors import ConfigError, DataError, DdpError, WriteError
from ddp_cli.io import (
    CHECKPOINT_FORMAT,
    atomic_write,
    fsync_dir,
    is_checkpoint,
    load_plain,
    sha256_of,
    writing,
)
from ddp_cli.train import rng

log = logging.getLogger("ddp")


FORMAT_VERSION = 3  # what a checkpoint holds, as `migrate` reads it; "format" only marks a ddp file


def save_checkpoint(state: dict[str, Any], path: Path) -> tuple[str, int]:
    """Write atomically; the file's (sha256, bytes), hashed on the way out."""
    marks = {"format": CHECKPOINT_FORMAT, "format_version": FORMAT_VERSION}
    return atomic_write(path, lambda f: torch.save({**marks, **state}, f), needed=tensor_bytes(state))


def tensor_bytes(state: Any) -> int:
    """The bytes of every tensor in `state`: about what its checkpoint takes on disk (a full disk's
    message says how much was needed)."""
    if isinstance(state, torch.Tensor):
        return state.nelement() * state.element_size()
    if isinstance(state, dict):
        return sum(tensor_bytes(value) for value in state.values())
    if isinstance(state, list | tuple):
        return sum(tensor_bytes(value) for value in state)
    return 0


def format_version(state: dict[str, Any]) -> int:
    """The version `state` was written in: its own, else (written before versions were) read off the
    fields it holds, each added in the version named."""
    if "format_version" in state:
        return state["format_version"]
    if "descriptions" in state or "epoch_layout" in state:
        return 3
    if "world_sizes" in state:
        return 2
    return 1 if "global_batch" in state else 0


def migrate(state: dict[str, Any], path: str | Path = "checkpoint") -> dict[str, Any]:
    """`state` in the current format, whatever version wrote it: one step per version, oldest first.

    Every step derives its fields from what an older file holds, and only where it holds them (a
    file with no training state, say, keeps none), so everything after loading reads one format.
    """
    version = format_version(state)
    if version > FORMAT_VERSION:
        raise DataError(f"{path}: written by a newer ddp (checkpoint format {version}; this one reads up "
                        f"to {FORMAT_VERSION}); upgrade ddp")
    state = dict(state)
    trained = "rng" in state  # a training state, not a bare set of weights
    world = len(state["rng"]) if trained else 1  # one RNG state per rank of the world that wrote it
    if version < 1 and trained and "config" in state:  # 0 -> 1: the global batch, the epoch's position
        state["global_batch"] = config_from_dict(state["config"], str(path)).global_batch(world)
        state["samples_in_epoch"] = state.get("step_in_epoch", 0) * state["global_batch"]
    if version < 2 and trained:  # 1 -> 2: every rank's running loss, and the world size of each segment
        running = state.get("running") or []  # the writer's (sum, steps), which every rank resumed from
        state["running"] = [list(running) for _ in range(world)] if running else []
        state["world_sizes"] = [world]
    if version < 3 and "classes" in state:  # 2 -> 3: class descriptions (the synsets where none were)
        state["descriptions"] = list(state["classes"])
    if trained and isinstance(state.get("config"), dict):  # keys added since: what the run trained with
        state["config"] = as_trained(state["config"])
    state["format_version"] = FORMAT_VERSION
    return state


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """A ddp checkpoint, loaded safely (see `load_plain`), in the current format (`migrate`)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"--checkpoint {path}: no such file; give a .pt from <run>/checkpoints/")
    problem = verify(path) if manifest_path(path).exists() else None
    if problem:
        raise DataError(f"{path}: {problem}; use another checkpoint (--resume auto picks a valid one)")
    state = load_plain(path)
    if not is_checkpoint(state):
        raise DataError(f"{path}: not a ddp checkpoint (no format {CHECKPOINT_FORMAT} marker)")
    wrong = next((k for k, kinds in FIELDS.items()
                  if k in state and (not isinstance(state[k], kinds) or isinstance(state[k], bool))), None)
    if wrong is not None:
        raise not_ours(path, f"{wrong} is a {type(state[wrong]).__name__}")
    state = migrate(state, path)
    if not sums_per_rank(state.get("running", [])):
        raise not_ours(path, "running is not a row of sums per rank, all of one width")
    return state


def not_ours(path: Path, why: str) -> DataError:
    return DataError(f"{path}: not a ddp checkpoint ({why}); use another checkpoint (--resume auto picks a "
                     "valid one)")


def sums_per_rank(running: list) -> bool:
    """`running` as ddp writes it (a rank's running sums, every rank's gathered: rows of one width)."""
    def number(v: Any) -> bool:
        return isinstance(v, int | float) and not isinstance(v, bool)

    return all(isinstance(row, list) and len(row) == len(running[0]) and all(map(number, row))
               for row in running)


# the types of the fields that loading and migrating read, where a checkpoint holds them (none is a bool)
FIELDS: dict[str, tuple[type, ...]] = {
    "format_version": (int,), "classes": (list,), "descriptions": (list,),
    "model": (dict, type(None)), "ema": (dict, type(None)), "final": (dict, type(None)),
    "final_ema": (dict, type(None)), "dataset": (dict, type(None)), "rng": (list, dict), "running": (list,),
    "global_batch": (int,), "step_in_epoch": (int,),
}


MANIFEST = ".json"  # sidecar: <checkpoint>.json with sha256, size and position


def write_manifest(path: Path, info: dict[str, Any], written: tuple[str, int] | None = None) -> None:
    """`<path>.json`; `written` is the (sha256, bytes) known from writing, else the file is read."""
    sha256, size = written or (sha256_of(path), path.stat().st_size)
    manifest = {"file": path.name, "sha256": sha256, "bytes": size, **info}
    atomic_write(manifest_path(path), lambda f: f.write(json.dumps(manifest).encode()))


def manifest_path(path: Path) -> Path:
    return path.with_name(path.name + MANIFEST)


def read_manifest(path: Path) -> dict[str, Any] | None:
    """`path`'s manifest, or None when there is none or it is not one (cut short, altered, another
    file's): a checkpoint without a manifest that checks out is never trusted."""
    try:
        manifest = json.loads(manifest_path(path).read_text())
    except (OSError, ValueError, RecursionError):
        return None
    if (isinstance(manifest, dict) and type(manifest.get("sha256")) is str
            and type(manifest.get("bytes")) is int and type(manifest.get("step", 0)) is int):
        return manifest
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


class Mirror(Protocol):
    """Where a store's checkpoints are repeated once final (a run dir in a bucket: run.mirror)."""

    url: str  # the run dir there: what a resume names
    def saved(self, path: Path, aliases: list[Path]) -> None: ...
    def removed(self, path: Path) -> None: ...
    def raise_if_failed(self) -> None: ...
    def close(self) -> None: ...


class CheckpointStore:
    """`checkpoints/`: step-NNNNNNNNN.pt files (the last `keep_last` kept), last.pt and best.pt.

    Every save is a new step file plus its manifest; last.pt and best.pt are then
    hard links to it (a copy where links are not supported), each with its own
    manifest. A kill at any point leaves at least the previous checkpoint valid.
    A `mirror` is told of each checkpoint once final, and of each one pruned.
    """

    def __init__(self, folder: Path, keep_last: int, mirror: Mirror | None = None) -> None:
        self.folder, self.keep_last, self.mirror = folder, keep_last, mirror

    def run_dir(self) -> str:
        """The run dir a resume names: the bucket's for a mirrored one (the folder is only staging)."""
        return self.mirror.url if self.mirror else str(self.folder.parent)

    def path_for(self, step: int) -> Path:
        return self.folder / f"step-{step:09d}.pt"

    def save(self, state: dict[str, Any], info: dict[str, Any], best: bool) -> Path:
        path = self.path_for(info["step"])
        written = save_checkpoint(state, path)
        try:
            write_manifest(path, info, written)
        except WriteError:
            path.unlink(missing_ok=True)  # without its manifest it is no checkpoint, only lost space
            raise
        aliases = [self.folder / alias for alias in (("last.pt", "best.pt") if best else ("last.pt",))]
        for alias in aliases:
            self._alias(path, alias, info, written)
        if self.mirror:
            self.mirror.saved(path, aliases)
        self._prune()
        return path

    def _alias(self, source: Path, alias: Path, info: dict[str, Any], written: tuple[str, int]) -> None:
        tmp = alias.with_name(f".{alias.name}.{os.getpid()}.link")
        with writing(alias, written[1]):
            tmp.unlink(missing_ok=True)
            try:
                try:
                    os.link(source, tmp)
                except OSError:
                    shutil.copyfile(source, tmp)
                os.replace(tmp, alias)
            except BaseException:
                tmp.unlink(missing_ok=True)  # a partial copy: lost space
                raise
            fsync_dir(self.folder)
        write_manifest(alias, info, written)

    def _prune(self) -> None:
        for old in self.steps()[: -self.keep_last]:
            old.unlink(missing_ok=True)
            manifest_path(old).unlink(missing_ok=True)
            if self.mirror:
                self.mirror.removed(old)

    def steps(self) -> list[Path]:
        return sorted(self.folder.glob("step-*.pt"))

    def refused(self, error: WriteError) -> WriteError:
        """`error` (a write the storage refused during the run) with the checkpoint to resume from: the
        last one written whole, which a refused write never replaces."""
        run = self.run_dir()
        try:
            latest = self.latest_valid()
        except OSError:  # a failing device may refuse reading them back too
            return WriteError(f"{error}; the checkpoints in {self.folder} could not be read back")
        resume = (f"the last good checkpoint is {latest}; make room and rerun with --run-dir {run} "
                  f"--resume auto, or copy {run} to a roomier disk and resume there"
                  if latest else "no checkpoint was written yet; make room and rerun")
        return WriteError(f"{error}; {resume}")

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


class Stateful(Protocol):
    def state_dict(self) -> Any: ...
    def load_state_dict(self, state: Any) -> None: ...


@dataclass
class RunState:
    """Where the run stands: every field is saved (flat, at a checkpoint's top level) and restored."""

    epoch: int = 0  # epochs completed
    step: int = 0  # optimisation steps completed, all epochs
    step_in_epoch: int = 0  # of the epoch under way (0 at an epoch boundary)
    samples_in_epoch: int = 0  # positions of this epoch's order consumed, all ranks
    epoch_layout: int = 0  # the sampler chunk (ranks x batch) the epoch's order is laid out for
    global_batch: int = 0  # images per optimisation step when this state was reached
    running: list[list[float]] = field(default_factory=list)  # per rank: loss sum, steps, the objective's
    # the objective's state (objectives.py), saved here at every checkpoint and handed back on resume:
    unlabelled_epoch: int = 0  # semi.method on: the unlabelled stream's pass under way
    unlabelled_seen: int = 0  # and its positions consumed, all ranks (semi.py)
    # freematch, softmatch: their running statistics (adaptive.py), global: the same on every rank
    semi_statistics: dict[str, list[float]] = field(default_factory=dict)
    best_top1: float = -1.0
    history: list[dict[str, Any]] = field(default_factory=list)
    final: dict[str, float] = field(default_factory=dict)
    final_ema: dict[str, float] | None = None  # the EMA weights' validation, when on
    skipped_files: list[str] = field(default_factory=list)  # bad files replaced under "skip"
    world_sizes: list[int] = field(default_factory=list)  # of each segment: the start, every resume
    io_retries: int = 0  # transient storage errors retried, all ranks and their loader processes

    def state_dict(self) -> dict[str, Any]:
        return asdict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Every field the checkpoint has; fields added since it was written keep their defaults."""
        for f in fields(self):
            if f.name in state:
                setattr(self, f.name, state[f.name])

    def running_of(self, rank: int, world_size: int, width: int = 2) -> list[float]:
        """Rank `rank`'s share of the epoch's running sums (loss, steps, the objective's: `width` in all):
        its own at the same world size; at another, all of it on rank 0 (the epoch's are their sums)."""
        if len(self.running) == world_size:
            return self.running[rank]
        if rank == 0 and self.running:
            return [sum(column) for column in zip(*self.running, strict=True)]
        return [0.0] * width

    def position(self) -> dict[str, Any]:
        """The scalar fields: what a manifest and a log line say about a checkpoint."""
        return {k: v for k, v in self.state_dict().items() if isinstance(v, int | float)}


class RankRngs:
    """Every rank's generators: gathered for the writer on save, each rank's own restored on load.

    Another world size cannot replay the same draws, so its states are left alone.
    """

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size

    def state_dict(self) -> list[dict[str, Any] | None]:
        states: list[dict[str, Any] | None] = [None] * self.world_size
        dist.all_gather_object(states, rng.capture())
        return states

    def load_state_dict(self, states: list[dict[str, Any]]) -> None:
        if len(states) == self.world_size:
            rng.restore(states[self.rank])


class Checkpointer:
    """What goes into a checkpoint and when (after torchtitan's CheckpointManager, timm's CheckpointSaver).

    The run's progress (a `RunState`) is tracked, written flat at the top level;
    the stateful parts (model, optimiser, scheduler, scaler, EMA, RNGs) are
    registered once by name and saved as `part.state_dict()`; `meta` (config,
    data set, classes) rides along so `ddp validate` needs nothing else. After
    every step the loop asks `due()`: a save comes at each epoch's end (with its
    val top-1, which decides best.pt), every `every_steps`, and after the step at
    which all ranks agreed to stop on a signal (they agree every `stop_every`
    steps and at every save due anyway); the loop makes its state ready
    and calls `save()`, then `end_if_stopping()` ends the run on that signal
    (exit 143/130). Every rank takes part (RNG states are gathered); ranks with
    `writes` write: rank 0, and each node's first where the run dir is not
    shared (`run.writers`), so any node can resume.
    """

    def __init__(self, store: CheckpointStore | None, writes: bool = True, every_steps: int = 0,
                 stop: StopRequest | None = None, meta: dict[str, Any] | None = None,
                 background: bool = False, stop_every: int = 1) -> None:
        self.store, self.writes, self.every, self.stop = store, writes, every_steps, stop
        self.stop_every = stop_every  # steps between stop agreements (distributed.stop_check_steps)
        self.meta = meta or {}
        self.progress = RunState()
        self.stopping = 0  # the signal all ranks agreed to stop on at the last `due()`, else 0
        self.parts: dict[str, Stateful] = {}
        self.optional: set[str] = set()
        self.writer = ThreadPoolExecutor(1, thread_name_prefix="ddp-checkpoint") if background else None
        self.pending: Future | None = None

    def track(self, progress: RunState) -> None:
        """The run's progress: saved at every checkpoint's top level, restored by `load`."""
        self.progress = progress

    def register(self, optional: tuple[str, ...] = (), **parts: Stateful | None) -> None:
        """Parts saved and restored by name; `optional` ones may be absent from a checkpoint."""
        self.parts.update({name: part for name, part in parts.items() if part is not None})
        self.optional.update(optional)

    def due(self, epoch_end: bool = False) -> bool:
        """Whether the step just taken is to be saved: at an epoch's end, every `every_steps`, or on a
        stop signal. Call it on every rank after every step: every `stop_every` steps, at an epoch's end
        and when a save is due anyway, it asks every rank whether a signal came (a collective, the same
        steps on all ranks, so all stop after the same step); in between it asks nothing, so a stop comes
        at most `stop_every` steps after the signal. A background write that failed ends the run here,
        at the first step after it failed."""
        self.raise_if_failed()
        if self.stop:
            self.stop.after_step(self.progress.step)
        scheduled = epoch_end or bool(self.every and self.progress.step % self.every == 0)
        ask = self.stop and (scheduled or self.progress.step % self.stop_every == 0)
        self.stopping = self.stop.agreed() if ask else 0
        return scheduled or bool(self.stopping)

    def end_if_stopping(self, path: Path | None) -> None:
        """After the save a stop signal made due: once it is on disk, end the run (exit 143/130)."""
        if not self.stopping:
            return
        self.wait()
        folder = self.store.folder if self.store else Path("checkpoints")
        run_dir = self.store.run_dir() if self.store else folder.parent
        raise DdpError(f"stopped by {signal.Signals(self.stopping).name} after step {self.progress.step}, "
                       f"checkpoint {path or folder}; the same command with --run-dir "
                       f"{run_dir} resumes it", StopRequest.exit_code(self.stopping))

    def save(self, top1: float | None = None) -> Path | None:
        """A checkpoint of the current step; returns its path on writing ranks.

        In the background, the state is first copied to CPU memory (training goes on
        changing the live tensors) and written by one thread while the next steps run;
        a save waits for the one before it, so two never overlap. The caller makes the state
        ready first (`Trainer.settle`).
        """
        best = top1 is not None and top1 > self.progress.best_top1
        if top1 is not None:
            self.progress.best_top1 = max(self.progress.best_top1, top1)
        parts = {name: part.state_dict() for name, part in self.parts.items()}  # collective: every rank
        if not (self.writes and self.store):
            return None
        state = {**self.progress.state_dict(), **parts, **self.meta}
        info = {**self.progress.position(), "top1": top1}
        self.wait()
        if self.writer is None:
            return self.store.save(state, info, best)
        self.pending = self.writer.submit(self.store.save, cpu_copy(state), info, best)
        return self.store.path_for(self.progress.step)

    def raise_if_failed(self) -> None:
        """A background write (or upload) that has failed ends the run at the first step after it failed."""
        if self.pending is not None and self.pending.done():
            self.wait()
        if self.store and self.store.mirror:
            self.store.mirror.raise_if_failed()

    def wait(self) -> None:
        """Until the write under way (if any) is durable; its failure is raised here."""
        pending, self.pending = self.pending, None
        if pending is not None:
            try:
                pending.result()
            except OSError as e:  # not a refusal (those are WriteErrors, with their own line)
                raise DataError(f"{self.store.folder}: writing a checkpoint failed ({e}); fix the folder, "
                                "then resume from the last one written") from e

    def close(self) -> None:
        """Before the process ends: the last write durable (and uploaded), the writer thread gone."""
        try:
            self.wait()
        finally:
            if self.writer is not None:
                self.writer.shutdown()
        if self.store and self.store.mirror:
            self.store.mirror.close()

    def load(self, path: str | Path) -> dict[str, Any]:
        """Restore the progress and every registered part from `path`; returns the checkpoint."""
        state = load_checkpoint(path)
        self.progress.load_state_dict(state)
        for name, part in self.parts.items():
            if state.get(name) is None:
                if name in self.optional:
                    continue
                raise DataError(f"{path}: the checkpoint has no {name} state; resume from another one "
                                "(--resume PATH) or start afresh (--resume never)")
            try:
                part.load_state_dict(state[name])
            except (RuntimeError, ValueError, KeyError, TypeError, AttributeError) as e:
                raise ConfigError(f"resume: {path}: its {name} does not fit this run (another model or "
                                  f"class count? {str(e).strip().splitlines()[0]}); use --resume never "
                                  "or a new --run-dir") from e
        return state


def cpu_copy(state: Any) -> Any:
    """`state` with every tensor copied to CPU memory; containers rebuilt, other values shared."""
    if isinstance(state, torch.Tensor):
        return state.detach().to("cpu", copy=True)
    if isinstance(state, dict):
        return {key: cpu_copy(value) for key, value in state.items()}
    if isinstance(state, list | tuple):
        return type(state)(cpu_copy(value) for value in state)
    return state
