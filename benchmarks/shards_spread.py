"""How much the demo's top-1 moves with the seed, from the files and from shards packed at 16 px: the margin
tests/e2e/test_shards.py may allow between the two (BENCHMARKS.md, "Shards against files").

    python benchmarks/shards_spread.py /tmp/spread --seeds 6

Trains the session demo of the e2e tests (3 epochs at 8 px, 2 ranks, fp32: `TRAINED_DEMO_SETS`) once per
seed from each source, then validates each files-trained model on the shards' val split. Prints each run,
then per source the mean, the range and the standard deviation, the spread of a files-minus-shards
difference of one run each, and the largest change a model's top-1 saw from the files' val to the shards'.
Environment passes through: run it under `ONEDNN_MAX_CPU_ISA=AVX2` to see another CPU's kernels.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
from pathlib import Path

SETS = ("train.epochs=3", "train.ema_decay=0.9", "data.image_size=8", "data.val_resize=8", "data.workers=0",
        "train.precision=fp32")
REGISTRY = """data_config_version = 1
[[datasets]]
name = "demo"
layout = "imagenet-loc"
generator = "sklearn-digits"
storage = {{ driver = "FileSystem", path = "{root}/demo" }}
[[datasets]]
name = "shards"
storage = {{ driver = "FileSystem", path = "{root}/shards" }}
"""


def ddp(*args: str) -> dict:
    out = subprocess.run([sys.executable, "-m", "ddp_cli", *args, "--json"], capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(out.stderr[-2000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--seeds", type=int, default=6)
    args = parser.parse_args()
    root = args.folder.resolve()
    root.mkdir(parents=True, exist_ok=True)
    registry = root / "data.toml"
    registry.write_text(REGISTRY.format(root=root))
    if not (root / "shards/index.json").is_file():
        ddp("datasets", "pack", "demo", "--registry", str(registry), "--to", str(root / "shards"),
            "--max-side", "16", "--shard-size", "0.1")
    top1: dict[str, list[float]] = {"demo": [], "shards": []}
    moved = []
    for seed in range(args.seeds):
        for source in top1:
            run_dir = root / "runs" / f"{source}-{seed}"
            sets = [a for s in (*SETS, f"seed={seed}", f"data.dataset={source}") for a in ("--set", s)]
            result = ddp("train", "configs/demo.toml", "--registry", str(registry), "--run-dir", str(run_dir),
                         "--quiet", *sets)
            top1[source].append(result["final"]["top1"])
            print(f"seed {seed} {source:6} top-1 {top1[source][-1]:.4f}", flush=True)
        on_shards = ddp("validate", "--checkpoint", str(root / "runs" / f"demo-{seed}/checkpoints/last.pt"),
                        "--dataset", "shards", "--registry", str(registry))
        moved.append(round(abs(on_shards["top1"] - top1["demo"][-1]) * on_shards["images"]))
        print(f"seed {seed} files' model on the shards' val: {on_shards['top1']:.4f} "
              f"({moved[-1]} images moved)")
    for source, values in top1.items():
        print(f"{source:6} mean {statistics.mean(values):.4f} range {min(values):.4f}-{max(values):.4f} "
              f"sd {statistics.stdev(values):.4f}")
    gaps = [a - b for a, b in zip(top1["demo"], top1["shards"], strict=True)]
    spread = math.hypot(statistics.stdev(top1["demo"]), statistics.stdev(top1["shards"]))
    print(f"files - shards, one run each: largest {max(map(abs, gaps)):.4f}, sd {spread:.4f} (3 sd "
          f"{3 * spread:.4f}); validation moved at most {max(moved)} images")


if __name__ == "__main__":
    main()
