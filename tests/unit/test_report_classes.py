"""`ddp report`'s per-class picture: which evaluation it reads, what it ranks, what it draws and when."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from PIL import Image
from typer.testing import CliRunner

from ddp_cli.cli import app
from ddp_cli.observe import classes
from ddp_cli.observe.report import summarize

METRICS = [{"split": "train", "epoch": 1, "step": 4, "loss": 1.2, "lr": 0.1, "images_per_second": 90.0},
           {"split": "val", "epoch": 1, "step": 4, "loss": 0.5, "top1": 0.8, "top5": 0.95}]
OLD_KEYS = {"run_dir", "finished", "epochs_done", "steps", "last_train_loss", "last_lr", "top1", "top5",
            "val_loss", "best_top1", "best_epoch", "images_per_second", "mfu", "plot"}
EMA_KEYS = {"ema_top1", "ema_top5", "ema_val_loss", "weights"}  # the EMA beside the trained weights


@pytest.fixture(autouse=True)
def close_figures():
    """The figures these tests inspect are never saved; matplotlib keeps them until closed."""
    yield
    import matplotlib.pyplot as plt

    plt.close("all")


def make_run(path: Path) -> Path:
    path.mkdir(parents=True)
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in METRICS))
    return path


def evaluation(accuracies: list[float], source: str = "train epoch 1", time: float = 1.0,
               confusion: bool = True) -> dict:
    """An evaluation of 10 images a class whose class i gets accuracies[i] right (the rest: class 0)."""
    n = len(accuracies)
    right = [round(a * 10) for a in accuracies]
    matrix = [[0] * n for _ in range(n)]
    for t, r in enumerate(right):
        matrix[t][t] += r
        matrix[t][(t + 1) % n] += 10 - r
    per_class = [{"index": i, "synset": f"n{i:08d}", "description": f"thing {i}, a synonym",
                  "images": 10, "top1": r / 10} for i, r in enumerate(right)]
    return {"source": source, "checkpoint": None, "weights": "model", "dataset": "demo", "split": "val",
            "images": 10 * n, "top1": sum(right) / (10 * n), "time": time, "per_class": per_class,
            "confusion": matrix if confusion else None}


def write(path: Path, value: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(value))


def test_the_newest_evaluation_by_its_time_is_chosen_not_by_name_or_file_age(tmp_path):
    run = make_run(tmp_path / "run")
    perfect = [1.0] * 3
    write(run / "evaluations" / "best-ema.json", evaluation(perfect, "validate best.pt --weights ema", 300.0))
    write(run / "evaluations" / "last-model.json", evaluation(perfect, "validate last.pt", 100.0))
    write(run / "evaluation.json", evaluation(perfect, "train epoch 8", 200.0))  # written last
    (run / "evaluations" / "zz-model.json").write_text('{"source": "validate zz.pt", "ti')  # half-written
    assert classes.latest_evaluation(run)["source"] == "validate best.pt --weights ema"
    write(run / "evaluation.json", evaluation(perfect, "train epoch 9", 400.0))
    assert classes.latest_evaluation(run)["source"] == "train epoch 9"
    assert summarize(run)["evaluation"] == "train epoch 9"


def test_worst_classes_are_the_five_worst_worst_first(tmp_path):
    run = make_run(tmp_path / "run")
    accuracies = [0.9, 0.3, 1.0, 0.5, 0.3, 0.8, 0.1, 0.7, 0.6, 1.0]
    value = evaluation(accuracies)
    value["per_class"][6].update(images=0, top1=None)  # no validation image: no accuracy, not "the worst"
    write(run / "evaluation.json", value)
    worst = summarize(run)["worst_classes"]
    assert [c["index"] for c in worst] == [1, 4, 3, 8, 7]  # a tie keeps index order
    assert worst[0] == {"index": 1, "synset": "n00000001", "description": "thing 1, a synonym",
                        "images": 10, "top1": 0.3}


def test_confusion_is_drawn_only_when_there_is_one_of_at_most_50_classes():
    assert classes.shows_confusion(evaluation([0.5] * 10))
    assert classes.shows_confusion(evaluation([0.5] * 50))
    assert not classes.shows_confusion(evaluation([0.5] * 51))
    assert not classes.shows_confusion(evaluation([0.5] * 10, confusion=False))


def test_the_confusion_matrix_is_normalised_per_true_class_and_annotated_for_few_classes():
    value = evaluation([0.3, 1.0, 0.5, 0.8])
    bar_ax, matrix_ax, _colorbar = classes.figure(value, "run").axes
    shares = matrix_ax.images[0].get_array()
    assert shares.sum(axis=1).tolist() == pytest.approx([1.0] * 4)
    assert shares[0, 0] == pytest.approx(0.3) and shares[0, 1] == pytest.approx(0.7)
    assert sorted(t.get_text() for t in matrix_ax.texts) == sorted(["3", "7", "10", "5", "5", "8", "2"])
    assert [t.get_text() for t in matrix_ax.get_yticklabels()] == ["0 thing 0", "1 thing 1", "2 thing 2",
                                                                   "3 thing 3"]
    assert [t.get_text() for t in bar_ax.get_yticklabels()][0] == "0 n00000000/thing 0, a synonym"
    assert not classes.figure(evaluation([0.5] * 20), "run").axes[1].texts  # too many to annotate


def test_a_thousand_classes_show_the_worst_25_and_the_best_5():
    accuracies = [i / 1000 for i in range(1000)]
    random.Random(0).shuffle(accuracies)
    value = evaluation(accuracies, confusion=False)
    rows, hidden = classes.bars(value["per_class"])
    assert hidden == 970
    assert [r["top1"] for r in rows] == [r / 10 for r in sorted(round(a * 10) for a in accuracies)][:25] + \
        [1.0] * 5
    fig = classes.figure(value, "run")
    assert len(fig.axes) == 1 and len(fig.axes[0].patches) == 30
    labels = [t.get_text() for t in fig.axes[0].get_yticklabels()]
    assert len(labels) == 30 and max(map(len, labels)) <= classes.LABEL_CHARS
    assert "970 classes not shown" in fig.axes[0].get_title()


def test_report_json_writes_the_classes_png_beside_the_curves(tmp_path):
    run = make_run(tmp_path / "run")
    write(run / "evaluations" / "best-model.json", evaluation([0.2, 0.9, 0.6], "validate best.pt", 5.0))
    out = tmp_path / "pictures" / "curves.png"
    result = CliRunner().invoke(app, ["report", str(run), "--out", str(out), "--json"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary.keys() == OLD_KEYS | EMA_KEYS | {"classes_plot", "evaluation", "worst_classes"}
    assert summary["plot"] == str(out)
    assert summary["classes_plot"] == str(tmp_path / "pictures" / "curves-classes.png")
    assert summary["evaluation"] == "validate best.pt"
    assert [c["index"] for c in summary["worst_classes"]] == [0, 2, 1]
    with Image.open(summary["classes_plot"]) as image:
        assert image.format == "PNG" and image.width >= 800 and image.height >= 300


def test_a_run_without_evaluation_reports_as_before_with_null_keys(tmp_path):
    run = make_run(tmp_path / "run")
    result = CliRunner().invoke(app, ["report", str(run), "--json"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary.keys() == OLD_KEYS | EMA_KEYS | {"classes_plot", "evaluation"}
    assert summary["classes_plot"] is None and summary["evaluation"] is None
    assert (run / "report.png").is_file() and not (run / "report-classes.png").exists()
