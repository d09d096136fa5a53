"""`make test-chaos SEED=N`: the demo trained while faults strike at steps drawn from the seed, ending with
weights bit-identical to the same run unbroken.

Data and run dir are in the loopback bucket (moto), reached through a proxy that fails 5% of all requests
(503s and dropped connections) with 50 ms of latency on each. The run goes through three launches:
  1. a worker SIGKILLed (the agent restarts the workers, which resume from the newest checkpoint), a
     second worker SIGKILLed in that second incarnation, then SIGTERM: exit 143 with a checkpoint;
  2. --resume auto, and the node's disk (a 64 MiB tmpfs holding the run's staging folder) fills up after a
     step: the next checkpoint fails, exit 6;
  3. --resume auto on the emptied disk: to the end, exit 0.
The schedule is printed first, so a failure replays with the same SEED. Needs root (the tmpfs).
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess
from pathlib import Path

import pytest
import s3fs
import torch
from conftest import ENV, KEY, SECRET, LiveRun, last_json, run_ddp
from synthetic import write_registry

from ddp_cli.bench.faultproxy import FaultProxy, Faults

SEED = int(os.environ.get("DDP_CHAOS_SEED", "0"))
BUCKET = "ddp-chaos"
EVERY_METHOD = ("GET", "PUT", "HEAD", "DELETE", "POST")
STEPS = 44  # 2 epochs of 22 steps (the demo's 1438 training images, 2 ranks x 32, 16 px)
SETTINGS = [a for s in ("data.workers=1", "logging.every_steps=1", "deterministic=true", "data.image_size=16",
                        "data.val_resize=16", "train.epochs=2", "checkpoint.every_steps=3",
                        "distributed.stop_check_steps=1", "data.io_retries=8")
            for a in ("--set", s)]
pytestmark = pytest.mark.timeout(1200)


def schedule(seed: int) -> dict[str, int]:
    """The steps each fault strikes after, drawn from `seed`, in the order the run meets them: each
    after the one before (a restarted incarnation resumes from a checkpoint at or before the kill)."""
    draw = random.Random(seed)
    first_kill = draw.randint(3, 10)
    second_kill = draw.randint(first_kill + 1, first_kill + 8)
    sigterm = draw.randint(second_kill + 1, second_kill + 8)
    disk_full = draw.randint(sigterm + 2, sigterm + 10)
    return {"sigkill_rank": draw.randint(0, 1), "first_kill": first_kill, "second_kill": second_kill,
            "second_kill_rank": draw.randint(0, 1), "sigterm": sigterm, "disk_full": disk_full}


@pytest.fixture(scope="module")
def small_disk(tmp_path_factory):
    folder = tmp_path_factory.mktemp("chaos") / "disk"
    folder.mkdir()
    if os.geteuid() != 0:
        pytest.skip("the full disk is a tmpfs: mounting it needs root")
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(folder)], check=True, timeout=30)
    yield folder
    subprocess.run(["umount", "-l", str(folder)], check=False, timeout=30)


@pytest.fixture(scope="module")
def bucket_registry(s3_endpoint, demo_root, tmp_path_factory) -> Path:
    """The demo's files in the loopback bucket, and a registry naming them there (endpoint from the
    environment: the proxy's, for the chaos run)."""
    fs = s3fs.S3FileSystem(key=KEY, secret=SECRET, client_kwargs={"endpoint_url": s3_endpoint},
                           skip_instance_cache=True)
    fs.mkdir(BUCKET)
    fs.put(f"{demo_root}/", f"{BUCKET}/demo/", recursive=True)
    return write_registry(tmp_path_factory.mktemp("chaos-registry"), [
        {"name": "demo", "layout": "imagenet-loc", "storage": {"driver": "S3", "path": f"s3://{BUCKET}/demo"}}])


def test_chaos_ends_bit_identical_to_the_unbroken_run(bucket_registry, s3_endpoint, small_disk, tmp_path):
    plan = schedule(SEED)
    faults = (f"sigkill@{plan['first_kill']}:{plan['sigkill_rank']},"
              f"sigkill@{plan['second_kill']}:{plan['second_kill_rank']}/1,sigterm@{plan['sigterm']}/2")
    print(f"\nchaos SEED={SEED}: launch 1 DDP_FAULTS={faults}; launch 2 DDP_FAULTS=diskfull@"
          f"{plan['disk_full']}; launch 3 to the end; storage: 5% of requests failed, 50 ms latency each")
    env = {**ENV, "AWS_ENDPOINT_URL": s3_endpoint}
    reference = tmp_path / "reference"
    unbroken = last_json(run_ddp("train", "configs/demo.toml", "--registry", str(bucket_registry),
                                 "--run-dir", str(reference), "--json", *SETTINGS, env=env, timeout=400))
    url = f"s3://{BUCKET}/runs/chaos-{SEED}"
    staging = small_disk / "staging"
    with FaultProxy(s3_endpoint, Faults(latency_ms=50, fail_rate=0.05, drop_share=0.3, methods=EVERY_METHOD,
                                        seed=SEED)) as proxy:
        chaos = {**ENV, "AWS_ENDPOINT_URL": proxy.url, "DDP_STAGING_DIR": str(staging)}
        args = ["train", "configs/demo.toml", "--registry", str(bucket_registry), "--run-dir", url, *SETTINGS,
                "--resume", "auto"]
        first = LiveRun(*args, "--max-restarts", "3", env={**chaos, "DDP_FAULTS": faults})
        assert first.wait(timeout=600) == 143, first.stderr[-3000:]
        assert "stopped by SIGTERM" in first.stderr
        full = run_ddp(*args, "--json", env={**chaos, "DDP_FAULTS": f"diskfull@{plan['disk_full']}",
                                              "DDP_FAULTS_DISK": str(small_disk)}, timeout=600)
        assert full.returncode == 6, full.stderr[-3000:]
        assert "no space left on the device" in full.stderr
        (small_disk / ".ddp-fault-ballast").unlink()  # room made
        last = last_json(run_ddp(*args, "--json", env=chaos, timeout=600))
    print(f"chaos SEED={SEED}: {proxy.counts.refused} of {proxy.counts.requests} requests refused; "
          f"{last['restarts']} restarts in the last launch")
    assert proxy.counts.refused > 0 and last["final"] == unbroken["final"]
    fs = s3fs.S3FileSystem(key=KEY, secret=SECRET, client_kwargs={"endpoint_url": s3_endpoint},
                           skip_instance_cache=True)
    fs.get(f"{BUCKET}/runs/chaos-{SEED}/checkpoints/last.pt", str(tmp_path / "last.pt"))
    broken = torch.load(tmp_path / "last.pt", weights_only=True)["model"]
    whole = torch.load(reference / "checkpoints/last.pt", weights_only=True)["model"]
    assert broken.keys() == whole.keys()
    assert all(torch.equal(broken[k], whole[k]) for k in whole), f"SEED={SEED}: the weights differ"
    shutil.rmtree(staging, ignore_errors=True)
