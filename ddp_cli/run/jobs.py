"""The job folder: how the launcher hands work to its workers and gets answers back.

For `train` it is the run directory itself (config.toml, metrics.jsonl,
checkpoints/); for `validate` and `predict` a temporary folder (`predict` gets
its answers back in `predictions.jsonl`). The launcher writes the
resolved config, the registry entry, the index tables (built once per run, not
once per rank) and `job.json`; rank 0 writes `result.json` (and a copy on each node whose folder is not
rank 0's: `run.writers`); a failing rank
writes `errors/rank<N>.json` so the launcher can name the original failure.
"""

from __future__ import annotations

import json
import time
import tomllib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ddp_cli.config import RunConfig, config_from_dict
from ddp_cli.data.registry import DatasetEntry
from ddp_cli.data.sources.table import IndexTable
from ddp_cli.io import write_text


@dataclass
class Job:
    mode: str  # "train" | "validate" | "predict"
    quiet: bool = False
    checkpoint: str | None = None  # validate, predict: the checkpoint to use
    resume: str = "never"  # train: auto | never | a checkpoint path
    bucket: str | None = None  # train: the run dir in object storage this folder stages (s3://...)
    weights: str = "model"  # validate, predict: the checkpoint's "model" or "ema" weights
    topk: list[int] = field(default_factory=lambda: [1, 5])  # validate: accuracies; predict: [k]
    tta: bool = False  # validate: average with the horizontally flipped image
    per_class: bool = False  # validate: per-class accuracy in the result
    confusion: str | None = None  # validate: CSV files to write (absolute paths)
    predictions: str | None = None
    evaluation: str | None = None  # validate: the run's evaluation file for `ddp report`


def prepare_job(folder: Path, cfg: RunConfig, entry: DatasetEntry, index: IndexTable, job: Job) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    write_text(folder / "config.toml", cfg.to_toml())
    write_text(folder / "dataset.json", entry.model_dump_json(indent=2))
    index.save(folder / "index")
    write_text(folder / "job.json", json.dumps(asdict(job)))


def read_job(folder: Path) -> tuple[RunConfig, DatasetEntry, IndexTable, Job]:
    cfg = config_from_dict(tomllib.loads((folder / "config.toml").read_text()),
                           source=str(folder / "config.toml"))
    entry = DatasetEntry.model_validate_json((folder / "dataset.json").read_text())
    job = Job(**json.loads((folder / "job.json").read_text()))
    return cfg, entry, IndexTable.load(folder / "index"), job


def write_result(folder: Path, result: dict[str, Any]) -> None:
    write_text(folder / "result.json", json.dumps(result, indent=2))


def read_result(folder: Path) -> dict[str, Any]:
    return json.loads((folder / "result.json").read_text())


def record_error(folder: Path, rank: int, exit_code: int, message: str, original: bool) -> None:
    """`original` is false for ranks that only saw a peer vanish."""
    record = {"rank": rank, "exit_code": exit_code, "message": message,
              "original": original, "time": time.time()}
    write_text(folder / "errors" / f"rank{rank}.json", json.dumps(record))


def first_error(folder: Path) -> dict[str, Any] | None:
    """The earliest original failure, else the earliest of any."""
    records = [json.loads(p.read_text()) for p in sorted((folder / "errors").glob("rank*.json"))]
    if not records:
        return None
    return min(records, key=lambda r: (not r["original"], r["time"]))


def clear_errors(folder: Path) -> None:
    for path in (folder / "errors").glob("rank*.json"):
        path.unlink(missing_ok=True)  # a node sharing the run dir may clear it at the same time
