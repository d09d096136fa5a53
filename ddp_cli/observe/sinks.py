"""Where metrics go: `metrics.jsonl` in the run dir (rank 0 only)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any


class MetricsFile:
    """Appends one JSON object per logged step or epoch; flushed so `tail -f` works."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.file = open(path, "a", buffering=1)  # noqa: SIM115 - lives as long as the run

    def write(self, record: dict[str, Any]) -> None:
        self.file.write(json.dumps({**record, "time": round(time.time(), 3)}) + "\n")

    def close(self) -> None:
        self.file.close()


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """Every complete line of a metrics.jsonl (a run still writing may have a partial last one)."""
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records
