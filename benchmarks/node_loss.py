"""Time for an elastic job to go on after losing launchers (docs/multi-node.md, "When a node fails").

    python benchmarks/node_loss.py [--tries 5] [--nodes 4] [--min-nodes 2] [--kill 2] [--nproc 1]
                                   [--kill-at 4] [--set KEY=VALUE ...]

Starts `--nodes` `ddp train` launchers of `--nproc` workers each on loopback (`--nnodes MIN:NODES
--max-restarts 3`, the demo at 8 px, a checkpoint every 2 steps), SIGKILLs the last `--kill` of them
(launcher and workers: machines gone) once train step `--kill-at` is logged, and times the loss
to the survivors' first train step in the smaller world: the first `train` record of metrics.jsonl
after the `world_size` record the Trainer logs on its world-size resume (records carry wall-clock
`time`). Every process is killed at the end of a try; a try that does not go on within --timeout
seconds is reported as such (each try's run dir and launcher logs stay under --keep).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TINY = ("data.image_size=8", "data.val_resize=8", "data.workers=0", "data.batch_size=8",
        "train.precision=fp32", "logging.every_steps=1", "train.epochs=50", "checkpoint.every_steps=2")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def registry(folder: Path) -> Path:
    """A registry naming the demo data set, written once under `folder`."""
    sys.path.insert(0, str(REPO))
    from ddp_cli.data.sources.demo import ensure_demo

    root = ensure_demo(folder / "demo")
    path = folder / "data.toml"
    path.write_text('data_config_version = 1\n\n[[datasets]]\nname = "demo"\nlayout = "imagenet-loc"\n'
                    'generator = "sklearn-digits"\n    [datasets.storage]\n    driver = "FileSystem"\n'
                    f'    path = "{root}"\n')
    return path


def records(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [json.loads(line) for line in lines if line.endswith("}")]


def kill(proc: subprocess.Popen) -> None:
    """SIGKILL to the launcher's session (it and what it started in it) and to its workers, which the
    agent starts in sessions of their own (its children)."""
    with contextlib.suppress(OSError):
        kids = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
        for pid in map(int, kids):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


def one_try(args: argparse.Namespace, data: Path, folder: Path) -> dict:
    run_dir, endpoint = folder / "run", f"127.0.0.1:{free_port()}"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID"):
        env.pop(name, None)
    sets = [a for s in (*TINY, *args.set) for a in ("--set", s)]
    procs = []
    for rank in range(args.nodes):
        err = (folder / f"node{rank}.err").open("w")
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "ddp_cli", "train", "configs/demo.toml", "--registry", str(data), *sets,
             "--run-dir", str(run_dir), "--nnodes", f"{args.min_nodes}:{args.nodes}",
             "--node-rank", str(rank), "--rdzv-endpoint", endpoint, "--nproc-per-node", str(args.nproc),
             "--max-restarts", "3"],
            cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=err, start_new_session=True))
    try:
        deadline = time.monotonic() + args.timeout
        while not any(r.get("split") == "train" and r["step"] >= args.kill_at for r in records(run_dir)):
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                return {"error": "never reached the kill step"}
            time.sleep(0.1)
        killed = time.time()
        for proc in procs[args.nodes - args.kill:]:
            kill(proc)
        survivors = procs[:args.nodes - args.kill]
        deadline = time.monotonic() + args.timeout
        while time.monotonic() < deadline:
            rows = records(run_dir)
            resumed = next((i for i, r in enumerate(rows) if r.get("split") == "world_size"), None)
            first = next((r for r in rows[resumed:] if r.get("split") == "train"), None) \
                if resumed is not None else None
            if first:
                return {"went_on_s": round(first["time"] - killed, 1),
                        "resumed_s": round(rows[resumed]["time"] - killed, 1),
                        "world_size": rows[resumed]["world_size"], "step": first["step"]}
            if all(p.poll() is not None for p in survivors):
                return {"error": f"survivors exited {[p.returncode for p in survivors]}"}
            time.sleep(0.2)
        return {"error": f"no train step in the smaller world within {args.timeout} s"}
    finally:
        for proc in procs:
            kill(proc)
        for proc in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(10)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tries", type=int, default=5)
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--min-nodes", type=int, default=2)
    parser.add_argument("--kill", type=int, default=2)
    parser.add_argument("--nproc", type=int, default=1)
    parser.add_argument("--kill-at", type=int, default=4)
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--set", action="append", default=[], help="more --set KEY=VALUE for every launcher")
    parser.add_argument("--keep", help="a folder to keep each try's run dir and launcher logs in")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(args.keep or tmp)
        data = registry(base)
        times = []
        for i in range(args.tries):
            folder = base / f"try{i}"
            folder.mkdir(parents=True, exist_ok=True)
            outcome = one_try(args, data, folder)
            print(json.dumps({"try": i, **outcome}), flush=True)
            if "went_on_s" in outcome:
                times.append(outcome["went_on_s"])
        if times:
            print(json.dumps({"tries": args.tries, "went_on": len(times),
                              "median_s": statistics.median(times), "max_s": max(times)}))


if __name__ == "__main__":
    main()
