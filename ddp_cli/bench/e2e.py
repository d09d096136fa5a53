"""`ddp bench e2e`: wall time for a config to reach a val top-1 target, ddp against a torchrun script.

Both are whole commands timed from launch, start-up included, on the same
data set with the same model, epochs, per-worker batch, worker count and
loader processes:

- ddp: `ddp train CONFIG` with the config as it ships (its precision and
  memory format included), time to target read from `metrics.jsonl`;
- baseline: `e2e_baseline.py` under `torch.distributed.run`: PIL ImageFolder,
  torchvision transforms, DistributedSampler, the DDP tutorial's loop in fp32,
  with one of two recipes (`BASELINES`): `torchrun`, ddp's own recipe (LR,
  momentum, weight decay, warmup + cosine, crop scale) translated, so the two
  differ only in the engine; `reference`, torchvision's classification
  reference recipe (what a user starts from), so the two differ in engine and
  recipe: ddp's defaults are measured against the recipe they replace.

The two alternate over `rounds` so background load falls on both; each round
gets a fresh run dir. A run that misses the target counts as its full time,
flagged in its row (`reached`); the ratio is of the medians, ddp / baseline.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path
from statistics import median

from ddp_cli.bench.data import machine
from ddp_cli.config import RunConfig, config_from_dict, load_config
from ddp_cli.config.resolve import autos
from ddp_cli.data.registry import find_registry, load_registry
from ddp_cli.errors import DataError
from ddp_cli.run.launch import LaunchOptions, resolve_nproc

TIMEOUT_S = 1800


def run_timed(command: list[str], timeout: float = TIMEOUT_S) -> tuple[float, str]:
    """(start time, stdout) of a command that must succeed; stopped (SIGTERM, then SIGKILL) on timeout."""
    started = time.time()
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)  # launchers pass it on to their workers' own sessions
        try:
            proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
        raise DataError(f"bench e2e: {command[2]} ran past {timeout:.0f} s") from None
    if proc.returncode:
        last = (err.strip().splitlines() or ["no output"])[-1]
        raise DataError(f"bench e2e: {' '.join(command[:4])} exited {proc.returncode}: {last}")
    return started, out


def outcome(name: str, started: float, curve: list[dict], target: float) -> dict:
    """Time to the first epoch at `target` (or the whole run if none), from per-epoch records; the curve
    as [epoch, seconds from launch, top-1] rows, to see where each recipe gains."""
    reached = next((r for r in curve if r["top1"] >= target), None)
    end = (reached or curve[-1])["time"]
    return {"pipeline": name, "to_target_s": end - started, "reached": reached is not None,
            "at_epoch": reached["epoch"] if reached else None,
            "total_s": curve[-1]["time"] - started, "final_top1": curve[-1]["top1"],
            "curve": [[r["epoch"], round(r["time"] - started, 1), r["top1"]] for r in curve]}


def run_ddp(config: Path, registry: Path, cfg: RunConfig, run_dir: Path, target: float) -> dict:
    """`ddp train` as shipped; its curve from metrics.jsonl, its resolved precision from its JSON."""
    started, out = run_timed([sys.executable, "-m", "ddp_cli", "train", str(config), "--registry",
                            str(registry), "--run-dir", str(run_dir), "--resume", "never",
                            "--set", f"train.epochs={cfg.train.epochs}", "--json", "--quiet"])
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    ran = config_from_dict(tomllib.loads((run_dir / "config.toml").read_text()))  # resolved, as it ran
    judged = "val_ema" if ran.checkpoint.best_metric == "ema_top1" else "val"  # what the run gives the user
    curve = [r for r in records if r.get("split") == judged]
    return {**outcome("ddp", started, curve, target),
            "precision": json.loads(out.strip().splitlines()[-1])["precision"]}


def loader_processes(config: Path, registry: Path, cfg: RunConfig) -> int:
    """data.workers as ddp's run has it: as set, or resolved by its dry run, for the baseline to load with
    as many processes."""
    if "data.workers" not in autos(cfg):
        return cfg.data.workers
    _, out = run_timed([sys.executable, "-m", "ddp_cli", "train", str(config), "--registry", str(registry),
                        "--set", f"train.epochs={cfg.train.epochs}", "--dry-run", "--json"])
    return json.loads(out.strip().splitlines()[-1])["data_workers"]["workers"]


BASELINES = ("torchrun", "reference")
# torchvision's references/classification/train.py: --lr 0.1 for 256 images of global batch,
# momentum 0.9, --wd 1e-4; its StepLR (every 30 epochs) never steps in a short run
REFERENCE_LR_PER_256, REFERENCE_MOMENTUM, REFERENCE_WEIGHT_DECAY = 0.1, 0.9, 1e-4
REFERENCE_MIN_CROP_SCALE = 0.08  # RandomResizedCrop's default scale
REFERENCE_CROP_SHARE = 0.875  # val: Resize(224 / 0.875 = 256), CenterCrop(224)


def baseline_arguments(cfg: RunConfig, workers: int, baseline: str, loaders: int) -> list[str]:
    """The recipe arguments of e2e_baseline.py: ddp's recipe from `cfg` (`torchrun`) or torchvision's
    reference recipe at `cfg`'s model, data, epochs, image size and per-worker batch (`reference`), with
    as many `loaders` processes per worker as ddp's run."""
    data, optim = cfg.data, cfg.optim
    common = ["--model", cfg.model.name, "--epochs", str(cfg.train.epochs),
              "--batch-size", str(data.batch_size), "--workers", str(loaders),
              "--image-size", str(data.image_size), "--seed", str(cfg.seed),
              *(["--hflip"] if data.hflip else [])]
    if baseline == "torchrun":
        return [*common, "--val-resize", str(data.val_resize), "--min-crop-scale", str(data.min_crop_scale),
                "--lr", str(cfg.lr(workers)), "--momentum", str(optim.momentum),
                "--weight-decay", str(optim.weight_decay),
                "--warmup-epochs", str(cfg.schedule.warmup_epochs)]
    if baseline == "reference":
        lr = REFERENCE_LR_PER_256 * workers * data.batch_size / 256
        return [*common, "--val-resize", str(round(data.image_size / REFERENCE_CROP_SHARE)),
                "--min-crop-scale", str(REFERENCE_MIN_CROP_SCALE), "--lr", str(lr),
                "--momentum", str(REFERENCE_MOMENTUM), "--weight-decay", str(REFERENCE_WEIGHT_DECAY),
                "--warmup-epochs", "0", "--schedule", "constant"]
    raise ValueError(f"baseline {baseline!r}: expected one of {', '.join(BASELINES)}")


def run_baseline(root: str, cfg: RunConfig, workers: int, target: float, baseline: str, loaders: int) -> dict:
    """The torchrun script with the `baseline` recipe (`baseline_arguments`)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={workers}", "-m", "ddp_cli.bench.e2e_baseline", "--root", root,
               *baseline_arguments(cfg, workers, baseline, loaders)]
    started, out = run_timed(command)
    curve = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    return {**outcome("baseline", started, curve, target), "precision": "fp32"}


def bench_e2e(config: Path, registry: str | None, target: float, rounds: int, epochs: int | None,
              baseline: str = "torchrun") -> dict:
    """Race `ddp train config` against the `baseline` script over `rounds`; `epochs` overrides the
    config's on both sides."""
    overrides = [f"train.epochs={epochs}"] if epochs else []
    cfg = load_config(config, overrides)
    registry_path = find_registry(registry)
    entry = load_registry(registry_path).get(cfg.data.dataset)
    if entry.storage.driver != "FileSystem":
        raise DataError(f"bench e2e: data set {entry.name!r} is on {entry.storage.driver}; the baseline "
                        "script reads local files, use a local data set")
    _, root = entry.open()
    workers = resolve_nproc(LaunchOptions(), cfg.distributed)
    loaders = loader_processes(config, registry_path, cfg)
    rows = []
    with tempfile.TemporaryDirectory(prefix="ddp-bench-e2e-") as tmp:
        for r in range(rounds):
            for name in ("ddp", "baseline") if r % 2 == 0 else ("baseline", "ddp"):
                row = (run_ddp(config, registry_path, cfg, Path(tmp) / f"ddp-{r}", target)
                       if name == "ddp" else run_baseline(root, cfg, workers, target, baseline, loaders))
                rows.append({"round": r + 1, **row})
    medians = {name: median(row["to_target_s"] for row in rows if row["pipeline"] == name)
               for name in ("ddp", "baseline")}
    return {
        "bench": "e2e",
        "config": str(config),
        "baseline": baseline,
        "dataset": entry.name,
        "target_top1": target,
        "epochs": cfg.train.epochs,
        "world_size": workers,
        "loader_workers": loaders,
        "channels_last": cfg.model.channels_last,
        "rounds": rounds,
        "machine": machine(),
        "rows": rows,
        "median_to_target_s": medians,
        "all_reached": all(row["reached"] for row in rows),
        "ratio": medians["ddp"] / medians["baseline"],
    }
