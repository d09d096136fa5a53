"""`make test-scale`: 32 ranks on one machine, 8 `ddp train` launchers x 4 workers on loopback (gloo, the
demo's tiny model at 8 px): an epoch at world 32, its validation equal to world 1's, a resume at world 24,
and an elastic `--nnodes 6:8` job that loses two launchers and carries on. Prints (and writes to
$DDP_SCALE_REPORT, default runs/test-scale.json) the rendezvous time, memory per rank and open files per
process that BENCHMARKS.md quotes. Not part of `make test`: minutes, and every core."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
from conftest import REPO, last_json, run_ddp
from scale_run import Watch, launch, wait_all

from ddp_cli.run.loopback import free_port

NODES, PER_NODE = 8, 4
pytestmark = pytest.mark.timeout(900)
TINY = [a for s in ("data.image_size=8", "data.val_resize=8", "data.workers=0", "data.batch_size=8",
                    "train.precision=fp32", "logging.every_steps=1", "distributed.rdzv_timeout_s=300",
                    "distributed.timeout_s=120") for a in ("--set", s)]
REPORT: dict = {}


def train(registry: Path, run_dir: Path, nodes: int, nnodes: str, logs: Path, *more: str, kill_at: int = 0):
    """`nodes` launchers of PER_NODE workers into one run dir; with `kill_at`, launchers 6 and 7 are
    killed (SIGKILL, with their workers: two machines gone) once a train step >= `kill_at` is logged."""
    args = ["configs/demo.toml", "--registry", str(registry), *TINY, *more]
    started = time.monotonic()
    launchers = launch(nodes, PER_NODE, f"127.0.0.1:{free_port()}", run_dir, nnodes, args, logs)
    with Watch(launchers) as watch:
        if kill_at:
            wait_for_step(run_dir, kill_at, launchers)
            for launcher in launchers[6:]:
                launcher.kill()
        codes = wait_all(launchers, 540)
    survivors = launchers[:6] if kill_at else launchers
    for launcher, code in zip(survivors, codes, strict=False):
        assert code == 0, f"node {launcher.rank}: exit {code}\n{launcher.err.read_text()[-3000:]}"
    return launchers[0].result(), watch, time.monotonic() - started


def wait_for_step(run_dir: Path, step: int, launchers, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and all(launcher.proc.poll() is None for launcher in launchers):
        metrics = run_dir / "metrics.jsonl"
        records = [json.loads(line) for line in (metrics.read_text().splitlines() if metrics.exists() else [])
                   if line.endswith("}")]
        if any(r.get("split") == "train" and r.get("step", 0) >= step for r in records):
            return
        time.sleep(0.2)
    pytest.fail(f"no train step {step} in {run_dir}")


def figures(name: str, result: dict, watch: Watch, seconds: float) -> None:
    startup = result["startup_seconds"]  # of the last incarnation (a restarted one has no hand-off)
    pss = sorted(watch.pss_mb.values())
    REPORT[name] = {"world_size": result["world_size"], "wall_s": round(seconds, 1),
                    "rendezvous_and_worker_start_s": startup.get("launch"),
                    "process_group_s": startup.get("process_group"),
                    "rank_pss_mb": {"median": round(pss[len(pss) // 2], 1), "max": round(pss[-1], 1)},
                    "open_files": watch.fds, "world_sizes": result.get("world_sizes")}


@pytest.fixture(scope="module")
def world_32(demo_registry, tmp_path_factory):
    base = tmp_path_factory.mktemp("scale")
    result, watch, seconds = train(demo_registry, base / "run", NODES, str(NODES), base / "logs-32",
                                   "--set", "train.epochs=1")
    figures("train_world_32", result, watch, seconds)
    return base, result


def test_an_epoch_at_world_32(world_32):
    _, result = world_32
    assert result["world_size"] == NODES * PER_NODE and result["epochs"] == 1


def test_its_validation_is_world_1s_exactly(world_32):
    base, result = world_32
    alone = last_json(run_ddp("validate", "--checkpoint", str(base / "run/checkpoints/last.pt"),
                              "--nproc-per-node", "1", "--json"))
    assert alone["images"] == result["final"]["images"] == 359  # the demo's val split, every image once
    assert (alone["top1"], alone["top5"]) == (result["final"]["top1"], result["final"]["top5"])
    assert alone["loss"] == pytest.approx(result["final"]["loss"], rel=1e-6)


def test_a_resume_at_world_24(world_32, demo_registry):
    base, _ = world_32
    result, watch, seconds = train(demo_registry, base / "run", 6, "6", base / "logs-24",
                                   "--set", "train.epochs=2", "--resume", "auto")
    figures("resume_world_24", result, watch, seconds)
    assert result["world_sizes"] == [32, 24]


def test_an_elastic_job_losing_two_launchers_carries_on(demo_registry, tmp_path):
    result, watch, seconds = train(demo_registry, tmp_path / "run", NODES, "6:8", tmp_path / "logs",
                                   "--set", "train.epochs=3", "--set", "checkpoint.every_steps=2",
                                   "--max-restarts", "3", kill_at=2)
    figures("elastic_6_of_8", result, watch, seconds)
    # it went on at the smaller world, to the end (node 0 may have restarted for the membership change,
    # which keeps torch's restart count at 0: `restarts` is no proof either way)
    assert result["world_size"] == 24


def teardown_module() -> None:
    out = Path(os.environ.get("DDP_SCALE_REPORT", REPO / "runs/test-scale.json"))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(REPORT, indent=2))
    print(f"\nscale figures ({out}):\n{json.dumps(REPORT, indent=2)}")
