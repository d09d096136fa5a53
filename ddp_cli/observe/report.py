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
from ddp_cli.userfiles import parse_toml, read_text


def load_records(run_dir: Path, split: str = "train") -> tuple[list[dict], list[dict]]:
    """(records of `split`, val records) from the run's metrics.jsonl."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise ConfigError(f"{run_dir}: no metrics.jsonl; give a run directory made by `ddp train`")
    records = read_metrics(path)
    return ([r for r in records if r.get("split") == split],
            [r for r in records if r.get("split") == "val"])


def served(run_dir: Path, ema: list[dict]) -> str:
    """Whose top-1 best.pt tracks, so whose weights validate, predict and export serve: "ema" or "model",
    as the run's config.toml says (`checkpoint.best_metric`); for a run dir without one, resolve's rule
    (the EMA's where the run has one)."""
    path = run_dir / "config.toml"
    metric = (parse_toml(read_text(path), str(path)).get("checkpoint", {}).get("best_metric")
              if path.is_file() else None) or ("ema_top1" if ema else "top1")
    return "ema" if metric == "ema_top1" else "model"


def served_records(run_dir: Path) -> tuple[str, list[dict]]:
    """(`served`'s answer, the validation records of those weights): what best_top1 and a sweep's
    objective are read from."""
    _, val = load_records(run_dir)
    ema = load_records(run_dir, "val_ema")[0]
    weights = served(run_dir, ema)
    return weights, ema if weights == "ema" else val


def semi_summary(run_dir: Path) -> dict[str, Any]:
    """The semi-supervised method's last epoch, where the run had one on: its mask rate (SoftMatch's mean
    weight), pseudo-label accuracy, and its own statistics (FreeMatch's tau and per-class thresholds,
    SoftMatch's mu and sigma)."""
    epochs, _ = load_records(run_dir, "semi")
    if not epochs:
        return {}
    last = epochs[-1]
    return {"semi": {k: last.get(k) for k in ("mask_rate", "pseudo_label_top1", *SEMI_SIGNALS)
                     if k in last or k in ("mask_rate", "pseudo_label_top1")}}


def pretrain_summary(run_dir: Path) -> dict[str, Any]:
    """SimCLR's last epoch, where the run pre-trained (pretrain.method): the share of views whose most
    similar other view was their pair. Its val top-1 is the features' nearest class mean."""
    epochs, _ = load_records(run_dir, "pretrain")
    return {"pretrain": {"pair_top1": epochs[-1].get("pair_top1")}} if epochs else {}


SEMI_SIGNALS = {"freematch_tau": "FreeMatch tau", "class_thresholds": None, "softmatch_mu": "SoftMatch mu",
                "softmatch_sigma": None}  # the methods' own, in their `semi` rows; curves for the labelled


def summarize(run_dir: Path) -> dict[str, Any]:
    train, val = load_records(run_dir)
    ema = load_records(run_dir, "val_ema")[0]
    weights = served(run_dir, ema)
    best = max(ema if weights == "ema" else val, key=lambda r: r["top1"], default=None)
    last, last_ema = (val[-1] if val else {}), (ema[-1] if ema else {})
    rates = [r["images_per_second"] for r in train if r.get("images_per_second")]
    shares = [r["mfu"] for r in train if isinstance(r.get("mfu"), int | float)]
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
        "ema_top1": last_ema.get("top1"),
        "ema_top5": last_ema.get("top5"),
        "ema_val_loss": last_ema.get("loss"),
        "weights": weights,
        "best_top1": best["top1"] if best else None,  # of the weights best.pt holds, as result.json's
        "best_epoch": best["epoch"] if best else None,
        "images_per_second": median(rates) if rates else None,
        "mfu": median(shares) if shares else None,  # of the windows, as images/s (observe/mfu.py)
        **classes.summary(classes.latest_evaluation(run_dir)),
        **semi_summary(run_dir),
        **pretrain_summary(run_dir),
    }


def figure(run_dir: Path):
    """Loss, accuracy, LR and throughput in a 2x2 matplotlib figure (headless)."""
    require_extra("report", "ddp report's plot")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train, val = load_records(run_dir)
    ema = load_records(run_dir, "val_ema")[0]
    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5), constrained_layout=True)
    (loss_ax, acc_ax), (lr_ax, speed_ax) = axes
    steps = [r["step"] for r in train]
    loss_ax.plot(steps, [r["loss"] for r in train], label="train (epoch running mean)")
    loss_ax.plot([r["step"] for r in val], [r["loss"] for r in val], "o-", label="val")
    epochs = [r["epoch"] for r in val]
    acc_ax.plot(epochs, [r["top1"] for r in val], "o-", label="top-1")
    acc_ax.plot(epochs, [r["top5"] for r in val], "s--", label="top-5")
    plot_ema(ema, served(run_dir, ema), loss_ax, acc_ax)
    loss_ax.set(title="loss", xlabel="step", yscale="log")
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


def plot_ema(ema: list[dict], weights: str, loss_ax, acc_ax) -> None:
    """The EMA's validation beside the trained weights', where the run had one; the legend names the
    weights best.pt holds."""
    if not ema:
        return
    mark = " (best.pt)" if weights == "ema" else ""
    loss_ax.plot([r["step"] for r in ema], [r["loss"] for r in ema], "D-", label=f"val EMA{mark}")
    acc_ax.plot([r["epoch"] for r in ema], [r["top1"] for r in ema], "D-", label=f"EMA top-1{mark}")


def plot_semi(run_dir: Path, train: list[dict], loss_ax, acc_ax) -> None:
    """FixMatch's curves, where it was on: its two losses per step window beside the loss, and per epoch
    the mask rate and the pseudo-labels' accuracy beside validation's (all shares in [0, 1]); SimCLR's
    pair accuracy per epoch, where it pre-trained."""
    pretrain, _ = load_records(run_dir, "pretrain")
    if pretrain:
        acc_ax.plot([r["epoch"] for r in pretrain], [r["pair_top1"] for r in pretrain], "^-",
                    label="pair top-1 (SimCLR)")
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
    for key, label in SEMI_SIGNALS.items():
        if label and any(key in r for r in epochs):
            acc_ax.plot(numbers, [r.get(key, math.nan) for r in epochs], "x--", label=label)


def classes_png(out: Path) -> Path:
    """Where the per-class picture goes: beside the curves, `report.png` -> `report-classes.png`."""
    return out.with_name(f"{out.stem}-classes.png")


def plot(run_dir: Path, out: Path) -> Path:
    return classes.save_figure(figure(run_dir), out)
