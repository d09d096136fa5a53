"""Start-up to the first optimisation step at ImageNet scale, by phase (BENCHMARKS.md).

    python benchmarks/startup.py [--folder DIR] [--model resnet50] [--batch-size 8]
                                 [--workers 2] [--nproc 1] [--repeat 3]

Writes the metadata of real ImageNet size (ddp_cli/bench/metadata.py: 1,281,167
train rows, 50,000 val rows, 1,000 classes) and an image store in which every
listed path is a hard link to one 400x300 JPEG (links cost no inode and no
data; about 20 us each, so ~30 s once: pass --folder to keep the store between
runs), a data.toml naming it, then runs `ddp train` on it with
train.max_steps_per_epoch = 1 and reads the `startup` record (seconds by
phase, from the `ddp` process's start to the end of the first step) from the
run's metrics.jsonl. The run is then stopped with SIGTERM: validating 50,000
images on a CPU is not start-up.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image

from ddp_cli.bench.metadata import write_metadata
from ddp_cli.data.sources.imagenet_loc import LOC_TRAIN_LIST
from ddp_cli.observe.sinks import read_metrics

TRAIN, VAL = "ILSVRC/Data/CLS-LOC/train", "ILSVRC/Data/CLS-LOC/val"
POLL_S = 0.2
LINKS_PER_FILE = 60_000  # ext4 allows 65,000 links to one inode


def write_store(root: Path) -> None:
    """The metadata, and a hard link to one JPEG under every path it lists (once per folder)."""
    done = root / "store.done"
    if done.exists():
        return
    write_metadata(root)
    image = root / "one.jpg"
    pixels = np.random.default_rng(0).integers(0, 256, (300, 400, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(image, quality=90)
    train = [root / TRAIN / f"{line.split()[0]}.JPEG"
             for line in (root / LOC_TRAIN_LIST).read_text().splitlines()]
    val = [root / VAL / f"{row.split(',')[0]}.JPEG"
           for row in (root / "LOC_val_solution.csv").read_text().splitlines()[1:]]
    link_all(image, train + val)
    (root / "data.toml").write_text(
        'data_config_version = 1\n\n[[datasets]]\nname = "imagenet_synthetic"\nlayout = "imagenet-loc"\n'
        f'    [datasets.storage]\n    driver = "FileSystem"\n    path = "{root}"\n')
    done.touch()


def link_all(image: Path, targets: list[Path]) -> None:
    """A hard link to `image` at each target, from a fresh copy every LINKS_PER_FILE (ext4's limit);
    links already there (an interrupted earlier call) are kept."""
    folder = None
    for i, target in enumerate(targets):
        if i % LINKS_PER_FILE == 0:
            source = image.with_name(f"{image.stem}-{i // LINKS_PER_FILE}{image.suffix}")
            shutil.copyfile(image, source)
        if target.parent != folder:
            folder = target.parent
            folder.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileExistsError):
            os.link(source, target)


def first_step(root: Path, run_dir: Path, args: argparse.Namespace) -> dict:
    """One `ddp train` to its first step: its startup record and loader choice."""
    command = [sys.executable, "-m", "ddp_cli", "train", "configs/resnet50.toml", "--quiet",
               "--registry", str(root / "data.toml"), "--run-dir", str(run_dir),
               "--nproc-per-node", str(args.nproc),
               "--set", 'data.dataset="imagenet_synthetic"', "--set", f"model.name={args.model}",
               "--set", f"data.batch_size={args.batch_size}", "--set", f"data.workers={args.workers}",
               "--set", "train.epochs=1", "--set", "train.max_steps_per_epoch=1",
               "--set", "train.precision=fp32", "--set", "logging.every_steps=1"]
    proc = subprocess.Popen(command, cwd=Path(__file__).resolve().parents[1])
    metrics = run_dir / "metrics.jsonl"
    try:
        while proc.poll() is None:
            records = read_metrics(metrics) if metrics.exists() else []
            startup = next((r for r in records if r.get("split") == "startup"), None)
            if startup:
                config = (run_dir / "config.toml").read_text()
                return {"startup_seconds": startup["startup_seconds"],
                        "workers": next(line for line in config.splitlines() if line.startswith("workers"))}
            time.sleep(POLL_S)
        raise SystemExit(f"ddp train exited with {proc.returncode} before its first step")
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--folder", type=Path, help="the store (default: a temp dir, removed after)")
    parser.add_argument("--model", default="resnet50")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--workers", default="2", help='data.workers: a number or "auto"')
    parser.add_argument("--nproc", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = (args.folder or Path(tmp) / "store").resolve()
        root.mkdir(parents=True, exist_ok=True)
        started = time.perf_counter()
        write_store(root)
        print(f"store ready in {time.perf_counter() - started:.1f} s: {root}", file=sys.stderr)
        runs = [first_step(root, Path(tmp) / f"run{i}", args) for i in range(args.repeat)]
    phases = runs[0]["startup_seconds"].keys()
    median = {phase: statistics.median(r["startup_seconds"][phase] for r in runs) for phase in phases}
    print(json.dumps({"runs": runs, "median": median}, indent=2))


if __name__ == "__main__":
    main()
