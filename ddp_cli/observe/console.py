"""What a person watching rank 0 sees.

On a terminal: one live view, the table of finished epochs above a progress bar
for the current one (step, loss, lr, images/s, ETA). Anywhere else (a pipe, a
log file, CI), `--quiet` aside: plain log lines every `logging.every_steps`
and one line per epoch. Other ranks, `--quiet` and `--json` show nothing.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from rich.console import Console, Group
from rich.live import Live
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table

log = logging.getLogger("ddp")
COLUMNS = {"epoch": "epoch", "train_loss": "train loss", "val_loss": "val loss", "top1": "top-1",
           "top5": "top-5", "ema_top1": "EMA top-1", "seconds": "time s", "images_per_second": "img/s",
           "mfu": "MFU", "skipped": "skipped"}
OPTIONAL = ("ema_top1", "mfu")  # a column only where a row has it (the EMA's; MFU where reported)


class RunConsole:
    """Rank 0's view of training; silent elsewhere."""

    def __init__(self, enabled: bool, every_steps: int = 50, terminal: bool | None = None) -> None:
        self.enabled, self.every_steps = enabled, every_steps
        self.rich = Console(file=sys.stderr)
        self.terminal = enabled and (self.rich.is_terminal if terminal is None else terminal)
        self.rows: list[dict[str, float]] = []
        self.progress = Progress(
            TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
            TextColumn("{task.fields[info]}"), TimeElapsedColumn(), TextColumn("eta"),
            TimeRemainingColumn(), console=self.rich,
        )
        self.live: Live | None = None

    def info(self, message: str) -> None:
        if self.terminal:
            self.rich.print(message, highlight=False)
        elif self.enabled:
            log.info(message)

    @contextmanager
    def epoch(self, epoch: int, epochs: int, steps: int) -> Iterator[Callable[..., None]]:
        """Yields `update(step, **fields)`: redraws the bar, or logs every `every_steps`."""
        title = f"epoch {epoch + 1}/{epochs}"
        if not self.terminal:
            def update(step: int, **fields: float) -> None:
                if self.enabled and step and (step % self.every_steps == 0 or step == steps):
                    log.info(f"{title} step {step}/{steps} {_fmt(fields)}")
            yield update
            return
        for task in self.progress.task_ids:
            self.progress.remove_task(task)
        task = self.progress.add_task(title, total=steps, info="")
        if self.live is None:
            self.live = Live(get_renderable=self._view, console=self.rich, refresh_per_second=4,
                             transient=True)
            self.live.start()

        def update(step: int, **fields: float) -> None:
            self.progress.update(task, completed=step, info=_fmt(fields))
        yield update

    def epoch_done(self, row: dict[str, float]) -> None:
        self.rows.append(row)
        if self.enabled and not self.terminal:
            log.info(f"epoch {row['epoch']} done: " + _fmt({k: v for k, v in row.items() if k != "epoch"}))

    def summary(self, rows: list[dict[str, float]]) -> None:
        """Leave the final epochs table on screen (the live view goes)."""
        self.rows = list(rows)
        if self.terminal:
            self.close()
            self.rich.print(self.table())

    def close(self) -> None:
        if self.live is not None:
            self.live.stop()
            self.live = None

    def table(self) -> Table:
        table = Table(title="epochs", title_justify="left", expand=False)
        keys = [k for k in COLUMNS if k not in OPTIONAL or any(k in row for row in self.rows)]
        for key in keys:
            table.add_column(COLUMNS[key], justify="right")
        for row in self.rows:
            table.add_row(*(_cell(row.get(key, ""), key) for key in keys))
        return table

    def _view(self) -> Group:
        return Group(self.table(), self.progress) if self.rows else Group(self.progress)


def _cell(value: object, key: str = "") -> str:
    if key == "mfu" and isinstance(value, float):  # a share of the peak
        return f"{value:.1%}"
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _fmt(fields: dict[str, float]) -> str:
    return " ".join(f"{k}={_cell(v, k)}" for k, v in fields.items())
