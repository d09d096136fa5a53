"""`ddp report RUN_DIR --html FILE`: the run on one self-contained HTML page.

Everything is inside the file (plots as inline SVG, thumbnails as base64 JPEGs, the one small script
inline): it opens from a laptop's disk, an e-mail or a bucket with no network. Made from what the run
dir holds so far, so it works mid-run; a part not there yet says so. Its numbers are `ddp report`'s
JSON (`report.summarize`), so the page and the JSON never disagree.

The gallery of mistakes needs a predictions CSV of `ddp validate --predictions` (train/eval_outputs.py):
given with `--predictions`, else the newest in the run dir; its images are read from the data set the
run dir's dataset.json names, by the rows of the run's own index (index/), wherever they lie (files,
tar shards, Parquet).
"""

from __future__ import annotations

import csv
import html
import io
import json
import logging
import math
import re
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from ddp_cli.errors import require_extra
from ddp_cli.observe import classes
from ddp_cli.observe.report import load_records, summarize
from ddp_cli.observe.sinks import read_metrics
from ddp_cli.userfiles import parse_toml, read_text

log = logging.getLogger("ddp")

PAIRS, PER_PAIR, CONFIDENT = 12, 8, 16  # the gallery: most frequent pairs, images per pair, top mistakes

PREDICTIONS_HEADER = ("path", "label", "synset", "top1_index", "top1_synset", "top1_probability")
NOT_YET = "not yet"

STYLE = """
body{font:14px/1.45 system-ui,sans-serif;margin:0 auto;max-width:1200px;padding:1em 2em;color:#222}
h1{font-size:1.6em;margin-bottom:.2em}h2{border-bottom:1px solid #ccc;padding-bottom:.2em;margin-top:1.6em}
table{border-collapse:collapse;margin:.5em 0}td,th{border:1px solid #ddd;padding:2px 8px;text-align:left}
th{background:#f4f4f4}table.sortable th{cursor:pointer}
td.num{text-align:right;font-variant-numeric:tabular-nums}
.facts td:first-child{color:#555}.note{color:#666;font-style:italic}.bar{background:#4c78a8;height:10px}
.grid{display:grid;grid-template-columns:repeat(auto-fill,minmax(300px,1fr));gap:8px}
figure.thumb{display:inline-block;margin:3px;text-align:center;font-size:11px}
figure.thumb img{width:96px;height:96px;object-fit:contain;image-rendering:pixelated;border:1px solid #ccc}
.pair{margin:.6em 0}.svg svg{max-width:100%;height:auto}pre{background:#f7f7f7;padding:.6em;overflow:auto}
"""

SORT_SCRIPT = """
document.querySelectorAll('table.sortable th').forEach(function (th, column) {
  th.addEventListener('click', function () {
    var body = th.closest('table').tBodies[0];
    var rows = Array.prototype.slice.call(body.rows);
    var up = th.dataset.order !== 'asc';
    th.dataset.order = up ? 'asc' : 'desc';
    rows.sort(function (a, b) {
      var x = a.cells[column].dataset.v || a.cells[column].textContent;
      var y = b.cells[column].dataset.v || b.cells[column].textContent;
      var nx = parseFloat(x), ny = parseFloat(y);
      var c = (isNaN(nx) || isNaN(ny)) ? x.localeCompare(y) : nx - ny;
      return up ? c : -c;
    });
    rows.forEach(function (row) { body.appendChild(row); });
  });
});
"""


def esc(value: Any) -> str:
    return html.escape(str(value), quote=True)


def number(value: Any, percent: bool = False) -> str:
    if value is None:
        return NOT_YET
    if isinstance(value, float):
        return f"{value:.2%}" if percent else f"{value:.4g}"
    return str(value)


def note(text: str) -> str:
    return f'<p class="note">{esc(text)}</p>'


def facts_table(rows: list[tuple[str, str]], key: str) -> str:
    """A two-column table; values already HTML."""
    body = "".join(f"<tr><td>{esc(k)}</td><td data-key=\"{esc(k)}\">{v}</td></tr>" for k, v in rows)
    return f'<table class="facts" id="{key}">{body}</table>'


def svg(fig: Any) -> str:
    """A matplotlib figure as inline SVG (text kept as text; no XML header, no external reference)."""
    import matplotlib.pyplot as plt

    out = io.StringIO()
    try:
        fig.savefig(out, format="svg", metadata={"Date": None, "Creator": None})
    finally:
        plt.close(fig)
    text = re.sub(r"<metadata>.*?</metadata>", "", out.getvalue(), flags=re.DOTALL)  # RDF's namespace URLs
    return f'<div class="svg">{text[text.index("<svg"):]}</div>'


def read_json(path: Path) -> dict[str, Any] | None:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


# -- the run at a glance ---------------------------------------------------------------------------


def wall_seconds(records: list[dict]) -> float | None:
    """From the run's start (its first record's time less the start-up before it) to its last record."""
    times = [r["time"] for r in records if isinstance(r.get("time"), int | float)]
    if not times:
        return None
    startup = next((r["startup_seconds"].get("total", 0.0) for r in records if r.get("split") == "startup"),
                   0.0)
    return max(times) - min(times) + startup


def glance(run_dir: Path, summary: dict[str, Any], records: list[dict]) -> str:
    config_path = run_dir / "config.toml"
    cfg = parse_toml(read_text(config_path), str(config_path)) if config_path.is_file() else {}
    dataset = read_json(run_dir / "dataset.json") or {}
    result = read_json(run_dir / "result.json") or {}
    model = cfg.get("model", {})
    wall, epochs = wall_seconds(records), cfg.get("train", {}).get("epochs", "?")
    rows = [
        ("data set", esc(dataset.get("name") or cfg.get("data", {}).get("dataset", NOT_YET))),
        ("model", esc(model.get("name", NOT_YET))),
        ("world size", esc(result.get("world_size", NOT_YET))),
        ("precision", esc(cfg.get("train", {}).get("precision", NOT_YET))),
        ("state", "finished" if summary["finished"] else
         f"running or stopped: {summary['epochs_done']} epoch(s) of {epochs}"),
        ("final top-1 (model)", number(summary["top1"], True)),
        ("final top-1 (EMA)", number(summary["ema_top1"], True)),
        ("best top-1", f"{number(summary['best_top1'], True)} ({esc(summary['weights'])} weights, "
                       f"epoch {number(summary['best_epoch'])})"),
        ("wall time", NOT_YET if wall is None else f"{wall:.1f} s"),
        ("images/s (median of windows)", number(summary["images_per_second"])),
        ("MFU (median of windows)", number(summary.get("mfu"), True) if summary.get("mfu") is not None
         else "not reported (see docs/performance.md)"),
    ]
    if result.get("peak_source"):
        peak = f"{result['peak_flops'] / 1e9:,.0f} GFLOP/s per device ({esc(result['peak_source'])})"
        rows.append(("MFU's peak", peak))
    recipe = "".join(f"<h3>[{esc(name)}]</h3>"
                     + facts_table([(k, esc(json.dumps(v))) for k, v in part.items()], name)
                     for name, part in cfg.items() if isinstance(part, dict))
    top = "".join(f"<tr><td>{esc(k)}</td><td>{esc(json.dumps(v))}</td></tr>" for k, v in cfg.items()
                  if not isinstance(v, dict))
    recipe = (f"<details><summary>the resolved recipe (config.toml)</summary><table>{top}</table>{recipe}"
              "</details>") if cfg else note("no config.toml yet")
    return section("glance", "The run at a glance", facts_table(rows, "glance-facts") + recipe)


def section(key: str, title: str, body: str) -> str:
    return f'<section id="{key}"><h2>{esc(title)}</h2>{body}</section>'


# -- curves ----------------------------------------------------------------------------------------


def curves(records: list[dict]) -> str:
    train = [r for r in records if r.get("split") == "train"]
    if not train:
        return section("curves", "Curves", note(f"{NOT_YET}: no training window logged"))
    start = min(r["time"] for r in records if "time" in r)
    body = "".join(f"<h3>over {label}</h3>" + svg(curve_figure(records, x, start)) for x, label in
                   (("step", "steps"), ("time", "wall time (minutes since the first record)")))
    waits = any("data_wait" in r for r in train)
    body += "" if waits else note("data-loading wait: not recorded in metrics.jsonl by training "
                                  "(`ddp bench step` measures it as the breakdown's data_ms)")
    return section("curves", "Curves", body)


def curve_figure(records: list[dict], x: str, start: float):
    """Loss, accuracy (model and EMA), LR, crop size, images/s and MFU against steps or wall time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def xs(rows: list[dict]) -> list[float]:
        return [r["step"] if x == "step" else (r["time"] - start) / 60 for r in rows]

    train = [r for r in records if r.get("split") == "train"]
    val = [r for r in records if r.get("split") == "val"]
    ema = [r for r in records if r.get("split") == "val_ema"]
    fig, axes = plt.subplots(2, 3, figsize=(13, 6.5), constrained_layout=True)
    (loss, acc, lr), (size, speed, mfu) = axes
    loss.plot(xs(train), [r["loss"] for r in train], label="train (epoch running mean)")
    loss.plot(xs(val), [r["loss"] for r in val], "o-", label="val")
    if ema:
        loss.plot(xs(ema), [r["loss"] for r in ema], "D-", label="val EMA")
    for rows, name, mark, color in ((val, "", "o", "C0"), (ema, "EMA ", "D", "C2")):  # top-5 dashed
        if rows:
            acc.plot(xs(rows), [r["top1"] for r in rows], f"{mark}-", color=color, label=f"{name}top-1")
            acc.plot(xs(rows), [r["top5"] for r in rows], f"{mark}--", color=color, alpha=0.6,
                     label=f"{name}top-5")
    lr.plot(xs(train), [r["lr"] for r in train])
    crops = {r["epoch"]: r["image_size"] for r in val if "image_size" in r}  # an epoch's, at its validation
    size.plot(xs(train), [crops.get(r["epoch"], math.nan) for r in train], ".-")
    speed.plot(xs(train), [r.get("images_per_second", math.nan) for r in train])
    mfu.plot(xs(train), [100 * r["mfu"] if "mfu" in r else math.nan for r in train])
    label = "step" if x == "step" else "minutes"
    loss.set(title="loss", xlabel=label, yscale="log")
    acc.set(title="validation accuracy", xlabel=label, ylim=(0, 1.02))
    lr.set(title="learning rate", xlabel=label)
    size.set(title="train crop (px; known at each epoch's end)", xlabel=label)
    speed.set(title="images/s (all ranks)", xlabel=label, ylim=(0, None))
    mfu.set(title="MFU (% of peak)" if any("mfu" in r for r in train) else "MFU: not reported",
            xlabel=label, ylim=(0, None))
    for ax in (loss, acc):
        if ax.lines:
            ax.legend(fontsize=8)
    for ax in axes.flat:
        ax.grid(alpha=0.3)
    return fig


# -- start-up and the step -------------------------------------------------------------------------


def startup(records: list[dict]) -> str:
    row = next((r for r in records if r.get("split") == "startup"), None)
    if row is None:
        body = note(f"{NOT_YET}: the first step has not ended")
    else:
        phases = {k: v for k, v in row["startup_seconds"].items() if k != "total"}
        total = row["startup_seconds"].get("total") or sum(phases.values()) or 1.0
        body = "<table class=\"startup\"><tr><th>phase</th><th>seconds</th><th></th></tr>" + "".join(
            f"<tr><td>{esc(k)}</td><td class=\"num\">{v:.3f}</td><td><div class=\"bar\" "
            f"style=\"width:{300 * v / total:.0f}px\"></div></td></tr>" for k, v in phases.items()) + \
            f"<tr><th>total</th><th class=\"num\">{total:.3f}</th><th></th></tr></table>"
    body += note("where a step's time goes (data wait, forward, backward, exposed all-reduce, optimizer) is "
                 "not recorded by training: metrics.jsonl holds each window's images/s and MFU; "
                 "`ddp bench step` times the parts of the same step")
    return section("startup", "Start-up and the step", body)


# -- classes ---------------------------------------------------------------------------------------


def per_class(evaluation: dict[str, Any] | None) -> str:
    if evaluation is None:
        return section("classes", "Per-class accuracy and confusion",
                       note(f"{NOT_YET}: no evaluation in the run dir (training writes one after each "
                            "validation; `ddp validate --per-class` too)"))
    head = "".join(f"<th>{h}</th>" for h in ("index", "synset", "description", "images", "top-1"))
    rows = "".join(
        f"<tr><td class=\"num\">{c['index']}</td><td>{esc(c['synset'])}</td><td>{esc(c['description'])}</td>"
        f"<td class=\"num\">{c['images']}</td>"
        f"<td class=\"num\" data-v=\"{-1 if c['top1'] is None else c['top1']}\">"
        f"{number(c['top1'], True) if c['top1'] is not None else '-'}</td></tr>"
        for c in evaluation["per_class"])
    body = (f"<p>{esc(evaluation['source'])}: {esc(evaluation['dataset'])} {esc(evaluation['split'])}, "
            f"{evaluation['images']} images, top-1 {evaluation['top1']:.2%}. Click a header to sort.</p>"
            f"<table class=\"sortable\" id=\"per-class\"><thead><tr>{head}</tr></thead><tbody>{rows}</tbody>"
            "</table>")
    if classes.shows_confusion(evaluation):
        body += "<h3>confusion matrix</h3>" + svg(confusion_figure(evaluation))
    else:
        body += note(f"confusion matrix: kept up to {classes.MAX_CONFUSION} classes")
    return section("classes", "Per-class accuracy and confusion", body)


def confusion_figure(evaluation: dict[str, Any]):
    require_extra("report", "ddp report's plot")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    side = max(4.5, 0.2 * len(evaluation["per_class"]) + 2.5)
    fig, ax = plt.subplots(figsize=(side + 1, side), constrained_layout=True)
    classes.draw_confusion(ax, evaluation)
    return fig


# -- the mistakes ----------------------------------------------------------------------------------


def find_predictions(run_dir: Path) -> Path | None:
    """The newest predictions CSV in the run dir (or its evaluations/): `ddp validate --predictions`'s."""
    found = []
    for path in [*run_dir.glob("*.csv"), *(run_dir / "evaluations").glob("*.csv")]:
        try:
            with path.open(newline="") as f:
                header = tuple(next(csv.reader(f), ()))
        except (OSError, UnicodeDecodeError, csv.Error):
            continue
        if header[:len(PREDICTIONS_HEADER)] == PREDICTIONS_HEADER:
            found.append(path)
    return max(found, key=lambda p: p.stat().st_mtime, default=None)


def read_mistakes(path: Path, names: Callable[[int], str]) -> tuple[int, list[dict[str, Any]]]:
    """(images in the file, the wrongly predicted ones: path, true and predicted class, confidence)."""
    wrong, total = [], 0
    with path.open(newline="") as f:
        for row in csv.DictReader(f):
            total += 1
            true, predicted = int(row["label"]), int(row["top1_index"])
            if true != predicted:
                wrong.append({"path": row["path"], "true": true, "predicted": predicted,
                              "true_name": names(true), "predicted_name": names(predicted),
                              "confidence": float(row["top1_probability"])})
    return total, wrong


class Pictures(Protocol):
    """The val images as small base64 JPEGs by their path (`data.thumbnails.Thumbnails`): `None` for one
    it cannot read, and `problem` saying why none can be."""

    problem: str

    def __call__(self, path: str) -> str | None: ...


def thumb(mistake: dict[str, Any], pictures: Pictures, caption: str) -> str:
    data = pictures(mistake["path"])
    image = f'<img alt="{esc(mistake["path"])}" src="data:image/jpeg;base64,{data}">' if data else \
        '<div class="note">(unreadable)</div>'
    return (f'<figure class="thumb" title="{esc(mistake["path"])}">{image}<figcaption>{esc(caption)}'
            "</figcaption></figure>")


def mistakes(run_dir: Path, predictions: Path | None, evaluation: dict[str, Any] | None,
             pictures: Pictures) -> str:
    title = "Images the model gets wrong"
    path = predictions or find_predictions(run_dir)
    if path is None:
        return section("mistakes", title, note(
            f"{NOT_YET}: no predictions; run `ddp validate --checkpoint RUN_DIR/checkpoints/best.pt "
            "--predictions RUN_DIR/predictions.csv` (or give --predictions FILE to `ddp report`)"))
    per_class = {c["index"]: c for c in evaluation["per_class"]} if evaluation else {}

    def names(index: int) -> str:
        c = per_class.get(index)
        return classes.short_name(c) if c else str(index)

    total, wrong = read_mistakes(path, names)
    pairs = Counter((m["true"], m["predicted"]) for m in wrong)
    body = (f"<p>{len(wrong)} of {total} images wrong in {esc(path.name)} (top-1 "
            f"{1 - len(wrong) / max(total, 1):.2%}).</p>")
    if pictures.problem:
        body += note(f"thumbnails: the data set could not be read ({pictures.problem})")
    body += "<h3>by (true, predicted) pair, most frequent first</h3>"
    for (true, predicted), count in pairs.most_common(PAIRS):
        shown = sorted((m for m in wrong if (m["true"], m["predicted"]) == (true, predicted)),
                       key=lambda m: -m["confidence"])[:PER_PAIR]
        body += (f'<div class="pair"><b>true {esc(names(true))} → predicted {esc(names(predicted))}</b>: '
                 f"{count} image(s)<br>"
                 + "".join(thumb(m, pictures, f"{m['confidence']:.0%}") for m in shown) + "</div>")
    body += "<h3>the most confident mistakes (often label errors)</h3><div>" + "".join(
        thumb(m, pictures, f"{m['true_name']} → {m['predicted_name']} {m['confidence']:.0%}")
        for m in sorted(wrong, key=lambda m: -m["confidence"])[:CONFIDENT]) + "</div>"
    return section("mistakes", title, body)


# -- the page --------------------------------------------------------------------------------------


def page(run_dir: Path, pictures: Pictures, predictions: Path | None = None,
         summary: dict[str, Any] | None = None) -> str:
    """The whole page as one string; `pictures` shows the mistakes' images."""
    require_extra("report", "ddp report's page")
    summary = summary or summarize(run_dir)
    load_records(run_dir)  # no metrics.jsonl: the one-line error of `ddp report`
    records = read_metrics(run_dir / "metrics.jsonl")
    evaluation = classes.latest_evaluation(run_dir)
    parts = [glance(run_dir, summary, records), curves(records), startup(records), per_class(evaluation),
             mistakes(run_dir, predictions, evaluation, pictures)]
    embedded = json.dumps(summary).replace("</", "<\\/")  # the JSON's numbers, for a script or a test
    return ("<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>ddp report: {esc(run_dir.name)}</title><style>{STYLE}</style></head><body>"
            f"<h1>{esc(run_dir.name)}</h1>"
            f"<script type=\"application/json\" id=\"summary\">{embedded}</script>"
            + "".join(parts) + f"<script>{SORT_SCRIPT}</script></body></html>")

