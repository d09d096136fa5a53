#!/usr/bin/env bash
# BENCHMARKS.md, "Sweeps": a 12-trial sweep over the demo's recipe (configs/demo-space.toml: 5 keys, TPE,
# ASHA at epoch ends), its wall time and pruned share, then its best config and the shipped demo config
# each trained once with `ddp train`, their val top-1 side by side.
#   benchmarks/sweep_demo.sh [OUT]      (DDP="python -m ddp_cli" to run from a checkout)
set -euo pipefail
out=${1:-runs/bench-sweep}
ddp=${DDP:-ddp}
rm -rf "$out"
mkdir -p "$out"
start=$(date +%s)
$ddp sweep configs/demo.toml --space configs/demo-space.toml --trials 12 --sweep-dir "$out/sweep" --json \
    > "$out/sweep.json"
echo "sweep_seconds=$(( $(date +%s) - start ))" | tee "$out/times.txt"
$ddp train "$out/sweep/best.toml" --run-dir "$out/best" --json --quiet > "$out/best.json"
$ddp train configs/demo.toml --run-dir "$out/shipped" --json --quiet > "$out/shipped.json"
python3 - "$out" <<'PY'
import json, sys
out = sys.argv[1]
sweep = json.load(open(f"{out}/sweep.json"))
best, shipped = (json.loads(open(f"{out}/{n}.json").read().splitlines()[-1]) for n in ("best", "shipped"))
trials = sweep["trials"]
print(json.dumps({"trials": trials, "pruned_share": trials["pruned"] / sum(trials.values()),
                  "best_params": sweep["best"]["params"], "sweep_best_value": sweep["best"]["value"],
                  "best_config_top1": best["final"]["top1"], "shipped_top1": shipped["final"]["top1"]}, indent=1))
PY
