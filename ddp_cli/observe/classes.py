"""`ddp report`'s second picture: per-class top-1 and a confusion matrix from a run's newest evaluation.

Training writes `RUN_DIR/evaluation.json` after each validation and `ddp validate --per-class` one
`RUN_DIR/evaluations/<checkpoint stem>-<weights>.json` per checkpoint; the newest by `time` is shown.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ddp_cli.errors import require_extra
from ddp_cli.io import writing

MAX_BARS = 50  # up to this many classes every one gets a bar; beyond, the worst and the best only
WORST_BARS, BEST_BARS = 25, 5
MAX_CONFUSION = 50  # a bigger matrix is unreadable at any size that fits a screen
MAX_ANNOTATED = 15  # counts written into the cells up to this many classes
LABEL_CHARS, SHORT_CHARS = 32, 16
CLASS_KEYS = ("index", "synset", "description", "images", "top1")


def read_evaluation(path: Path) -> dict[str, Any] | None:
    """One evaluation file, or None when it cannot be read as one (a copy cut short, a stray file)."""
    try:
        evaluation = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError):
        return None
    return evaluation if well_formed(evaluation) else None


def well_formed(evaluation: Any) -> bool:
    """Whether `evaluation` holds, with their types, every key the summary and the figure read."""
    def number(value: Any) -> bool:
        return type(value) in (int, float)

    if not isinstance(evaluation, dict) or not all(number(evaluation.get(k)) for k in ("time", "top1")):
        return False
    if not all(isinstance(evaluation.get(k), str) for k in ("source", "dataset", "split")):
        return False
    per_class, confusion = evaluation.get("per_class"), evaluation.get("confusion")
    if not number(evaluation.get("images")) or not isinstance(per_class, list) or not all(
            isinstance(c, dict) and type(c.get("index")) is int and number(c.get("images"))
            and (number(c.get("top1")) or (c.get("top1") is None and not c["images"]))  # no image: no top-1
            and isinstance(c.get("synset"), str) and isinstance(c.get("description"), str)
            for c in per_class):
        return False
    return confusion is None or (isinstance(confusion, list) and len(confusion) == len(per_class) and all(
        isinstance(row, list) and len(row) == len(per_class) and all(map(number, row)) for row in confusion))


def latest_evaluation(run_dir: Path) -> dict[str, Any] | None:
    """The newest (by its `time`) of training's evaluation.json and `ddp validate`'s evaluations/*.json."""
    paths = [run_dir / "evaluation.json", *sorted((run_dir / "evaluations").glob("*.json"))]
    found = [e for e in map(read_evaluation, paths) if e is not None]
    return max(found, key=lambda e: e["time"], default=None)


def ranked(per_class: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Classes worst first (a tie in index order); a class without validation images has no accuracy."""
    return sorted((c for c in per_class if c["images"]), key=lambda c: c["top1"])


def worst_classes(evaluation: dict[str, Any], count: int = 5) -> list[dict[str, Any]]:
    return [{key: c[key] for key in CLASS_KEYS} for c in ranked(evaluation["per_class"])[:count]]


def summary(evaluation: dict[str, Any] | None) -> dict[str, Any]:
    """`ddp report`'s keys about classes: the evaluation's source (None without one), its worst classes."""
    if evaluation is None:
        return {"evaluation": None}
    return {"evaluation": evaluation["source"], "worst_classes": worst_classes(evaluation)}


def describe(rows: list[dict[str, Any]]) -> str:
    """`worst_classes` for people: one class a line, not a JSON list."""
    return "\n".join(f"{label(r)}: {r['top1']:.1%} of {r['images']}" for r in rows)


def label(row: dict[str, Any]) -> str:
    """`index synset/description`, cut to fit a bar chart's margin."""
    text = f"{row['index']} {row['synset']}/{row['description']}" if row["description"] else \
        f"{row['index']} {row['synset']}"
    return truncate(text, LABEL_CHARS)


def short_name(row: dict[str, Any]) -> str:
    """A confusion-matrix tick: the index and the description's first name (ImageNet lists synonyms)."""
    name = row["description"].split(",")[0] if row["description"] else row["synset"]
    return truncate(f"{row['index']} {name}", SHORT_CHARS)


def truncate(text: str, chars: int) -> str:
    return text if len(text) <= chars else text[: chars - 1] + "…"


def bars(per_class: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], int]:
    """(classes to draw worst first, how many are left out): all of them, or the worst and the best."""
    order = ranked(per_class)
    if len(order) <= MAX_BARS:
        return order, 0
    return order[:WORST_BARS] + order[-BEST_BARS:], len(order) - WORST_BARS - BEST_BARS


def shows_confusion(evaluation: dict[str, Any]) -> bool:
    return evaluation.get("confusion") is not None and len(evaluation["per_class"]) <= MAX_CONFUSION


def figure(evaluation: dict[str, Any], title: str):
    """Per-class top-1 bars and, for few enough classes, the confusion matrix (headless matplotlib)."""
    require_extra("report", "ddp report's plot")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, hidden = bars(evaluation["per_class"])
    classes = len(evaluation["per_class"])
    height = max(3.5, 0.24 * len(rows) + 1.8)
    if shows_confusion(evaluation):
        side = max(4.5, 0.2 * classes + 2.5)
        fig, (bar_ax, matrix_ax) = plt.subplots(1, 2, figsize=(7.5 + side + 1, max(height, side)),
                                                width_ratios=(7.5, side + 1), constrained_layout=True)
        draw_confusion(matrix_ax, evaluation)
    else:
        fig, bar_ax = plt.subplots(figsize=(8, height), constrained_layout=True)
    draw_bars(bar_ax, rows, hidden, evaluation["top1"])
    fig.suptitle(f"{title}: {evaluation['source']} ({evaluation['dataset']} {evaluation['split']}, "
                 f"{evaluation['images']} images, {classes} classes)")
    return fig


def draw_bars(ax, rows: list[dict[str, Any]], hidden: int, top1: float) -> None:
    """Worst at the top, red below the overall top-1 (dashed); each bar says its accuracy and image count."""
    y = list(range(len(rows)))
    ax.barh(y, [r["top1"] for r in rows], color=["tab:red" if r["top1"] < top1 else "tab:blue" for r in rows])
    for i, r in zip(y, rows, strict=True):
        ax.text(r["top1"] + 0.01, i, f"{r['top1']:.1%} ({r['images']})", va="center", fontsize=7)
    ax.axvline(top1, color="black", linestyle="--")
    ax.set_yticks(y, [label(r) for r in rows], fontsize=7)
    ax.set(xlim=(0, 1.22), ylim=(len(rows) - 0.5, -0.5), xlabel="top-1 (images)")
    ax.set_xticks([0, 0.25, 0.5, 0.75, 1.0])
    shown = "worst first"
    if hidden:
        ax.axhline(WORST_BARS - 0.5, color="grey", linewidth=0.8)
        shown = f"worst {WORST_BARS} and best {BEST_BARS}, {hidden} classes not shown"
    ax.set_title(f"per-class top-1 ({shown}; dashed: overall {top1:.1%})", fontsize=10)
    ax.grid(axis="x", alpha=0.3)


def draw_confusion(ax, evaluation: dict[str, Any]) -> None:
    """Rows normalised to sum to 1, so a small class's mistakes show as plainly as a big one's."""
    import numpy as np

    counts = np.asarray(evaluation["confusion"], dtype=float)
    totals = counts.sum(axis=1, keepdims=True)
    share = np.divide(counts, totals, out=np.zeros_like(counts), where=totals > 0)
    image = ax.imshow(share, cmap="Blues", vmin=0, vmax=1)
    ax.figure.colorbar(image, ax=ax, shrink=0.8, label="share of the true class")
    names = [short_name(r) for r in evaluation["per_class"]]
    ticks = range(len(names))
    size = 8 if len(names) <= MAX_ANNOTATED else 6
    ax.set_xticks(ticks, names, rotation=90, fontsize=size)
    ax.set_yticks(ticks, names, fontsize=size)
    ax.set(title="confusion (rows: true class)", xlabel="predicted", ylabel="true")
    if len(names) <= MAX_ANNOTATED:
        for (t, p), n in np.ndenumerate(counts):
            if n:
                ax.text(p, t, f"{n:.0f}", ha="center", va="center", fontsize=7,
                        color="white" if share[t, p] > 0.5 else "black")


def plot(run_dir: Path, out: Path) -> Path | None:
    """The picture of the run's newest evaluation at `out`; None (nothing written) without one."""
    evaluation = latest_evaluation(run_dir)
    if evaluation is None:
        return None
    return save_figure(figure(evaluation, run_dir.name), out)


def save_figure(fig: Any, out: Path) -> Path:
    """`fig` written to `out` (a refused write: exit 6, `io.writing`) and closed whatever happened; the
    report's pictures, this one and `report.plot`'s, are saved so."""
    import matplotlib.pyplot as plt

    try:
        with writing(out):
            out.parent.mkdir(parents=True, exist_ok=True)
            fig.savefig(out, dpi=110)
    finally:
        plt.close(fig)
    return out
