"""What a person watching rank 0 sees: a rich progress bar on a TTY, plain lines otherwise."""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

log = logging.getLogger("ddp")


class RunConsole:
    """Rank 0's view of training; silent on other ranks and with --quiet/--json."""

    def __init__(self, enabled: bool, every_steps: int = 50) -> None:
        self.enabled = enabled
        self.every_steps = every_steps
        self.rich = Console(file=sys.stderr)
        self.live = enabled and self.rich.is_terminal

    def info(self, message: str) -> None:
        if self.enabled:
            self.rich.print(message) if self.live else log.info(message)

    @contextmanager
    def epoch(self, epoch: int, epochs: int, steps: int) -> Iterator[callable]:
        """Yields `update(step, **fields)`; draws a bar or logs every `every_steps`."""
        if not self.live:
            def update(step: int, **fields: float) -> None:
                if self.enabled and (step % self.every_steps == 0 or step == steps):
                    log.info(f"epoch {epoch + 1}/{epochs} step {step}/{steps} " + _fmt(fields))
            yield update
            return
        progress = Progress(
            TextColumn(f"epoch {epoch + 1}/{epochs}"), BarColumn(), MofNCompleteColumn(),
            TextColumn("{task.fields[info]}"), TimeRemainingColumn(), console=self.rich,
            transient=True,
        )
        task = progress.add_task("train", total=steps, info="")
        with progress:
            def update(step: int, **fields: float) -> None:
                progress.update(task, completed=step, info=_fmt(fields))
            yield update

    def epoch_done(self, row: dict[str, float]) -> None:
        self.info(f"epoch {row['epoch']} done: " + _fmt({k: v for k, v in row.items() if k != "epoch"}))

    def summary(self, rows: list[dict[str, float]]) -> None:
        """The epoch table, once, at the end (TTY only; plain logs already said it)."""
        if not (self.live and rows):
            return
        table = Table(title="epochs", title_justify="left")
        for column in rows[-1]:
            table.add_column(column, justify="right")
        for row in rows:
            table.add_row(*(_cell(v) for v in row.values()))
        self.rich.print(table)


def _cell(value: float) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _fmt(fields: dict[str, float]) -> str:
    return " ".join(f"{k}={_cell(v)}" for k, v in fields.items())
