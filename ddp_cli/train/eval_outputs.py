"""What a validation writes beside its numbers: the confusion matrix and per-image predictions as CSV,
and the evaluation file `ddp report` draws (per-class accuracy, the confusion matrix).

All from the reduced `EvalTotals` on rank 0, written atomically (a reader never sees half a file).
"""

from __future__ import annotations

import csv
import io
import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ddp_cli.io import write_text
from ddp_cli.train.metrics import EvalTotals

CONFUSION_KEPT = 100  # classes up to which an evaluation file holds the whole confusion matrix


def evaluation_record(totals: EvalTotals, classes: list[str], descriptions: list[str],
                      **about: Any) -> dict[str, Any]:
    """`about` (source, checkpoint, weights, dataset, split), the totals and per-class accuracy."""
    return {**about, "images": totals.metrics["images"], "top1": totals.metrics["top1"],
            "time": time.time(), "per_class": totals.per_class(classes, descriptions),
            "confusion": totals.confusion.tolist() if len(classes) <= CONFUSION_KEPT else None}


def write_evaluation(path: Path, record: dict[str, Any]) -> None:
    write_text(path, json.dumps(record))


def write_csv(path: Path, header: list[str], rows: list[list[Any]]) -> None:
    out = io.StringIO()
    writer = csv.writer(out)
    writer.writerow(header)
    writer.writerows(rows)
    write_text(path, out.getvalue())


def write_confusion(path: Path, totals: EvalTotals, classes: list[str], descriptions: list[str]) -> None:
    """Rows: true class (synset, description); columns: predicted class, by synset; cells: images."""
    counts = totals.confusion.tolist()
    write_csv(path, ["synset", "description", *classes],
              [[synset, text, *row] for synset, text, row in zip(classes, descriptions, counts, strict=True)])


def write_predictions(path: Path, totals: EvalTotals, root: str, paths: Sequence[str],
                      classes: list[str]) -> None:
    """One row per counted image, in split order: its path and label, then its top-k classes (index,
    synset) with their probabilities, best first."""
    k = max((len(row[2]) for row in totals.kept), default=0)
    header = ["path", "label", "synset"]
    for j in range(1, k + 1):
        header += [f"top{j}_index", f"top{j}_synset", f"top{j}_probability"]
    rows = []
    for position, label, top, probs in totals.kept:
        row = [f"{root}/{paths[position]}", label, classes[label]]
        for index, p in zip(top, probs, strict=True):
            row += [index, classes[index], f"{p:.6g}"]
        rows.append(row)
    write_csv(path, header, rows)
