"""What a resume changes against the run as it was, said in one line (the worker's, and `--dry-run`'s).

A checkpoint holds the resolved config it trained with; a resume may run another (`--set
train.epochs=12` on a finished 8-epoch run recomputes the cosine over 12 epochs and moves the
progressive-resizing ramp), and none of that shows in the weights. `Resumed` names the checkpoint,
where the run goes on, every config key that differs, the LR of the next step and the train crop of
the epoch it goes on in, each as the run was and as it now goes on.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ddp_cli.config import RunConfig, config_from_dict
from ddp_cli.config.resolve import resume


def flat(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested config dict as dotted keys ("train.epochs"), its values as they are."""
    out: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, dict) and value:
            out.update(flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def config_changes(trained: dict[str, Any], now: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """Every dotted key whose value differs between a checkpoint's config and this run's: (the
    checkpoint's, this run's), a key one of them lacks as None there; in the order of the keys."""
    before, after = flat(trained), flat(now)
    keys = [*after, *(key for key in before if key not in after)]
    return {key: (before.get(key), after.get(key)) for key in keys if before.get(key) != after.get(key)}


@dataclass(frozen=True)
class Resumed:
    """A resume: the checkpoint, where the run stands in it, and what this run changes."""

    checkpoint: str
    epochs_done: int  # whole epochs the checkpoint has trained
    step: int  # optimisation steps it has taken
    schedule_step: int  # the step of this run's schedule the next step takes (another world size: moved)
    epochs: int  # this run's train.epochs
    changes: dict[str, tuple[Any, Any]]  # config keys that differ: (the checkpoint's, this run's)
    lr: tuple[float, float]  # the next step's LR: as the run was, as this run takes it
    train_size: tuple[int, int] | None  # the train crop of the epoch it goes on in (None: finished)

    @property
    def finished(self) -> bool:
        """No epoch left to train: the checkpoint has as many epochs as this run asks, or more."""
        return self.epochs_done >= self.epochs

    def line(self) -> str:
        """What the resume does, as one line."""
        where = f"resumed from {self.checkpoint} (epoch {self.epochs_done + 1} of {self.epochs}, " \
                f"step {self.step})"
        if self.finished:
            return (f"{self.checkpoint} has trained {self.epochs_done} epochs and train.epochs is "
                    f"{self.epochs}: nothing to train, result.json left as it was; to train on, resume with "
                    f"--set train.epochs=N (N > {self.epochs_done})")
        said = [f"{key} {words(old)} -> {words(new)}" for key, (old, new) in self.changes.items()]
        if self.lr[0] != self.lr[1]:
            said.append(f"LR at the next step {self.lr[0]:.3g} -> {self.lr[1]:.3g}")
        if self.train_size and self.train_size[0] != self.train_size[1]:
            said.append(f"train crop of epoch {self.epochs_done + 1} {self.train_size[0]} -> "
                        f"{self.train_size[1]}")
        return f"{where}: {'; '.join(said)}" if said else f"{where}, as the run was"

    def as_dict(self) -> dict[str, Any]:
        """For `--dry-run --json`: the same facts, each change as [the checkpoint's, this run's]."""
        return {"checkpoint": self.checkpoint, "epoch": self.epochs_done + 1, "step": self.step,
                "finished": self.finished, "changes": {k: list(v) for k, v in self.changes.items()},
                "lr_next_step": list(self.lr),
                "train_size": list(self.train_size) if self.train_size else None}


def words(value: Any) -> str:
    return "unset" if value is None else str(value)


def resumed(path: str | Path, saved: dict[str, Any], cfg: RunConfig, lr: float,
            schedule_step: int) -> Resumed:
    """The resume of this run (resolved `cfg`) from checkpoint `saved` (read from `path`), whose next
    step this run takes at `lr`, at `schedule_step` of its schedule. The LR as the run was is the one
    its optimiser holds for that step. `cfg` goes on reconciled with the checkpoint's (`resume`), as the
    workers take it, so a dry run says what the run will do."""
    trained = config_from_dict(saved["config"], str(path)) if "config" in saved else cfg
    cfg = resume(cfg, trained)
    epoch = saved.get("epoch", 0)
    going_on = epoch < cfg.train.epochs
    groups = (saved.get("optimizer") or {}).get("param_groups") or [{"lr": lr}]
    return Resumed(str(path), epoch, saved.get("step", 0), schedule_step, cfg.train.epochs,
                   config_changes(trained.model_dump(mode="json"), cfg.model_dump(mode="json")),
                   (groups[0]["lr"], lr),
                   (trained.data.train_size(epoch), cfg.data.train_size(epoch)) if going_on else None)
