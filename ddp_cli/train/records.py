"""What the training loop writes down: a metrics.jsonl row, and an epoch's end in its two shapes.

Every row of metrics.jsonl starts alike, `split`, `epoch` (1-based), `step`
(`row`). An epoch's end is one set of facts (`EpochEnd`), written twice under
names their readers already know: the run's history (checkpoint, console table,
`ddp train --json`'s `last_epoch`: `history_row`) and the keys every validation
record of metrics.jsonl carries (`validation_keys`). The two spell a fact
differently where their readers do (`skipped` vs `skipped_images`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


def row(split: str, epoch: int, step: int, /, **fields: Any) -> dict[str, Any]:
    """A metrics.jsonl record: `epoch` the 0-based epoch under way, written 1-based; `step` the
    optimisation steps completed, all epochs."""
    return {"split": split, "epoch": epoch + 1, "step": step, **fields}


@dataclass(frozen=True)
class EpochEnd:
    """An epoch's end, as every rank agrees on it (val metrics and counts summed over ranks)."""

    epoch: int  # 1-based: the epochs completed
    train_loss: float  # mean over the epoch's steps, all ranks
    val: dict[str, float]  # the trained weights' validation (`EvalTotals.metrics`)
    ema_val: dict[str, float] | None  # the EMA's, when on
    seconds: float  # of training (validation not counted)
    images_per_second: float  # of training
    skipped: int  # distinct bad files met this epoch, train and val, all ranks
    io_retries: int  # storage retries this epoch, all ranks and their loader processes
    lr: float  # at the epoch's end
    image_size: int  # of the epoch's train images
    metrics: dict[str, Any] = field(default_factory=dict)  # the objective's own, over the epoch
    mfu: float | None = None  # model FLOPs utilisation of the epoch's training, where reported

    def history_row(self) -> dict[str, Any]:
        """The run's history entry (`RunState.history`), also the console's epoch line."""
        return {"epoch": self.epoch, "train_loss": self.train_loss, "val_loss": self.val["loss"],
                "top1": self.val["top1"], "top5": self.val["top5"],
                **({"ema_top1": self.ema_val["top1"]} if self.ema_val else {}), "seconds": self.seconds,
                "images_per_second": self.images_per_second, **self.utilisation(), "skipped": self.skipped,
                "io_retries": self.io_retries, **self.metrics}

    def validation_keys(self) -> dict[str, Any]:
        """What each validation record of metrics.jsonl (`val`, `val_ema`) carries besides its metrics."""
        return {"lr": self.lr, "image_size": self.image_size, "images_per_second": self.images_per_second,
                **self.utilisation(), "skipped_images": self.skipped, "io_retries": self.io_retries}

    def utilisation(self) -> dict[str, float]:
        """`mfu`, where the run reports it."""
        return {} if self.mfu is None else {"mfu": self.mfu}
