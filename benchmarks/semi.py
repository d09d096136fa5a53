"""The semi-supervised benchmark of BENCHMARKS.md ("Semi-supervised"): each method (FixMatch, FreeMatch,
SoftMatch) and supervised training on the same 10 labelled demo digits per class, the same labelled steps,
and the ceiling, in one run.

    python benchmarks/semi.py --json [--methods fixmatch,freematch,softmatch]

Runs `ddp train configs/demo-fixmatch.toml` once per method (`semi.method` set, the rest of the train split
unlabelled); with `semi.method = "none"` (the same 100 labelled images alone, the same epochs of the same
labelled batches) plus the supervised run's own best settings (`SUPERVISED`); and the same supervised
settings on every label of the train split, the same epochs (the ceiling: what FixMatch would reach if it
learnt every hidden label). It reports each one's val top-1 (last and best epoch), each method's mask rate
(SoftMatch's mean weight) and pseudo-label accuracy, the wall time of each command (start-up included), and
the share of the gap between the 100-label run and the ceiling that each method closes, (method -
supervised) / (ceiling - supervised). `--set KEY=VALUE` applies to every run.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

import tomli_w

REPO = Path(__file__).resolve().parent.parent
CONFIG = REPO / "configs/demo-fixmatch.toml"
# the supervised run's best settings found on these 100 labels (BENCHMARKS.md says how they were found):
# RandAugment (2 ops, magnitude 9) after the crop, as FixMatch's strong views have
SUPERVISED = ["semi.method=none", "augment.policy=randaugment"]
METHODS = ("fixmatch", "freematch", "softmatch")


def every_label(folder: Path) -> Path:
    """The recipe without `semi.labels_per_class` (no --set unsets a key): every train image labelled."""
    raw = tomllib.loads(CONFIG.read_text())
    del raw["semi"]["labels_per_class"]
    path = folder / "every-label.toml"
    path.write_text(tomli_w.dumps(raw))
    return path


def train(run_dir: Path, overrides: list[str], config: Path = CONFIG) -> tuple[dict, float]:
    """`ddp train` of `config` with `overrides`: its --json summary and its wall time in seconds."""
    sets = [arg for item in overrides for arg in ("--set", item)]
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "ddp_cli", "train", str(config), "--run-dir", str(run_dir),
                           "--json", *sets], cwd=REPO, capture_output=True, text=True, check=False)
    seconds = time.perf_counter() - started
    if done.returncode:
        sys.exit(f"ddp train {' '.join(sets)} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1]), seconds


def row(name: str, summary: dict, seconds: float) -> dict:
    last = summary["last_epoch"]
    return {"run": name, "top1": summary["final"]["top1"], "best_top1": summary["best_top1"],
            "epochs": summary["epochs"], "seconds": round(seconds, 1),
            **({"mask_rate": last["mask_rate"], "pseudo_label_top1": last["pseudo_label_top1"]}
               if "semi" in summary else {})}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                        help="a run config override for every run")
    parser.add_argument("--methods", default=",".join(METHODS),
                        help=f"the methods to run, comma-separated (default: {','.join(METHODS)})")
    parser.add_argument("--json", action="store_true", help="one JSON object on stdout")
    args = parser.parse_args()
    methods = args.methods.split(",")
    if unknown := set(methods) - set(METHODS):
        sys.exit(f"--methods: unknown {', '.join(sorted(unknown))}; choose from {', '.join(METHODS)}")
    with tempfile.TemporaryDirectory(prefix="semi-bench-") as tmp:
        supervised = row("supervised", *train(Path(tmp) / "supervised", [*args.sets, *SUPERVISED]))
        ceiling = row("all_labels", *train(Path(tmp) / "all-labels", [*args.sets, *SUPERVISED],
                                           every_label(Path(tmp))))
        rows = [row(method, *train(Path(tmp) / method, [*args.sets, f"semi.method={method}"]))
                for method in methods]
    gap = ceiling["top1"] - supervised["top1"]
    for r in rows:
        r["gap_closed"] = round((r["top1"] - supervised["top1"]) / gap, 3) if gap > 0 else None
    result = {"rows": [*rows, supervised, ceiling], "ceiling_points": round(100 * gap, 1),
              "best": max(rows, key=lambda r: r["top1"])["run"]}
    if args.json:
        print(json.dumps(result))
        return
    print("| run | val top-1 (last) | best | epochs | wall s | mask rate | pseudo-label top-1 | gap closed |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in result["rows"]:
        print(f"| {r['run']} | {r['top1']:.4f} | {r['best_top1']:.4f} | {r['epochs']} | {r['seconds']} | "
              f"{r.get('mask_rate', '')} | {r.get('pseudo_label_top1', '')} | {r.get('gap_closed', '')} |")
    print(f"every label is {result['ceiling_points']} points above the labelled few; best: {result['best']}")


if __name__ == "__main__":
    main()
