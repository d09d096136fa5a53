"""The semi-supervised benchmark of BENCHMARKS.md ("Semi-supervised"): each method (FixMatch, FreeMatch,
SoftMatch, and SimCLR's features then supervised training or FreeMatch) and supervised training on the
same few labelled images per class, the same labelled steps, and the ceiling, on the demo digits or the
photo crops, in one run.

    python benchmarks/semi.py --json [--dataset digits|photos] [--labels 10] [--methods fixmatch,...]
    python benchmarks/semi.py --dataset photos --registry /tmp/photos64/data.toml --labels 2

Runs `ddp train` of the data set's config (digits: configs/demo-fixmatch.toml; photos:
benchmarks/photos-fixmatch.toml, its registry built by benchmarks/make_photo_crops.py as the config
says) once per method (`semi.method` set, `--labels` images per class labelled, the rest of the train
split unlabelled); with `semi.method = "none"` (the same labelled images alone, the same epochs of the
same labelled batches) plus the supervised run's own best settings (`SUPERVISED`); and the same
supervised settings on every label of the train split (the ceiling: what a method would reach if it
learnt every hidden label). Under fewer labels than the config's, the epochs grow so that the run takes
as many labelled steps as the config's own (each epoch has fewer); the ceiling keeps the config's epochs.
Each keeps the recipe ddp fits to its method (`ddp train --dry-run` says which keys and why).

It reports each run's val top-1 of the weights it serves (best.pt's kind: the EMA's where the run keeps
one) at the last epoch and the best, each method's mask rate (SoftMatch's mean weight) and pseudo-label
accuracy, the wall time of each command (start-up included), and the share of the gap between the
supervised run and the ceiling that each method closes, (method - supervised) / (ceiling - supervised).
`--set KEY=VALUE` applies to every run.

"simclr" is two runs: `pretrain.method = "simclr"` on the whole train split, its labels unread (the data
set's config without [semi], with `PRETRAIN`'s settings: 150 epochs of 128 images, SGD 0.5 after two
epochs of warm-up), then the supervised run's settings on the same labels and labelled steps from its
checkpoint (`model.weights`); "simclr+freematch" runs FreeMatch from the same checkpoint instead (the
stage runs once for both). Each such row's wall time is the stage's and its own.
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
CONFIGS = {"digits": REPO / "configs/demo-fixmatch.toml", "photos": REPO / "benchmarks/photos-fixmatch.toml"}
# the supervised run's best settings found on these labels (BENCHMARKS.md says how they were found):
# RandAugment (2 ops, magnitude 9) after the crop, as FixMatch's strong views have
SUPERVISED = ["semi.method=none", "augment.policy=randaugment"]
METHODS = ("fixmatch", "freematch", "softmatch", "simclr", "simclr+freematch")
# the SimCLR stage's settings over the data set's config (benchmarks/photos-simclr.toml: the same, as a file)
PRETRAIN = {"pretrain": {"method": "simclr"}, "data": {"batch_size": 128},
            "optim": {"lr": 0.5, "momentum": 0.9, "nesterov": True, "weight_decay": 5e-4},
            "schedule": {"name": "cosine", "warmup_epochs": 2}, "train": {"epochs": 150}}


class Bench:
    """One data set's runs: its config, registry and scratch folder."""

    def __init__(self, config: Path, registry: str | None, folder: Path, sets: list[str]) -> None:
        self.config, self.registry, self.folder, self.sets = config, registry, folder, sets

    def command(self, config: Path, overrides: list[str], *extra: str) -> list[str]:
        sets = [arg for item in [*self.sets, *overrides] for arg in ("--set", item)]
        registry = ["--registry", self.registry] if self.registry else []
        return [sys.executable, "-m", "ddp_cli", "train", str(config), *registry, "--json", *extra, *sets]

    def ddp(self, args: list[str]) -> tuple[dict, float]:
        """`ddp train` with `args`: its --json output and its wall time in seconds."""
        started = time.perf_counter()
        done = subprocess.run(args, cwd=REPO, capture_output=True, text=True, check=False)
        seconds = time.perf_counter() - started
        if done.returncode:
            sys.exit(f"{' '.join(args[2:])} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
        return json.loads(done.stdout.strip().splitlines()[-1]), seconds

    def steps_per_epoch(self, overrides: list[str]) -> int:
        return self.ddp(self.command(self.config, overrides, "--dry-run"))[0]["steps_per_epoch"]

    def train(self, name: str, overrides: list[str], config: Path | None = None) -> dict:
        summary, seconds = self.ddp(self.command(config or self.config, overrides, "--run-dir",
                                                 str(self.folder / name)))
        return row(name, summary, seconds)

    def pretrained(self) -> tuple[Path, float]:
        """The SimCLR stage's last checkpoint and its wall time: the config without [semi], `PRETRAIN` over
        it (`--set` still applies)."""
        raw = tomllib.loads(self.config.read_text())
        del raw["semi"]
        for section, keys in PRETRAIN.items():
            raw[section] = {**raw.get(section, {}), **keys}
        path = self.folder / "simclr.toml"
        path.write_text(tomli_w.dumps(raw))
        run_dir = self.folder / "simclr-stage"
        _, seconds = self.ddp(self.command(path, [], "--run-dir", str(run_dir)))
        return run_dir / "checkpoints/last.pt", seconds

    def every_label(self) -> Path:
        """The recipe without `semi.labels_per_class` (no --set unsets a key): every train image labelled."""
        raw = tomllib.loads(self.config.read_text())
        del raw["semi"]["labels_per_class"]
        path = self.folder / "every-label.toml"
        path.write_text(tomli_w.dumps(raw))
        return path


def row(name: str, summary: dict, seconds: float) -> dict:
    """A run's row: the top-1 of the weights it serves (`weights`: the EMA's or the trained ones)."""
    served = summary["final_ema"] if summary["weights"] == "ema" else summary["final"]
    last = summary["last_epoch"]
    return {"run": name, "top1": served["top1"], "best_top1": summary["best_top1"],
            "weights": summary["weights"], "epochs": summary["epochs"], "seconds": round(seconds, 1),
            **({"mask_rate": last["mask_rate"], "pseudo_label_top1": last["pseudo_label_top1"]}
               if "semi" in summary else {})}


def campaign(bench: Bench, labels: int, methods: list[str]) -> dict:
    """Every method, supervised on the same labels and the ceiling, and each method's share of the gap."""
    raw = tomllib.loads(bench.config.read_text())
    epochs = raw["train"]["epochs"]
    labelled = [f"semi.labels_per_class={labels}"]
    if labels != raw["semi"]["labels_per_class"]:  # as many labelled steps as the config's own run
        steps = bench.steps_per_epoch([])
        epochs = round(epochs * steps / bench.steps_per_epoch(labelled))
    labelled.append(f"train.epochs={epochs}")
    supervised = bench.train("supervised", [*labelled, *SUPERVISED])
    ceiling = bench.train("all_labels", SUPERVISED, bench.every_label())
    rows = [bench.train(method, [*labelled, f"semi.method={method}"]) for method in methods
            if not method.startswith("simclr")]
    if from_features := [method for method in methods if method.startswith("simclr")]:
        weights, seconds = bench.pretrained()  # one stage for every row that starts from it
        for method in from_features:  # "simclr": supervised from the features; "simclr+M": method M
            after = method.partition("+")[2]
            settings = [f"semi.method={after}"] if after else SUPERVISED
            rows.append(bench.train(method, [*labelled, *settings, f'model.weights="{weights}"']))
            rows[-1]["seconds"] = round(rows[-1]["seconds"] + seconds, 1)
    gap = ceiling["top1"] - supervised["top1"]
    for r in rows:
        r["gap_closed"] = round((r["top1"] - supervised["top1"]) / gap, 3) if gap > 0 else None
    return {"labels_per_class": labels, "rows": [*rows, supervised, ceiling],
            "ceiling_points": round(100 * gap, 1), "best": max(rows, key=lambda r: r["top1"])["run"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dataset", choices=sorted(CONFIGS), default="digits",
                        help="digits (the demo, built on first use) or photos (needs --registry)")
    parser.add_argument("--registry", help="the data set registry (data.toml) that holds --dataset")
    parser.add_argument("--labels", type=int, default=10, help="labelled images per class (default 10)")
    parser.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                        help="a run config override for every run")
    parser.add_argument("--methods", default=",".join(METHODS),
                        help=f"the methods to run, comma-separated (default: {','.join(METHODS)})")
    parser.add_argument("--json", action="store_true", help="one JSON object on stdout")
    args = parser.parse_args()
    methods = args.methods.split(",")
    if unknown := set(methods) - set(METHODS):
        sys.exit(f"--methods: unknown {', '.join(sorted(unknown))}; choose from {', '.join(METHODS)}")
    if args.dataset == "photos" and not args.registry:
        sys.exit("--dataset photos: give --registry PATH/data.toml (built as benchmarks/photos-fixmatch.toml "
                 "says)")
    if args.labels < 1:
        sys.exit(f"--labels {args.labels}: give at least 1 labelled image per class")
    with tempfile.TemporaryDirectory(prefix="semi-bench-") as tmp:
        bench = Bench(CONFIGS[args.dataset], args.registry, Path(tmp), args.sets)
        result = {"dataset": args.dataset, **campaign(bench, args.labels, methods)}
    if args.json:
        print(json.dumps(result))
        return
    print(f"{result['dataset']}, {result['labels_per_class']} labels per class")
    print("| run | val top-1 (last) | best | weights | epochs | wall s | mask rate | pseudo-label top-1 | "
          "gap closed |")
    print("| --- | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: |")
    for r in result["rows"]:
        print(f"| {r['run']} | {r['top1']:.4f} | {r['best_top1']:.4f} | {r['weights']} | {r['epochs']} | "
              f"{r['seconds']} | {r.get('mask_rate', '')} | {r.get('pseudo_label_top1', '')} | "
              f"{r.get('gap_closed', '')} |")
    print(f"every label is {result['ceiling_points']} points above the labelled few; best: {result['best']}")


if __name__ == "__main__":
    main()
