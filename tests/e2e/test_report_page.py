"""`ddp report --html`: the page of a small trained run (tests/conftest.py's `demo_page`) holds every
section, the JSON's numbers, decodable thumbnails of the mistakes `ddp validate --predictions` found, and
nothing from the network; mid-run it shows what exists and says "not yet" for the rest. MFU reaches
metrics.jsonl, result.json and the report."""

from __future__ import annotations

import base64
import csv
import io
import json
import re
import shutil
from pathlib import Path
from statistics import median

import pytest
from PIL import Image

from ddp_cli.data.thumbnails import Thumbnails
from ddp_cli.observe.page import page
from ddp_cli.observe.report import summarize

SECTIONS = ("glance", "curves", "startup", "classes", "mistakes")


def text_of(html: str) -> str:
    return re.sub(r"<[^>]+>", " ", html)


def test_every_section_and_the_json_numbers(demo_page):
    path, run_dir, summary = demo_page
    html = path.read_text()
    for key in SECTIONS:
        assert f'<section id="{key}">' in html
    script = re.search(r'<script type="application/json" id="summary">(.*?)</script>', html)
    embedded = json.loads(script.group(1))
    assert embedded == {k: v for k, v in summary.items() if k not in ("plot", "classes_plot", "html")}
    assert embedded == json.loads(json.dumps(summarize(run_dir)))
    cells = dict(re.findall(r'<td data-key="([^"]+)">([^<]*)', html))
    assert cells["final top-1 (model)"] == f"{summary['top1']:.2%}"
    assert cells["final top-1 (EMA)"] == f"{summary['ema_top1']:.2%}"
    assert cells["best top-1"].startswith(f"{summary['best_top1']:.2%}")
    assert cells["MFU (median of windows)"] == f"{summary['mfu']:.2%}"
    assert cells["images/s (median of windows)"] == f"{summary['images_per_second']:.4g}"
    assert html.count("<svg") >= 3  # the curves over steps and over wall time, the confusion matrix
    assert 'class="sortable" id="per-class"' in html


def test_mfu_in_metrics_result_and_report(demo_page):
    _, run_dir, summary = demo_page
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["split"] == "train"]
    assert train and all(0 < r["mfu"] < 1 for r in train)
    assert all("mfu" in r for r in rows if r["split"] == "val")
    result = json.loads((run_dir / "result.json").read_text())
    assert 0 < result["mfu"] < 1 and result["peak_flops"] > 0 and result["peak_source"].startswith("measured")
    assert summary["mfu"] == median(r["mfu"] for r in train)  # as its images/s: the windows' median


def test_the_gallery_shows_the_predictions_mistakes(demo_page):
    path, run_dir, _ = demo_page
    html = path.read_text()
    with (run_dir / "predictions.csv").open() as f:
        rows = list(csv.DictReader(f))
    wrong = [r for r in rows if r["label"] != r["top1_index"]]
    assert wrong, "the demo model gets some val images wrong"
    mistakes = html[html.index('<section id="mistakes">'):]
    assert f"{len(wrong)} of {len(rows)} images wrong" in mistakes
    thumbnail = r'<figure class="thumb" title="([^"]+)"><img alt="[^"]*" src="data:image/jpeg;base64,([^"]+)"'
    shown = re.findall(thumbnail, mistakes)
    assert shown and {p for p, _ in shown} <= {r["path"] for r in wrong}
    for _, data in shown:
        with Image.open(io.BytesIO(base64.b64decode(data))) as image:
            image.load()
            assert image.format == "JPEG" and max(image.size) <= 96
    top = max(wrong, key=lambda r: float(r["top1_probability"]))
    gallery = mistakes[mistakes.index("the most confident mistakes"):]
    assert re.search(r'title="([^"]+)"', gallery).group(1) == top["path"]  # most confident first


def test_nothing_from_the_network(demo_page):
    html = demo_page[0].read_text()
    assert not re.search(r"""(src|href)\s*=\s*["']?\s*(https?:)?//""", html, re.IGNORECASE)
    assert not re.search(r"url\(\s*['\"]?(https?:)?//|@import|<link\b|<iframe\b", html, re.IGNORECASE)
    assert "<script src" not in html
    namespaces = {"http://www.w3.org/2000/svg", "http://www.w3.org/1999/xlink"}  # names, never fetched
    assert set(re.findall(r"https?://[^\s\"'<>)]+", html)) <= namespaces


def test_mid_run_shows_what_exists(demo_page, tmp_path: Path):
    """A run dir early in its first epoch: a few train windows, no validation, no evaluation, no
    predictions, no result.json: the page is made and says "not yet" where a part is missing."""
    _, run_dir, _ = demo_page
    early = tmp_path / "early"
    early.mkdir()
    for name in ("config.toml", "dataset.json"):
        shutil.copy(run_dir / name, early / name)
    rows = [line for line in (run_dir / "metrics.jsonl").read_text().splitlines()
            if json.loads(line)["split"] == "train"][:2]
    (early / "metrics.jsonl").write_text("\n".join(rows) + "\n")
    html = page(early, Thumbnails(early))
    for key in SECTIONS:
        assert f'<section id="{key}">' in html
    for key in ("startup", "classes", "mistakes"):
        section = html[html.index(f'<section id="{key}">'):]
        assert "not yet" in text_of(section[:section.index("</section>")])
    assert "running or stopped: 0 epoch(s)" in html


def test_no_metrics_is_the_reports_error(tmp_path: Path):
    from ddp_cli.errors import ConfigError

    with pytest.raises(ConfigError, match="no metrics.jsonl"):
        page(tmp_path, Thumbnails(tmp_path))
