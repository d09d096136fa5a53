"""`make gpu-check`: prove in at most ten minutes that ddp trains on this machine's GPUs.

Every stage runs `ddp` as a user would (a subprocess, the shipped configs with
`--set`), within its own time budget and the whole check's (`TOTAL_S`): the
driver and build (`ddp env`), tests/cuda, ResNet-50 for two short epochs on
generated JPEGs (checkpoints every few steps, EMA), a resume from a mid-epoch
checkpoint, validate (`--per-class`, `--predictions`), predict and export, one
short epoch each with fp16, bf16, PowerSGD and SyncBatchNorm, `ddp bench step
--device cuda`: ddp's step against a bare DDP loop on the same tensors (images/s
and peak memory) and the host syncs in ddp's step, and the input stage:
ResNet-50 at 224 px, batch 256, bf16, channels-last, one GPU, fed from
ImageNet-like JPEGs (500x375, ~110 KB) with data.decode "cpu", "gpu" and "auto",
on the whole machine and pinned to 4 cores (an 8-GPU node's share of its cores
for one GPU), each against the same step on synthetic tensors (its goals:
`INPUT_GOAL`).
A stage that fails does not stop the others; one that needs a failed stage's
output is skipped, saying which. The outcome is one JSON report (its path is
printed) and a one-screen summary.

Exit 0: every stage held; 1: one or more did not; 2: no CUDA GPU here (nothing run).
    python tools/gpu_check.py [--out DIR] [--total-s S] [--stages driver,input]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
import tomllib
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
TOTAL_S = 600  # the whole check, every stage's budget capped by what is left of it
CLASSES, PER_CLASS, VAL = 10, 32, 64  # generated JPEGs: 320 train, 64 val
TRAIN_SETS = ('data.dataset="jpegs"', "data.batch_size=16", 'data.workers="auto"',
              "train.max_steps_per_epoch=8", "logging.every_steps=2")
EVERY = 3  # checkpoint.every_steps of the two-epoch run
BENCH = ("--device", "cuda", "--model", "resnet50", "--image-size", "224", "--batch-size", "64",
         "--world-size", "1", "--steps", "10", "--rounds", "3")
RATIO, RATIO_EMA, PEAK = 0.98, 0.97, 1.05  # ddp's step vs the bare loop: images/s, with EMA; peak memory
# The input stage: 512 ImageNet-like JPEGs under 48 names each (24,576 files: 96 steps of 256), 256 for val.
# The loader decodes workers x prefetch_factor batches ahead before the first step (30 with 15 workers):
# a run is timed after those (`steady_rate`), so it is well longer (24 steps on an H100 were all prefetched);
# 64 steps, not the epoch's 96: six runs share the stage's time, and on an H100 each spent ~60 s starting
INPUT_BATCH, INPUT_STEPS, INPUT_EVERY, INPUT_VAL = 256, 64, 4, 256
INPUT_JPEGS = ("--size", "500x375", "--classes", "8", "--per-class", "64", "--copies", "48",
               "--val", str(INPUT_VAL))
# LR 0.01 per 256: resnet50.toml's classic 0.1 sent the loss from 2.2 to 9.3 in one step of 256 on these
# pink-noise images (their labels carry nothing), and to NaN by step 4 on an H100; the stage times, not learns
INPUT_SETS = ('data.dataset="jpegs"', f"data.batch_size={INPUT_BATCH}", 'data.workers="auto"',
              "optim.lr_per_256=0.01", 'train.precision="bf16"', "model.channels_last=true", "train.epochs=1",
              f"train.max_steps_per_epoch={INPUT_STEPS}", f"logging.every_steps={INPUT_EVERY}")
INPUT_RUNS = {"cpu_decode": ('data.decode="cpu"',), "gpu_decode": ('data.decode="gpu"',),
              "auto_decode": ('data.decode="auto"',)}
# Each run twice: on every core, and pinned to PIN_CORES (a cloud 8 x A100 gives a GPU 6 cores, a DGX H100 14)
PIN_CORES = 4
# The goals, held where they apply (an H100-class GPU); reported everywhere
INPUT_GOAL = (f'on an H100-class GPU: pinned to {PIN_CORES} cores, "gpu" and "auto" decode >= 0.9x '
              'synthetic; on every core, "auto" within 5% of the faster of "cpu" and "gpu"')
GOAL_RATIO, AUTO_SHARE = 0.9, 0.95
H100_CLASS = ("H100", "H200", "H800", "H20", "GH200", "B100", "B200", "GB200")


class Failed(Exception):
    """A check that did not hold: its one line, and what the stage measured so far."""

    def __init__(self, message: str, data: dict | None = None) -> None:
        super().__init__(message)
        self.data = data or {}


class Skipped(Exception):
    """A stage that cannot mean anything on this machine (bf16 on a GPU without it): not a failure."""


@dataclass
class Outcome:
    stage: str
    status: str  # ok | failed | skipped | not run
    seconds: float
    budget_s: float
    detail: str
    data: dict = field(default_factory=dict)


class Monitor:
    """While a run goes: the CPU time of `cores` (all of them: None; /proc/stat, every 0.25 s) and the GPUs'
    memory in use (nvidia-smi, every 250 ms), for the busy share of a span of the run and its peak."""

    def __init__(self, cores: set[int] | None = None) -> None:
        self.cores = cores
        self.samples: list[tuple[float, int, int]] = []  # (time.time(), busy jiffies, all jiffies)
        self.memory: list[str] = []  # nvidia-smi's lines: MiB used per GPU
        self.done = threading.Event()

    def __enter__(self) -> Monitor:
        self.thread = threading.Thread(target=self.sample, daemon=True)
        self.thread.start()
        try:
            self.smi = subprocess.Popen(
                ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-lms", "250"],
                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        except OSError:
            self.smi = None
        return self

    def __exit__(self, *exc: Any) -> None:
        self.done.set()
        self.thread.join()
        if self.smi:
            self.smi.terminate()
            self.memory = self.smi.communicate()[0].splitlines()

    def sample(self) -> None:
        while not self.done.is_set():
            with contextlib.suppress(OSError):
                self.samples.append((time.time(), *cpu_jiffies(Path("/proc/stat").read_text(), self.cores)))
            self.done.wait(0.25)

    def busy_share(self, start: float, end: float) -> float | None:
        return busy_between(self.samples, start, end)

    def peak_mib(self) -> float | None:
        return peak_memory(self.memory)


def cpu_jiffies(stat: str, cores: set[int] | None = None) -> tuple[int, int]:
    """(busy, all) CPU time from /proc/stat: of every core (its first line), or summed over the `cpuN`
    lines of `cores` (a pinned run's); idle and iowait are not busy."""
    lines = stat.splitlines()
    if cores is None:
        rows = [lines[0]]
    else:
        rows = [line for line in lines if line.startswith("cpu") and line[3:].split(" ", 1)[0].isdigit()
                and int(line[3:].split(" ", 1)[0]) in cores]
    busy = total = 0
    for row in rows:
        values = [int(v) for v in row.split()[1:]]
        busy, total = busy + sum(values) - values[3] - values[4], total + sum(values)
    return busy, total


def usable_cores() -> list[int]:
    """The cores this process may run on (where the OS says; else none known)."""
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []


def pinned_cores(count: int = PIN_CORES) -> set[int] | None:
    """The first `count` cores this process may run on: what a pinned run is held to; None where it may
    use no more (nothing to pin: its runs would be the whole machine's)."""
    usable = usable_cores()
    return set(usable[:count]) if len(usable) > count else None


def busy_between(samples: list[tuple[float, int, int]], start: float, end: float) -> float | None:
    """The share of all cores busy from the last sample at or before `start` to the first at or after
    `end`; None if the samples do not span it."""
    before = [s for s in samples if s[0] <= start]
    after = [s for s in samples if s[0] >= end]
    if not before or not after or after[0][2] == before[-1][2]:
        return None
    (_, busy0, all0), (_, busy1, all1) = before[-1], after[0]
    return (busy1 - busy0) / (all1 - all0)


def peak_memory(lines: list[str]) -> float | None:
    """The most MiB in use on any GPU in nvidia-smi's samples."""
    values = [float(v) for line in lines for v in line.split(",") if v.strip().replace(".", "", 1).isdigit()]
    return max(values, default=None)


@dataclass
class Context:
    """What stages share: the work folder, each stage's results, the deadlines and the `ddp` runner."""

    work: Path
    results: dict[str, dict] = field(default_factory=dict)
    deadline: float = math.inf  # the running stage's: its budget or the whole check's, whichever is first
    clock: Callable[[], float] = time.monotonic
    monitor: Callable[..., Monitor] = Monitor  # what the input stage watches its runs with (of `cores`)

    def seconds_left(self) -> float:
        left = self.deadline - self.clock()
        if left <= 0:
            raise Failed("out of time (its budget)")
        return left

    def run(self, *argv: str, cores: set[int] | None = None) -> subprocess.CompletedProcess:
        """A command in its own process group, killed whole when the stage's time is up; with `cores`,
        held to them (`os.sched_setaffinity` before it starts: its workers and loader processes inherit
        it)."""
        proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
                                preexec_fn=pinning(cores))
        try:
            out, err = proc.communicate(timeout=self.seconds_left())
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            raise Failed(f"`{' '.join(argv[:4])} ...` ran out of the stage's time") from None
        return subprocess.CompletedProcess(argv, proc.returncode, out, err)

    def ddp(self, *args: str, cores: set[int] | None = None) -> Any:
        """`ddp ARGS... --json` as a user runs it (on `cores`, where given); its JSON (the last stdout
        line), or Failed with the error line."""
        done = self.run(*ddp_command(), *args, "--json", cores=cores)
        lines = done.stdout.strip().splitlines()
        if done.returncode != 0:
            why = lines[-1] if lines else (done.stderr.strip().splitlines() or ["no output"])[-1]
            raise Failed(f"ddp {args[0]} exited {done.returncode}: {why}")
        return json.loads(lines[-1])


def pinning(cores: set[int] | None) -> Callable[[], None] | None:
    """What a child runs before it starts to be held to `cores` (None: nothing, every core)."""
    if cores is None:
        return None
    return lambda: os.sched_setaffinity(0, cores)


def ddp_command() -> list[str]:
    """The `ddp` beside this Python (the venv's), else the module."""
    script = Path(sys.executable).with_name("ddp")
    return [str(script)] if script.exists() else [sys.executable, "-m", "ddp_cli"]


@dataclass(frozen=True)
class Stage:
    name: str
    budget_s: float
    check: Callable[[Context], tuple[str, dict]]  # (one line, data) or raises Failed / Skipped
    needs: tuple[str, ...] = ()


def run_stages(stages: list[Stage], ctx: Context, total_s: float = TOTAL_S) -> list[Outcome]:
    """Each stage within min(its budget, what is left of `total_s`); a stage's failure is its own."""
    end = ctx.clock() + total_s
    outcomes: list[Outcome] = []
    for stage in stages:
        started = ctx.clock()
        missing = [n for n in stage.needs if n not in ctx.results]
        if started >= end or missing:
            why = f"needs {', '.join(missing)}" if missing else f"the check's {total_s:.0f} s were spent"
            outcomes.append(Outcome(stage.name, "not run", 0.0, stage.budget_s, why))
            continue
        ctx.deadline = min(started + stage.budget_s, end)
        status, data = "ok", {}
        try:
            detail, data = stage.check(ctx)
            ctx.results[stage.name] = data
        except Failed as e:
            status, detail, data = "failed", str(e), e.data
        except Skipped as e:
            status, detail = "skipped", str(e)
        except Exception as e:  # noqa: BLE001 - a bug in one stage must not hide the others
            status, detail = "failed", f"{type(e).__name__}: {e}"
        outcomes.append(Outcome(stage.name, status, ctx.clock() - started, stage.budget_s, detail, data))
    return outcomes


def held(outcomes: list[Outcome]) -> bool:
    return all(o.status in ("ok", "skipped") for o in outcomes)


def require(condition: bool, message: str, data: dict) -> None:
    if not condition:
        raise Failed(message, data)


# ---- the stages -------------------------------------------------------------------------------------


def check_driver(ctx: Context) -> tuple[str, dict]:
    env = ctx.ddp("env")
    require(not env["gpu_problem"], f"{env['gpu_problem']}", env)
    require(env["cuda_available"] and env["gpus"], "torch sees no CUDA GPU", env)
    require(env["backends"]["nccl"], f"torch {env['torch']} has no NCCL", env)
    require(env["backend_auto"] == "nccl" and env["nproc_per_node_auto"] == len(env["gpus"]),
            f"auto settings: backend {env['backend_auto']}, {env['nproc_per_node_auto']} workers "
            f"for {len(env['gpus'])} GPUs", env)
    return (f"{len(env['gpus'])} x {env['gpus'][0].get('name', '?')}, torch {env['torch']} "
            f"(CUDA {env['cuda']}), NCCL {env['nccl']}, precision auto = {env['precision_auto']}"), env


def check_tests_cuda(ctx: Context) -> tuple[str, dict]:
    done = ctx.run(sys.executable, "-m", "pytest", "-q", "-rs", "-m", "cuda", "-p", "no:cacheprovider",
                   "tests/cuda")
    summary = (done.stdout.strip().splitlines() or ["no output"])[-1]
    data = {"summary": summary, "exit_code": done.returncode}
    require(done.returncode == 0, f"pytest tests/cuda: {summary}", {**data, "tail": done.stdout[-3000:]})
    return summary, data


def check_data(ctx: Context) -> tuple[str, dict]:
    root = ctx.work / "jpegs"
    done = ctx.run(sys.executable, "benchmarks/make_jpegs.py", str(root), "--classes", str(CLASSES),
                   "--per-class", str(PER_CLASS), "--val", str(VAL))
    require(done.returncode == 0, f"make_jpegs.py exited {done.returncode}", {"stderr": done.stderr[-2000:]})
    return done.stdout.strip(), {"registry": str(root / "data.toml"),
                                 "val": str(root / "ILSVRC/Data/CLS-LOC/val")}


def train(ctx: Context, run_dir: Path, *sets: str, resume: str = "never") -> dict:
    """`ddp train configs/resnet50.toml` on the generated JPEGs, every GPU (nproc_per_node auto)."""
    args = [a for s in (*TRAIN_SETS, *sets) for a in ("--set", s)]
    return ctx.ddp("train", "configs/resnet50.toml", "--registry", ctx.results["data"]["registry"],
                   "--run-dir", str(run_dir), "--resume", resume, *args)


def trained_sanely(out: dict, epochs: int, what: str, val: int = VAL) -> None:
    """Every val image counted, the epochs run, a finite loss."""
    final = out.get("final") or {}
    finite = math.isfinite(final.get("loss", math.nan))
    require(out.get("epochs") == epochs and final.get("images") == val and finite,
            f"{what}: epochs {out.get('epochs')}, val images {final.get('images')} (want {val}), "
            f"loss {final.get('loss')}", out)


def check_train(ctx: Context) -> tuple[str, dict]:
    run_dir = ctx.work / "train"
    out = train(ctx, run_dir, "train.epochs=2", f"checkpoint.every_steps={EVERY}", "train.ema_decay=0.999")
    trained_sanely(out, 2, "two epochs")
    require(out.get("final_ema") is not None, "no EMA validation in the summary", out)
    steps = sorted(p.name for p in (run_dir / "checkpoints").glob("step-*.pt"))
    require((run_dir / "checkpoints" / "last.pt").exists() and steps, "no step checkpoints or last.pt", out)
    # a mid-run step file: the every-N saves, not only the epoch ends
    middle = [s for s in steps if int(s[5:-3]) % EVERY == 0]
    require(bool(middle), f"no step checkpoint at a multiple of {EVERY} among {steps}", out)
    data = {**out, "run_dir": str(run_dir), "checkpoint": str(run_dir / "checkpoints" / "last.pt"),
            "resume_from": str(run_dir / "checkpoints" / middle[0])}
    return (f"{out['world_size']} GPUs, {out['precision']}, top-1 {out['final']['top1']:.3f}, "
            f"{out['images_per_second']:.0f} img/s, step files {', '.join(steps)}"), data


def check_resume(ctx: Context) -> tuple[str, dict]:
    start = ctx.results["train"]["resume_from"]
    out = train(ctx, ctx.work / "resume", "train.epochs=2", "train.ema_decay=0.999", resume=start)
    trained_sanely(out, 2, "resumed")
    return f"from {Path(start).name}: top-1 {out['final']['top1']:.3f}", out


def check_validate(ctx: Context) -> tuple[str, dict]:
    predictions = ctx.work / "predictions.csv"
    out = ctx.ddp("validate", "--checkpoint", ctx.results["train"]["checkpoint"], "--registry",
                  ctx.results["data"]["registry"], "--per-class", "--predictions", str(predictions))
    rows = predictions.read_text().splitlines()[1:] if predictions.exists() else []
    require(out.get("images") == VAL and len(out.get("per_class", [])) == CLASSES and len(rows) == VAL,
            f"validate: {out.get('images')} images, {len(out.get('per_class', []))} classes, "
            f"{len(rows)} prediction rows (want {VAL}, {CLASSES}, {VAL})", out)
    return f"top-1 {out['top1']:.3f} on {VAL} images, per-class and predictions written", out


def check_predict(ctx: Context) -> tuple[str, dict]:
    done = ctx.run(*ddp_command(), "predict", "--checkpoint", ctx.results["train"]["checkpoint"],
                   ctx.results["data"]["val"], "--topk", "3", "--json")
    answers = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    good = [a for a in answers if "error" not in a]
    require(done.returncode == 0 and len(good) == VAL,
            f"predict exited {done.returncode}: {len(good)} of {VAL} images predicted",
            {"answers": answers[:3], "stderr": done.stderr[-2000:]})
    return f"{len(good)} images, top-3 each", {"first": good[0]}


def check_export(ctx: Context) -> tuple[str, dict]:
    target = ctx.work / "resnet50.ts"
    out = ctx.ddp("export", "--checkpoint", ctx.results["train"]["checkpoint"], "--format", "torchscript",
                  "--out", str(target))
    require(target.exists() and target.stat().st_size > 0, f"export wrote no {target}", out)
    return f"TorchScript, {target.stat().st_size / 2**20:.0f} MiB", out


def one_epoch(name: str, *sets: str, want: Callable[[dict], bool] = lambda out: True) -> Callable:
    """A stage: one short epoch with `sets`, trained sanely and, per `want`, as asked."""

    def check(ctx: Context) -> tuple[str, dict]:
        if name == "bf16" and not bf16_native(ctx.results.get("driver", {})):
            raise Skipped("the GPU has no bf16 (compute capability below 8.0)")
        if name == "bf16" and ctx.results.get("train", {}).get("precision") == "bf16":
            raise Skipped("the train stage ran in bf16 (precision \"auto\" on this GPU)")
        out = train(ctx, ctx.work / name, "train.epochs=1", *sets)
        trained_sanely(out, 1, name)
        require(want(out), f"{name}: the run's summary says otherwise ({out.get('precision')})", out)
        rate = out["images_per_second"]
        return f"{out['precision']}, loss {out['final']['loss']:.3f}, {rate:.0f} img/s", out

    return check


def bf16_native(env: dict) -> bool:
    """Whether `ddp env` found every GPU at compute capability 8.0+ (its "8.6"; unknown: assume so)."""
    caps = [tuple(int(part) for part in gpu["capability"].split("."))
            for gpu in env.get("gpus", []) if gpu.get("capability")]
    return not caps or min(caps) >= (8, 0)


def check_step(ctx: Context) -> tuple[str, dict]:
    out = ctx.ddp("bench", "step", *BENCH)
    fast = out["fast_precision"]
    rows = {r["loop"]: r for r in out["rows"] if r["channels_last"] and r["precision"] == fast}
    ddp, bare = rows["ddp"], rows["bare"]
    syncs = out.get("host_syncs_per_step", [])
    peak = ddp["peak_memory_mib"] / bare["peak_memory_mib"]
    line = (f"ddp {ddp['images_per_second']:.0f} img/s vs bare {bare['images_per_second']:.0f}: "
            f"x{out['ratio_vs_bare']:.3f}, with EMA x{out['ratio_ema_vs_bare']:.3f}; "
            f"peak memory x{peak:.2f}; host syncs per step {syncs}")
    require(out["ratio_vs_bare"] >= RATIO and out["ratio_ema_vs_bare"] >= RATIO_EMA,
            f"{line} (want >= {RATIO}, >= {RATIO_EMA} with EMA)", out)
    require(peak <= PEAK, f"{line} (want peak memory <= x{PEAK})", out)
    require(bool(syncs) and max(syncs) == 0, f"{line}, from {out.get('host_syncs_from')} (want none)", out)
    return line, out


def check_input(ctx: Context) -> tuple[str, dict]:
    """ResNet-50 fed from JPEG files against its step on synthetic tensors, with data.decode "cpu", "gpu"
    and "auto", on every core and pinned to PIN_CORES (skipped, saying so, where there are no more): each
    run's images/s and ratio to synthetic, the busy share of its cores, peak GPU memory, and "auto"'s
    measured choice. Held to `INPUT_GOAL` where it applies: on an H100-class GPU."""
    root = ctx.work / "imagenet-like"
    done = ctx.run(sys.executable, "benchmarks/make_jpegs.py", str(root), *INPUT_JPEGS)
    require(done.returncode == 0, f"make_jpegs.py exited {done.returncode}",
            {"stderr": done.stderr[-2000:]})
    synthetic = synthetic_rate(ctx)
    pinned = pinned_cores()
    groups = {"all_cores": None, **({f"{PIN_CORES}_cores": pinned} if pinned else {})}
    runs: dict[str, dict[str, dict]] = {}
    for group, cores in groups.items():
        runs[group] = {}
        for name, sets in INPUT_RUNS.items():
            try:
                run = input_run(ctx, str(root / "data.toml"), f"{name}-{group}", cores, *sets)
            except Failed as e:
                raise Failed(f"{name} ({group.replace('_', ' ')}): {e}",
                             {"synthetic": synthetic, "runs": runs, **e.data}) from None
            runs[group][name] = {**run, "ratio_to_synthetic": run["images_per_second"]
                                 / synthetic["images_per_second"]}
    env = ctx.results.get("driver", {})
    gpu = (env.get("gpus") or [{}])[0].get("name", "?")
    applies = any(kind in gpu for kind in H100_CLASS)
    data = {"synthetic": synthetic, "runs": runs, "goal": INPUT_GOAL, "goal_applies": applies, "gpu": gpu,
            "cpus": os.cpu_count(), "pinned_cores": sorted(pinned) if pinned else None}
    line = input_line(synthetic, runs)
    if not pinned:
        line += (f"; {len(usable_cores()) or '?'} cores here: no {PIN_CORES}-core runs (the whole "
                 "machine's stand for them)")
    if not applies:
        return line + f"; goal ({INPUT_GOAL}) not applied on {gpu}", data
    missed = input_goals(runs)
    require(not missed, f"{line} (want {'; '.join(missed)})", data)
    return line, data


def input_goals(runs: dict[str, dict[str, dict]]) -> list[str]:
    """The input stage's goals that `runs` missed, each as what was wanted and what was measured."""
    missed = []
    for name in ("gpu_decode", "auto_decode"):
        ratio = runs.get(f"{PIN_CORES}_cores", {}).get(name, {}).get("ratio_to_synthetic")
        if ratio is not None and ratio < GOAL_RATIO:
            missed.append(f"{name.replace('_', ' ')} on {PIN_CORES} cores >= x{GOAL_RATIO} (x{ratio:.2f})")
    every = runs["all_cores"]
    faster = max(every["cpu_decode"]["images_per_second"], every["gpu_decode"]["images_per_second"])
    auto = every["auto_decode"]["images_per_second"]
    if auto < AUTO_SHARE * faster:
        missed.append(f"auto decode on every core >= {AUTO_SHARE:.0%} of the faster path's {faster:,.0f} "
                      f"img/s ({auto:,.0f})")
    return missed


def synthetic_rate(ctx: Context) -> dict:
    """ddp's step at the input stage's settings on synthetic tensors (`ddp bench step`): images/s, peak."""
    out = ctx.ddp("bench", "step", "--device", "cuda", "--model", "resnet50", "--image-size", "224",
                  "--batch-size", str(INPUT_BATCH), "--world-size", "1", "--steps", "10", "--rounds", "1")
    row = next(r for r in out["rows"]
               if r["loop"] == "ddp" and r["channels_last"] and r["precision"] == "bf16")
    return {"images_per_second": row["images_per_second"], "peak_memory_mib": row["peak_memory_mib"]}


def input_run(ctx: Context, registry: str, name: str, cores: set[int] | None, *sets: str) -> dict:
    """One run of the input stage's settings with `sets`, one GPU, on `cores` (None: all), watched: its
    steady images/s (the logging windows after the first, which holds the start-up), the busy share of
    its cores over them, peak GPU memory, and the decode path it ran (data.decode "auto": its measured
    choice, which the run dir's config.toml holds)."""
    run_dir = ctx.work / f"input-{name}"
    args = [a for s in (*INPUT_SETS, *sets) for a in ("--set", s)]
    with ctx.monitor(cores) as watch:
        out = ctx.ddp("train", "configs/resnet50.toml", "--registry", registry, "--run-dir", str(run_dir),
                      "--resume", "never", "--nproc-per-node", "1", *args, cores=cores)
    trained_sanely(out, 1, name, INPUT_VAL)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    loader = out.get("data_workers") or {}
    ahead = loader.get("workers", 0) * (loader.get("prefetch_factor") or 0)
    rate, start, end = steady_rate(records, INPUT_BATCH, ahead)
    return {"images_per_second": rate, "cpu_busy_share": watch.busy_share(start, end),
            "peak_gpu_memory_mib": watch.peak_mib(), "epoch_images_per_second": out["images_per_second"],
            "decode": run_decode(run_dir), "loader_workers": loader.get("workers")}


def run_decode(run_dir: Path) -> str | None:
    """The data.decode a run dir's config.toml holds: the path its run took."""
    try:
        return tomllib.loads((run_dir / "config.toml").read_text()).get("data", {}).get("decode")
    except (OSError, tomllib.TOMLDecodeError):
        return None


def steady_rate(records: list[dict], batch: int, ahead: int = 0) -> tuple[float, float, float]:
    """Images/s from the first logging record at or past step `ahead` to the last one of the run's
    training (after its last start-up record: a run dir trained in before keeps its records), and when
    they were logged. So the first window (the start-up) is left out, and so are the `ahead` batches the
    loader had decoded before the first step: served from memory, they time nothing of the decoding."""
    starts = [i for i, r in enumerate(records) if r.get("split") == "startup"]
    train = [r for r in records[(starts or [0])[-1]:] if r.get("split") == "train"]
    timed = [r for r in train if r["step"] >= ahead]
    require(len(timed) >= 2, f"{len(timed)} logging windows in metrics.jsonl from step {ahead} (the loader's "
            "batches ahead): too few to time", {})
    first, last = timed[0], timed[-1]
    rate = (last["step"] - first["step"]) * batch / (last["time"] - first["time"])
    return rate, first["time"], last["time"]


def input_line(synthetic: dict, runs: dict[str, dict[str, dict]]) -> str:
    """One line: synthetic's rate, then per group of cores each run's rate, ratio, busy share, peak
    memory, and the path "auto" chose."""
    def one(name: str, run: dict) -> str:
        busy, peak = run["cpu_busy_share"], run["peak_gpu_memory_mib"]
        chose = f', chose "{run["decode"]}"' if name == "auto_decode" else ""
        return (f"{name.removesuffix('_decode')} {run['images_per_second']:,.0f} img/s "
                f"x{run['ratio_to_synthetic']:.2f} (CPU {'?' if busy is None else f'{busy:.0%}'}, "
                f"{'?' if peak is None else f'{peak / 1024:.1f}'} GiB{chose})")
    groups = [f"{group.replace('_', ' ')}: " + ", ".join(one(name, run) for name, run in each.items())
              for group, each in runs.items()]
    return f"synthetic {synthetic['images_per_second']:,.0f} img/s; " + "; ".join(groups)


STAGES = [
    Stage("driver", 30, check_driver),
    Stage("tests_cuda", 180, check_tests_cuda, ("driver",)),
    Stage("data", 60, check_data),
    Stage("train", 120, check_train, ("driver", "data")),
    Stage("resume", 60, check_resume, ("train",)),
    Stage("validate", 45, check_validate, ("train",)),
    Stage("predict", 45, check_predict, ("train",)),
    Stage("export", 30, check_export, ("train",)),
    Stage("fp16", 45, one_epoch("fp16", 'train.precision="fp16"', want=lambda o: o["precision"] == "fp16"),
          ("driver", "data")),
    Stage("bf16", 45, one_epoch("bf16", 'train.precision="bf16"', want=lambda o: o["precision"] == "bf16"),
          ("driver", "data")),
    Stage("powersgd", 45, one_epoch("powersgd", 'distributed.reduce="powersgd"',
                                    "distributed.powersgd_warmup_steps=2"), ("driver", "data")),
    Stage("syncbn", 45, one_epoch("syncbn", "model.sync_batchnorm=true"), ("driver", "data")),
    Stage("step", 120, check_step, ("driver",)),
    Stage("input", 300, check_input, ("driver",)),  # six runs: "cpu", "gpu", "auto"; all cores, then 4
]


# ---- the report ---------------------------------------------------------------------------------------


def report(outcomes: list[Outcome], path: Path, total_s: float) -> dict:
    """The JSON report, written to `path`."""
    doc = {"held": held(outcomes), "total_budget_s": total_s, "seconds": sum(o.seconds for o in outcomes),
           "stages": [asdict(o) for o in outcomes]}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2, default=str) + "\n")
    return doc


def summary(outcomes: list[Outcome], path: Path, console: Any = None) -> None:
    """One screen: a row per stage (status, time of budget, its one line), then the verdict and report."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    colour = {"ok": "green", "failed": "red", "skipped": "yellow", "not run": "red"}
    table = Table("stage", "status", "s / budget", title="ddp gpu-check", title_justify="left")
    table.add_column("result", overflow="fold")
    for o in outcomes:
        table.add_row(o.stage, f"[{colour[o.status]}]{o.status}[/]", f"{o.seconds:.0f} / {o.budget_s:.0f}",
                      o.detail)
    console.print(table)
    verdict = "[green]all held[/]" if held(outcomes) else "[red]not all held[/]"
    console.print(f"{verdict}; report: {path}", soft_wrap=True)


def gpu_here() -> bool:
    """A CUDA GPU torch can use, or one the driver shows that it cannot (the driver stage says why)."""
    from ddp_cli.distributed.gpus import node_gpus, torch_sees_gpus

    return torch_sees_gpus() or bool(node_gpus())


def main(argv: list[str] | None = None, stages: list[Stage] | None = None, total_s: float = TOTAL_S) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    stamp = time.strftime("%Y%m%d-%H%M%S")
    parser.add_argument("--out", type=Path, default=REPO / "runs" / f"gpu-check-{stamp}",
                        help="work folder: runs, data and report.json")
    parser.add_argument("--total-s", type=float, default=total_s,
                        help=f"the whole check's time (default {TOTAL_S:.0f}); stages past it are not run")
    parser.add_argument("--stages", type=lambda s: s.split(","), default=None,
                        help="only these stages, comma-separated (a stage they need must be named too)")
    args = parser.parse_args(argv)
    real, stages = stages is None, STAGES if stages is None else stages
    if args.stages:
        unknown = sorted(set(args.stages) - {s.name for s in stages})
        if unknown:
            names = ", ".join(s.name for s in stages)
            parser.error(f"--stages: no stage {', '.join(unknown)}; the stages: {names}")
        stages = [s for s in stages if s.name in args.stages]
    if real and not gpu_here():
        print("gpu-check: no CUDA GPU on this machine (torch and the NVIDIA driver see none); run it on a "
              "machine with one", file=sys.stderr)
        return 2
    ctx = Context(args.out)
    outcomes = run_stages(stages, ctx, args.total_s)
    path = args.out / "report.json"
    report(outcomes, path, args.total_s)
    summary(outcomes, path)
    return 0 if held(outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
