"""Where metrics go, behind one interface: `write(record)` and `close()`.

Always `metrics.jsonl` and `metrics.csv` in the run dir; TensorBoard,
Weights & Biases and MLflow (mlflow_sink.py) when `[logging]` asks; and every record is also a `logging`
record on the `ddp.metrics` logger, so a user's own handler keeps working.
Only rank 0 builds sinks.
"""

from __future__ import annotations

import csv
import json
import logging
import time
from pathlib import Path
from typing import Any, Protocol

from ddp_cli.config import LoggingConfig
from ddp_cli.errors import DataError, require_extra
from ddp_cli.io import writing
from ddp_cli.observe.mlflow_sink import MlflowSink
from ddp_cli.userfiles import read_text

CSV_COLUMNS = ("time", "epoch", "step", "split", "loss", "top1", "top5", "lr", "images_per_second",
               "skipped_images", "images")
SCALARS = ("loss", "top1", "top5", "lr", "images_per_second",
           "sup_loss", "unsup_loss", "mask_rate", "pseudo_label_top1", "pair_top1")  # FixMatch's, SimCLR's
metrics_log = logging.getLogger("ddp.metrics")


class Sink(Protocol):
    def write(self, record: dict[str, Any]) -> None: ...
    def close(self) -> None: ...


class JsonlSink:
    """One JSON object per line, line-buffered so `tail -f` and `ddp report` see it live."""

    def __init__(self, path: Path) -> None:
        self.path = path
        with writing(path):
            self.file = open(path, "a", buffering=1)  # noqa: SIM115 - lives as long as the run

    def write(self, record: dict[str, Any]) -> None:
        with writing(self.path):
            self.file.write(json.dumps(record) + "\n")

    def close(self) -> None:
        self.file.close()


class CsvSink:
    """Fixed columns (blank where a record has no value): opens in any spreadsheet."""

    def __init__(self, path: Path) -> None:
        self.path = path
        new = not path.exists() or path.stat().st_size == 0
        with writing(path):
            self.file = open(path, "a", newline="", buffering=1)  # noqa: SIM115
            self.writer = csv.DictWriter(self.file, CSV_COLUMNS, extrasaction="ignore")
            if new:
                self.writer.writeheader()

    def write(self, record: dict[str, Any]) -> None:
        with writing(self.path):
            self.writer.writerow(record)

    def close(self) -> None:
        self.file.close()


class TensorBoardSink:
    """Scalars as `<split>/<name>` against the global step, under `<run>/tensorboard/`."""

    def __init__(self, folder: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(folder))

    def write(self, record: dict[str, Any]) -> None:
        for name in SCALARS:
            if isinstance(record.get(name), (int, float)):
                self.writer.add_scalar(f"{record['split']}/{name}", record[name], record["step"])

    def close(self) -> None:
        self.writer.close()


def check_sinks(cfg: LoggingConfig) -> None:
    """TensorBoard and W&B are optional extras: a missing one is a config error before any worker
    starts, not an ImportError on rank 0 after the others began."""
    if cfg.tensorboard:
        require_extra("tensorboard", "logging.tensorboard", "set logging.tensorboard = false")
    if cfg.wandb:
        require_extra("wandb", "logging.wandb", "remove [logging.wandb]")
    if cfg.mlflow:
        require_extra("mlflow", "logging.mlflow", "remove [logging.mlflow]")


class WandbSink:
    """A W&B run in the run dir; `mode = "offline"` needs no network (sync later)."""

    def __init__(self, run_dir: Path, settings: Any, config: dict[str, Any]) -> None:
        import wandb  # check_sinks has made sure it is there

        self.run = wandb.init(project=settings.project, entity=settings.entity, mode=settings.mode,
                              name=settings.name or run_dir.name, dir=str(run_dir), config=config,
                              tags=settings.tags, settings=wandb.Settings(silent=True))

    def write(self, record: dict[str, Any]) -> None:
        self.run.log({f"{record['split']}/{k}": record[k] for k in SCALARS
                      if isinstance(record.get(k), (int, float))}, step=record["step"])

    def close(self) -> None:
        self.run.finish()


class LoggingSink:
    """Each record on the `ddp.metrics` logger (as `extra={"metrics": ...}`) for user handlers."""

    def write(self, record: dict[str, Any]) -> None:
        metrics_log.debug("metrics %s", json.dumps(record), extra={"metrics": record})

    def close(self) -> None:
        pass


class Sinks:
    """The fan-out the trainer writes to; stamps each record with the wall time."""

    def __init__(self, sinks: list[Sink]) -> None:
        self.sinks = sinks

    def write(self, record: dict[str, Any]) -> None:
        record = {**record, "time": round(time.time(), 3)}
        for sink in self.sinks:
            sink.write(record)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()

    def mlflow(self) -> MlflowSink | None:
        """The MLflow sink, to hand it the run's artefacts at the end; None without one."""
        return next((sink for sink in self.sinks if isinstance(sink, MlflowSink)), None)


def build_sinks(cfg: LoggingConfig, run_dir: Path, config: dict[str, Any]) -> Sinks:
    sinks: list[Sink] = [JsonlSink(run_dir / "metrics.jsonl"), CsvSink(run_dir / "metrics.csv"),
                         LoggingSink()]
    if cfg.tensorboard:
        sinks.append(TensorBoardSink(run_dir / "tensorboard"))
    if cfg.wandb:
        sinks.append(WandbSink(run_dir, cfg.wandb, config))
    if cfg.mlflow:
        sinks.append(MlflowSink(cfg.mlflow, run_dir, config))
    return Sinks(sinks)


# what `ddp report` reads of each record of a split: numbers (NaN included: a diverged run logs one);
# a train record's epoch and images_per_second may be absent, but are numbers where present
NUMBERS = {"train": ("step", "loss", "lr"), "val": ("epoch", "step", "loss", "top1", "top5")}
OPTIONAL = ("epoch", "images_per_second")


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """Every complete line of a metrics.jsonl (a run still writing may have a partial last one, and one
    killed mid-line and resumed a partial line in the middle): DataError naming the line where a
    complete one is not a record `ddp report` can read."""
    records = []
    for number, line in enumerate(read_text(path).splitlines(), 1):
        try:
            record = json.loads(line)
        except (json.JSONDecodeError, RecursionError):
            continue
        if not isinstance(record, dict):
            raise DataError(f"{path}, line {number}: not a JSON object; metrics.jsonl holds one record "
                            "a line, as `ddp train` writes it")
        split = record.get("split")
        required = NUMBERS.get(split, ()) if isinstance(split, str) else ()
        for key in (*required, *(k for k in OPTIONAL if k in record and required)):
            value = record.get(key)
            if type(value) not in (int, float):
                raise DataError(f"{path}, line {number}: {key} is {str(value)[:40]!r}, not a number; "
                                "metrics.jsonl holds one record a line, as `ddp train` writes it")
        records.append(record)
    return records
