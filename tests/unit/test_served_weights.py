"""The weights a run serves (best.pt's: the EMA's under checkpoint.best_metric = "ema_top1") are the ones
every reader of the run reports: the console's table and done line, `train --json`, `ddp report`'s
summary and plot, and a sweep's objective. best_top1 means one thing everywhere: the top-1 of best.pt's
weights, the best epoch's."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from ddp_cli.cli.render import print_train_summary
from ddp_cli.observe.console import RunConsole
from ddp_cli.observe.report import figure, summarize
from ddp_cli.sweep.study import objective_value
from ddp_cli.train.trainer import Trainer

# the trained weights peak at epoch 2 (0.95), their EMA at epoch 3 (0.93): the two best_top1 differ
MODEL = [(1, 0.60, 0.90, 1.1), (2, 0.95, 0.99, 0.3), (3, 0.70, 0.97, 0.8)]
EMA = [(1, 0.50, 0.85, 1.4), (2, 0.90, 0.98, 0.4), (3, 0.93, 0.99, 0.35)]


def make_run(path: Path, best_metric: str | None, ema: bool = True) -> Path:
    """A run dir with train, val and (`ema`) val_ema records, and a config.toml naming `best_metric`."""
    path.mkdir(parents=True)
    rows = [{"split": "train", "epoch": e, "step": 4 * e, "loss": 1.0, "lr": 0.1, "images_per_second": 90.0}
            for e in (1, 2, 3)]
    for split, values in (("val", MODEL), ("val_ema", EMA if ema else [])):
        rows += [{"split": split, "epoch": e, "step": 4 * e, "top1": t1, "top5": t5, "loss": loss}
                 for e, t1, t5, loss in values]
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if best_metric:
        (path / "config.toml").write_text(f'name = "r"\n[checkpoint]\nbest_metric = "{best_metric}"\n')
    return path


@pytest.mark.parametrize(("best_metric", "ema", "weights", "best"), [
    ("ema_top1", True, "ema", (0.93, 3)),
    ("top1", True, "model", (0.95, 2)),  # an EMA kept, but best.pt judged by the trained weights
    (None, True, "ema", (0.93, 3)),  # no config.toml: resolve's default, the EMA's where there is one
    ("top1", False, "model", (0.95, 2)),
])
def test_report_best_top1_is_of_the_weights_best_pt_holds(tmp_path, best_metric, ema, weights, best):
    summary = summarize(make_run(tmp_path / "run", best_metric, ema))
    assert summary["weights"] == weights
    assert (summary["best_top1"], summary["best_epoch"]) == best
    assert (summary["top1"], summary["top5"], summary["val_loss"]) == (0.70, 0.97, 0.8)  # the last, trained
    assert (summary["ema_top1"], summary["ema_top5"], summary["ema_val_loss"]) == \
        ((0.93, 0.99, 0.35) if ema else (None, None, None))


@pytest.mark.parametrize(("best_metric", "value"), [("ema_top1", 0.93), ("top1", 0.95)])
def test_a_sweep_trial_is_valued_by_the_weights_its_best_pt_holds(tmp_path, best_metric, value):
    space = SimpleNamespace(metric="top1", direction="maximize")
    assert objective_value(make_run(tmp_path / "run", best_metric), space) == value
    assert objective_value(tmp_path / "none", space) is None  # a trial that wrote no metrics


def test_report_plot_draws_the_ema_beside_the_trained_weights_and_names_best_pts(tmp_path):
    import matplotlib.pyplot as plt

    fig = figure(make_run(tmp_path / "run", "ema_top1"))
    loss_ax, acc_ax = fig.axes[0], fig.axes[1]
    curves = {line.get_label(): list(line.get_ydata()) for line in acc_ax.get_lines()}
    assert curves["EMA top-1 (best.pt)"] == [0.50, 0.90, 0.93] and curves["top-1"] == [0.60, 0.95, 0.70]
    assert "val EMA (best.pt)" in [line.get_label() for line in loss_ax.get_lines()]
    plt.close(fig)
    fig = figure(make_run(tmp_path / "plain", "top1", ema=False))
    assert not [line for line in fig.axes[1].get_lines() if "EMA" in line.get_label()]
    plt.close(fig)


def table_text(console: RunConsole) -> tuple[list[str], list[list[str]]]:
    table = console.table()
    return [str(c.header) for c in table.columns], [list(map(str, c._cells)) for c in table.columns]


def test_console_table_has_an_ema_column_only_where_the_run_has_an_ema():
    console = RunConsole(False)
    row = {"epoch": 1, "train_loss": 1.0, "val_loss": 0.8, "top1": 0.7, "top5": 0.97, "seconds": 2.0,
           "images_per_second": 100.0, "skipped": 0}
    console.rows = [row]
    headers, _ = table_text(console)
    assert "EMA top-1" not in headers
    console.rows = [row | {"ema_top1": 0.93}]
    headers, cells = table_text(console)
    assert headers.index("EMA top-1") == headers.index("top-5") + 1  # beside the trained weights' top-1
    assert cells[headers.index("EMA top-1")] == ["0.93"]


RESULT = {"final": {"top1": 0.6936, "top5": 0.97, "loss": 0.9, "images": 359},
          "final_ema": {"top1": 0.9387, "top5": 0.995, "loss": 0.3, "images": 359}, "best_top1": 0.9387,
          "weights": "ema", "images_per_second": 853.0, "run_dir": "runs/r", "checkpoint": "runs/r/last.pt"}


def test_done_line_gives_the_served_weights_first_and_the_other_beside(capsys):
    print_train_summary(RESULT)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("done top-1 0.9387  top-5 0.9950  loss 0.3000 on 359 val images, EMA weights")
    assert "trained weights: top-1 0.6936" in lines[1]
    assert lines[2].startswith("best:       top-1 0.9387 (EMA weights")
    print_train_summary(RESULT | {"final_ema": None, "weights": "model", "best_top1": 0.6936})
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("done top-1 0.6936") and "trained weights" in lines[0]
    assert lines[1].startswith("best:       top-1 0.6936 (trained")


@pytest.mark.parametrize(("best_metric", "weights"), [("ema_top1", "ema"), ("top1", "model")])
def test_train_json_names_the_weights_best_top1_is_of(best_metric, weights):
    state = SimpleNamespace(history=[{"epoch": 1}], final={"top1": 0.7}, final_ema={"top1": 0.9},
                            best_top1=0.9, skipped_files=[], io_retries=0, world_sizes=[2])
    checkpoint = SimpleNamespace(best_metric=best_metric)
    trainer = SimpleNamespace(
        cfg=SimpleNamespace(train=SimpleNamespace(epochs=1), checkpoint=checkpoint),
        ctx=SimpleNamespace(world_size=2), precision="fp32", state=state, stopped_at=None,
        startup=SimpleNamespace(seconds=dict), objective=SimpleNamespace(summary=lambda last: {}),
        utilisation=None)
    summary = Trainer.summary(trainer, 100.0)
    assert summary["weights"] == weights and summary["best_top1"] == 0.9
