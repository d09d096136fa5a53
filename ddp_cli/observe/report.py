"""`ddp report`: a run's curves as one PNG and a short summary, even while it is still running.

The per-class picture beside it is ddp_cli/observe/classes.py's.
"""

from __future__ import annotations

import math
from pathlib import Path
from statistics import median
from typing import Any

from ddp_cli.errors import ConfigError, require_extra
from ddp_cli.observe import classes
from ddp_cli.observe.sinks import read_metrics


def load_records(run_dir: Path, split: str = "train") -> tuple[list[dict], list[dict]]:
    """(records of `split`, val records) from the run's metrics.jsonl."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise ConfigError(f"{run_dir}: no metrics.jsonl; give a run directory made by `ddp train`")
    records = read_metrics(path)
    return ([r for r in records if r.get("split") == split],
            [r for r in records if r.get("split") == "val"])


def semi_summary(run_dir: Path) -> dict[str, Any]:
    """FixMatch's last epoch (mask rate, pseudo-label accuracy), where the run had it on."""
    epochs, _ = load_records(run_dir, "semi")
    return {"semi": {k: epochs[-1].get(k) for k in ("mask_rate", "pseudo_label_top1")}} if epochs else {}


def summarize(run_dir: Path) -> dict[str, Any]:
    train, val = load_records(run_dir)
    best = max(val, key=lambda r: r["top1"], default=None)
    last = val[-1] if val else {}
    rates = [r["images_per_second"] for r in train if r.get("images_per_second")]
    return {
        "run_dir": str(run_dir),
        "finished": (run_dir / "result.json").is_file(),
        "epochs_done": len(val),
        "steps": train[-1]["step"] if train else 0,
        "last_train_loss": train[-1]["loss"] if train else None,
        "last_lr": train[-1]["lr"] if train else None,
        "top1": last.get("top1"),
        "top5": last.get("top5"),
        "val_loss": last.get("loss"),
        "best_top1": best["top1"] if best else None,
        "best_epoch": best["epoch"] if best else None,
        "images_per_second": median(rates) if rates else None,
        **classes.summary(classes.latest_evaluation(run_dir)),
        **semi_summary(run_dir),
    }


def figure(run_dir: Path):
    """Loss, accuracy, LR and throughput in a 2x2 matplotlib figure (headless)."""
    require_extra("report", "ddp report's plot")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train, val = load_records(run_dir)
    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5), constrained_layout=True)
    (loss_ax, acc_ax), (lr_ax, speed_ax) = axes
    steps = [r["step"] for r in train]
    loss_ax.plot(steps, [r["loss"] for r in train], label="train (epoch running mean)")
    loss_ax.plot([r["step"] for r in val], [r["loss"] for r in val], "o-", label="val")
    loss_ax.set(title="loss", xlabel="step", yscale="log")
    epochs = [r["epoch"] for r in val]
    acc_ax.plot(epochs, [r["top1"] for r in val], "o-", label="top-1")
    acc_ax.plot(epochs, [r["top5"] for r in val], "s--", label="top-5")
    acc_ax.set(title="validation accuracy", xlabel="epoch", ylim=(0, 1.02))
    acc_ax.xaxis.get_major_locator().set_params(integer=True)
    lr_ax.plot(steps, [r["lr"] for r in train])
    lr_ax.set(title="learning rate", xlabel="step")
    speed_ax.plot(steps, [r.get("images_per_second", math.nan) for r in train])
    speed_ax.set(title="training images/s (all ranks)", xlabel="step", ylim=(0, None))
    plot_semi(run_dir, train, loss_ax, acc_ax)
    for ax in (loss_ax, acc_ax):
        ax.legend()
    for ax in axes.flat:
        ax.grid(alpha=0.3)
    fig.suptitle(run_dir.name)
    return fig


def plot_semi(run_dir: Path, train: list[dict], loss_ax, acc_ax) -> None:
    """FixMatch's curves, where it was on: its two losses per step window beside the loss, and per epoch
    the mask rate and the pseudo-labels' accuracy beside validation's (all shares in [0, 1])."""
    windows = [r for r in train if "sup_loss" in r]
    if not windows:
        return
    steps = [r["step"] for r in windows]
    loss_ax.plot(steps, [r["sup_loss"] for r in windows], ":", label="supervised (window)")
    loss_ax.plot(steps, [max(r["unsup_loss"], 1e-6) for r in windows], ":", label="unlabelled (window)")
    epochs, _ = load_records(run_dir, "semi")
    numbers = [r["epoch"] for r in epochs]
    acc_ax.plot(numbers, [r["mask_rate"] for r in epochs], "^-", label="mask rate")
    acc_ax.plot(numbers, [math.nan if r["pseudo_label_top1"] is None else r["pseudo_label_top1"]
                          for r in epochs], "v-", label="pseudo-label top-1")


def classes_png(out: Path) -> Path:
    """Where the per-class picture goes: beside the curves, `report.png` -> `report-classes.png`."""
    return out.with_name(f"{out.stem}-classes.png")


def plot(run_dir: Path, out: Path) -> Path:
    return classes.save_figure(figure(run_dir), out)
