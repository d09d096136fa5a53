"""`ddp report`: a run summarised and its curves drawn, from its folder or from its bucket."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

from ddp_cli.cli.commands.run_dirs import run_location
from ddp_cli.data.thumbnails import Thumbnails
from ddp_cli.errors import DataError
from ddp_cli.io import write_text, writing
from ddp_cli.observe import classes
from ddp_cli.observe.page import page
from ddp_cli.observe.report import classes_png, plot, summarize
from ddp_cli.run.bucket import RunBucket


def report(run_dir: Path, out: Path | None, html: Path | None = None,
           predictions: Path | None = None) -> dict[str, Any]:
    """`ddp report`: the run summarised, its curves drawn to `out` (and any per-class picture beside),
    and with `html` the whole run on one page there (observe/page.py)."""
    url = run_location(run_dir, "RUN_DIR")
    if isinstance(url, str):
        return report_from_bucket(RunBucket(url), out, html, predictions)
    summary = summarize(run_dir)
    png = out or run_dir / "report.png"
    summary["plot"] = str(plot(run_dir, png))
    drawn = classes.plot(run_dir, classes_png(png))
    summary["classes_plot"] = str(drawn) if drawn else None
    if html:
        numbers = {k: v for k, v in summary.items() if k not in ("plot", "classes_plot")}
        text = page(run_dir, Thumbnails(run_dir), predictions, numbers)
        with writing(html):
            write_text(html, text)
        summary["html"] = str(html)
    return summary


def report_from_bucket(bucket: RunBucket, out: Path | None, html: Path | None = None,
                       predictions: Path | None = None) -> dict[str, Any]:
    """`ddp report s3://...`: the run's files downloaded to a temporary folder and drawn there; the
    pictures uploaded beside the run (report.png, as a local run gets it), or written to `out`."""
    with tempfile.TemporaryDirectory(prefix="ddp-report-") as tmp:
        folder = Path(tmp) / "run"
        if not bucket.download_files(folder):
            raise DataError(f"{bucket.url}: no run there (no files under it); give the --run-dir of a run")
        summary = report(folder, out, html and html.resolve(), predictions)
        if out is None:
            for picture in sorted(folder.glob("report*.png")):
                bucket.put(picture, picture.name)
        return json.loads(json.dumps(summary).replace(str(folder), bucket.url))
