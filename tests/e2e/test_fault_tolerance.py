"""Nothing lost when something breaks: signals, killed workers, torn checkpoints, hostile files."""

from __future__ import annotations

import json
import os
import pickle
import re
import subprocess
import time
import tomllib
from pathlib import Path

import pytest
import s3fs
import torch
from conftest import ENV, KEY, SECRET, TIMEOUT, LiveRun, ddp_in_process, last_json, run_ddp

from ddp_cli.train.checkpoint import CheckpointStore, write_manifest

# 16 px: the demo's data, model and code path at a quarter of its arithmetic (these tests check
# mechanisms, not accuracy); steps stay long enough for a signal to land mid-epoch.
EXACT = ["--set", "data.workers=1", "--set", "logging.every_steps=1", "--set", "deterministic=true",
         "--set", "data.image_size=16", "--set", "data.val_resize=16"]


def train(registry, run_dir, *extra, env=None, timeout=TIMEOUT):
    return run_ddp("train", "configs/demo.toml", "--registry", str(registry), "--run-dir", str(run_dir),
                   "--json", *EXACT, *extra, env=env, timeout=timeout)


def weights(run_dir):
    """The trained weights and, where the run has one, the EMA's (BatchNorm statistics included)."""
    saved = torch.load(run_dir / "checkpoints/last.pt", weights_only=True)
    ema = {f"ema.{k}": v for k, v in saved["ema"]["module"].items()} if saved.get("ema") else {}
    return {**saved["model"], **ema}


# Every augmentation and every element of the fast recipe at once, so that a stop by SIGTERM and its
# resume cover what they add to resuming (the sampler's repeated layout, per-copy seeds, per-step
# MixUp/CutMix draws, the epoch's crop size, the EMA): repeated augmentation, the per-image policy, jitter
# and erasing, MixUp/CutMix (mix_prob 1 by default; the switch picks either); progressive resizing (8 px
# in the first epoch, the one the stop lands in), a val crop above the train crop, BlurPool, zero-init
# residuals, the EMA (its BatchNorm statistics recomputed before the first validation: train.ema_bn_epochs
# derives 1 from this ramp) and label smoothing (on by default).
EVERYTHING = ["--set", "augment.repeated_aug=2", "--set", "augment.policy=trivialaugment",
              "--set", "augment.color_jitter=0.3", "--set", "augment.random_erase=0.5",
              "--set", "augment.random_erase_value=random", "--set", "augment.mixup_alpha=0.2",
              "--set", "augment.cutmix_alpha=1.0",
              "--set", "data.min_image_size=8", "--set", "data.ramp_epochs=[0.5, 1]",
              "--set", "data.val_image_size=20", "--set", "data.val_resize=20",
              "--set", "model.blurpool=true", "--set", "model.zero_init_residual=true",
              "--set", "train.ema_decay=0.9"]


@pytest.fixture(scope="module")
def uninterrupted(demo_registry, tmp_path_factory):
    """The reference: two epochs with every augmentation and recipe element on, never disturbed."""
    run_dir = tmp_path_factory.mktemp("ref") / "run"
    return last_json(train(demo_registry, run_dir, *EVERYTHING, "--set", "train.epochs=2")), run_dir


def assert_bit_identical(resumed: dict, reference: dict, run_dir: Path, reference_dir: Path) -> None:
    assert resumed["final"] == reference["final"] and resumed["final_ema"] == reference["final_ema"]
    a, b = weights(run_dir), weights(reference_dir)
    assert all(torch.equal(a[k], b[k]) for k in a), "resumed run differs from the uninterrupted one"


# The launcher's SIGTERM sent by rank 0 itself right after global step 6 (`ddp_cli.distributed.faults`):
# a stop at a step the test names, not a race between a log line and a fast machine.
SIGTERM_AFTER_STEP_6 = {"DDP_FAULTS": "sigterm@6"}


def test_sigterm_with_every_augmentation_and_recipe_element_on_resumes_bit_identical(
        demo_registry, tmp_path, uninterrupted):
    reference, reference_dir = uninterrupted
    run_dir = tmp_path / "run"
    run = LiveRun("train", "configs/demo.toml", "--registry", str(demo_registry), "--run-dir",
                  str(run_dir), *EXACT, *EVERYTHING, "--set", "train.epochs=2", env=SIGTERM_AFTER_STEP_6)
    assert run.wait(timeout=120) == 143, run.stderr
    assert "stopped by SIGTERM" in run.stderr
    stopped = CheckpointStore(run_dir / "checkpoints", 1).latest_valid()
    assert stopped is not None and "step-" in stopped.name
    step = torch.load(stopped, weights_only=True)["step_in_epoch"]
    assert step == 10  # mid-epoch (of 22): the first stop agreement after the signal (stop_check_steps 10)
    resumed = last_json(train(demo_registry, run_dir, *EVERYTHING, "--set", "train.epochs=2"))
    assert_bit_identical(resumed, reference, run_dir, reference_dir)


GPU_DECODE = ["--set", 'data.decode="gpu"']  # on CPU workers: the rank decodes, with the code a GPU runs


@pytest.fixture(scope="module")
def uninterrupted_gpu_decode(demo_registry, tmp_path_factory):
    """The reference of `uninterrupted`, its JPEGs decoded and augmented by the ranks (data.decode gpu)."""
    run_dir = tmp_path_factory.mktemp("ref-gpu-decode") / "run"
    out = train(demo_registry, run_dir, *EVERYTHING, *GPU_DECODE, "--set", "train.epochs=2")
    return last_json(out), run_dir


def test_sigterm_with_gpu_decode_checkpoints_then_resume_ends_bit_identical(demo_registry, tmp_path,
                                                                           uninterrupted_gpu_decode):
    """Every augmentation drawn by the loaders and replayed by the rank: a stop and its resume end where
    the unbroken run ends (test_demo_accuracy checks what it learns)."""
    reference, reference_dir = uninterrupted_gpu_decode
    assert tomllib.loads((reference_dir / "config.toml").read_text())["data"]["decode"] == "gpu"
    run_dir = tmp_path / "run"
    run = LiveRun("train", "configs/demo.toml", "--registry", str(demo_registry), "--run-dir",
                  str(run_dir), *EXACT, *EVERYTHING, *GPU_DECODE, "--set", "train.epochs=2",
                  env=SIGTERM_AFTER_STEP_6)
    assert run.wait(timeout=120) == 143, run.stderr
    assert "step-" in CheckpointStore(run_dir / "checkpoints", 1).latest_valid().name
    resumed = last_json(train(demo_registry, run_dir, *EVERYTHING, *GPU_DECODE, "--set", "train.epochs=2"))
    assert_bit_identical(resumed, reference, run_dir, reference_dir)


STAND_IN = {"DDP_DECODE_STAND_IN": "1"}  # CPU workers measure data.decode "auto" (device_decode.decodes_on)


def test_auto_decode_is_measured_recorded_and_a_stopped_run_resumes_on_its_path_bit_identical(
        demo_registry, tmp_path):
    """data.decode "auto" on the CPU stand-in: the workers time both paths and keep the faster; the run
    dir's config.toml holds the choice and the log the figures. Stopped by SIGTERM, the run resumes on
    the checkpoint's path (no new measurement) and ends where an unbroken run on that path ends."""
    run_dir = tmp_path / "run"
    run = LiveRun("train", "configs/demo.toml", "--registry", str(demo_registry), "--run-dir",
                  str(run_dir), *EXACT, *EVERYTHING, "--set", "train.epochs=2",
                  env={**SIGTERM_AFTER_STEP_6, **STAND_IN})
    assert run.wait(timeout=120) == 143, run.stderr
    measured = re.search(r'data.decode "auto": "(cpu|gpu)" \(measured: cpu ([\d,]+) img/s, '
                         r"gpu ([\d,]+) img/s per rank; ([\d.]+) s spent measuring\)", run.stderr)
    assert measured, run.stderr
    choice = measured[1]
    assert tomllib.loads((run_dir / "config.toml").read_text())["data"]["decode"] == choice
    resumed_out = train(demo_registry, run_dir, *EVERYTHING, "--set", "train.epochs=2", env=STAND_IN)
    resumed = last_json(resumed_out)
    assert f'data.decode "auto": "{choice}", as the checkpoint trained' in resumed_out.stderr
    assert "measured:" not in resumed_out.stderr
    assert tomllib.loads((run_dir / "config.toml").read_text())["data"]["decode"] == choice
    reference_dir = tmp_path / "reference"
    reference = last_json(train(demo_registry, reference_dir, *EVERYTHING, "--set", "train.epochs=2",
                                "--set", f'data.decode="{choice}"'))
    assert_bit_identical(resumed, reference, run_dir, reference_dir)


RUNS = "ddp-run-dirs"  # not the unit tests' bucket: one server may serve both
EVERY_METHOD = ("GET", "PUT", "HEAD", "DELETE", "POST")


def test_a_run_in_a_bucket_killed_resumes_on_an_empty_disk_from_the_bucket_alone_identical_and_is_drawn(
        demo_registry, s3_endpoint, aws, tmp_path, uninterrupted):
    """Through a proxy failing 5% of all requests: SIGKILL once step 5 is in the bucket, then a fresh
    process with an empty staging folder resumes from the bucket and ends where the unbroken run ends;
    no file in the bucket or on either node's disk holds the secret key; `ddp report` draws the run."""
    from ddp_cli.bench.faultproxy import FaultProxy, Faults

    reference, reference_dir = uninterrupted
    fs = s3fs.S3FileSystem(key=KEY, secret=SECRET, client_kwargs={"endpoint_url": s3_endpoint},
                           skip_instance_cache=True)
    fs.mkdir(RUNS)
    url, args = f"s3://{RUNS}/runs/demo", ["--set", "checkpoint.every_steps=5", *EVERYTHING,
                                           "--set", "train.epochs=2"]
    with FaultProxy(s3_endpoint, Faults(fail_rate=0.05, methods=EVERY_METHOD, seed=1)) as proxy:
        env = {**ENV, "AWS_ENDPOINT_URL": proxy.url}
        run = LiveRun("train", "configs/demo.toml", "--registry", str(demo_registry), "--run-dir", url,
                      *EXACT, *args, env={**env, "DDP_STAGING_DIR": str(tmp_path / "node-a")})
        landed = f"{RUNS}/runs/demo/checkpoints/step-000000005.pt.json"
        deadline = time.monotonic() + 120
        while not fs.exists(landed) and run.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
            fs.invalidate_cache()
        run.kill()
        assert fs.exists(landed), run.stderr[-3000:]
        assert run.wait(timeout=30) == -9
        resumed = train(demo_registry, url, *args, "--resume", "auto",
                        env={**env, "DDP_STAGING_DIR": str(tmp_path / "node-b")})  # an empty disk
    assert proxy.counts.refused > 0
    assert "checkpoints/step-0000000" in resumed.stderr and "downloaded to resume from" in resumed.stderr
    result = last_json(resumed)
    assert result["run_dir"] == url and result["final"] == reference["final"]
    fs.get(f"{RUNS}/runs/demo/checkpoints/last.pt", str(tmp_path / "last.pt"))
    a, b = torch.load(tmp_path / "last.pt", weights_only=True)["model"], weights(reference_dir)
    assert all(torch.equal(a[k], b[k]) for k in a), "resumed from the bucket differs from the unbroken run"
    stored = {key: fs.cat_file(key) for key in fs.find(RUNS)}
    local = {p: p.read_bytes() for p in tmp_path.glob("node-*/**/*") if p.is_file()}
    assert local and all(SECRET.encode() not in data for data in [*stored.values(), *local.values()])
    assert SECRET not in run.stderr + resumed.stderr + resumed.stdout
    aws.setenv("AWS_ENDPOINT_URL", s3_endpoint)
    drawn = last_json(ddp_in_process("report", url, "--json"))
    fs.invalidate_cache()
    assert drawn["plot"] == f"{url}/report.png" and fs.exists(f"{RUNS}/runs/demo/report.png")


# FixMatch on the demo, tiny (8 px, a width-8 model, 6 steps an epoch of 2 ranks x 8 labelled + 2 x 56 views):
# the unlabelled stream's first pass (1338 images, 112 a step) ends at step 11, after the resume below; a
# threshold just above chance (10 classes) puts the unlabelled loss to work from the start.
SEMI = ["--set", "semi.method=fixmatch", "--set", "semi.labels_per_class=10", "--set", "semi.threshold=0.15",
        "--set", "data.batch_size=8", "--set", "data.image_size=8", "--set", "data.val_resize=8",
        "--set", "model.kwargs={ width = 8 }", "--set", "distributed.stop_check_steps=1",
        "--set", "train.epochs=2"]


@pytest.mark.parametrize(("method", "decode"), [("fixmatch", "cpu"), ("freematch", "cpu"),
                                                ("softmatch", "cpu"), ("fixmatch", "gpu")])
def test_sigterm_with_fixmatch_on_resumes_the_labelled_and_unlabelled_streams_bit_identical(
        demo_registry, tmp_path, method, decode):
    """The streams' positions and FreeMatch's and SoftMatch's running statistics (global: a 2-rank run)
    come back from the checkpoint so that the resumed run ends on the very weights of the reference; with
    data.decode "gpu" too (the CPU stand-in: the views rendered on the rank, from the same draws)."""
    reference_dir, run_dir = tmp_path / "reference", tmp_path / "run"
    # statistics that move fast (momentum 0.5), so that a resume without them would end elsewhere
    semi = [*SEMI, "--set", f"semi.method={method}", "--set", "semi.stats_momentum=0.5",
            "--set", f"data.decode={decode}"]
    reference = last_json(train(demo_registry, reference_dir, *semi))
    assert reference["semi"]["mask_rate"] > 0 and 0 < reference["semi"]["pseudo_label_top1"] <= 1
    records = [json.loads(line) for line in (reference_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in records if r["split"] == "semi"] == [1, 2]
    assert all("mask_rate" in r and "unsup_loss" in r for r in records if r["split"] == "train")
    run = LiveRun("train", "configs/demo.toml", "--registry", str(demo_registry), "--run-dir",
                  str(run_dir), *EXACT, *semi, env={"DDP_FAULTS": "sigterm@4"})
    assert run.wait(timeout=120) == 143, run.stderr
    stopped = torch.load(CheckpointStore(run_dir / "checkpoints", 1).latest_valid(), weights_only=True)
    assert stopped["epoch"] == 0 and stopped["step_in_epoch"] == 4  # mid-epoch (stop_check_steps 1)
    assert (stopped["unlabelled_epoch"], stopped["unlabelled_seen"]) == (0, 112 * stopped["step_in_epoch"])
    assert bool(stopped["semi_statistics"]) == (method != "fixmatch")
    assert_bit_identical(last_json(train(demo_registry, run_dir, *semi)), reference, run_dir, reference_dir)


@pytest.fixture
def small_disk(tmp_path):
    """A real tmpfs (as root: CI runs so), resized by calling it with a size; skipped where mounting
    is not permitted; always unmounted."""
    folder = tmp_path / "disk"
    folder.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    try:
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(folder)], check=True,
                       capture_output=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as e:
        pytest.skip(f"cannot mount a tmpfs here: {e}")

    def resize(size: int) -> Path:
        subprocess.run(["mount", "-o", f"remount,size={size}", str(folder)], check=True, timeout=30)
        return folder

    yield resize
    subprocess.run(["umount", "-l", str(folder)], check=False, timeout=30)


def test_a_full_disk_at_a_background_checkpoint_is_exit_6_naming_the_last_good_one_and_resumes_identical(
        demo_registry, small_disk, uninterrupted):
    """A real full disk: room for the run dir and one and a half checkpoints, so the second (step 10,
    written in the background) does not fit; once there is room, --resume auto ends as if never broken."""
    reference, reference_dir = uninterrupted
    checkpoint = (reference_dir / "checkpoints/last.pt").stat().st_size
    rest = sum(p.stat().st_blocks * 512 for p in reference_dir.rglob("*")
               if p.is_file() and p.parent.name != "checkpoints")
    run_dir = small_disk(rest + checkpoint * 3 // 2 + (64 << 10)) / "run"
    every = ["--set", "checkpoint.every_steps=5", *EVERYTHING, "--set", "train.epochs=2"]
    full = train(demo_registry, run_dir, *every, "--set", "checkpoint.background=true")
    good = run_dir / "checkpoints/step-000000005.pt"
    assert full.returncode == 6, full.stderr[-3000:]
    assert json.loads(full.stdout.strip().splitlines()[-1])["error"].startswith(
        f"could not write {run_dir}/checkpoints/step-000000010.pt: no space left on the device holding ")
    assert f"the last good checkpoint is {good}; make room and rerun" in full.stderr
    assert "Traceback" not in full.stderr and "PytorchStreamWriter" not in full.stderr
    assert CheckpointStore(run_dir / "checkpoints", 1).latest_valid() == good  # intact
    small_disk(64 << 20)  # room made
    resumed = train(demo_registry, run_dir, *every, "--resume", "auto")
    assert f"resumed from {good}" in resumed.stderr
    assert_bit_identical(last_json(resumed), reference, run_dir, reference_dir)


def test_a_full_disk_under_max_restarts_is_exit_6_in_every_incarnation(demo_registry, small_disk):
    """The disk fills after step 8 and stays full: the first incarnation's checkpoint at step 10 is
    refused (exit 6), and so is the restarted one's, whose rank log cannot be written either; each ends
    at once (a rank that met the full disk writing its own stderr once left through multiprocessing's
    exit, which waits on its loaders forever, its peer in a collective with it), and the launch exit 6."""
    disk = small_disk(64 << 20)
    run_dir = disk / "run"
    full = train(demo_registry, run_dir, "--set", "checkpoint.every_steps=5", "--max-restarts", "2",
                 env={"DDP_FAULTS": "diskfull@8", "DDP_FAULTS_DISK": str(disk)}, timeout=150)
    assert full.returncode == 6, full.stderr[-3000:]
    assert json.loads(full.stdout.strip().splitlines()[-1])["exit_code"] == 6
    assert (run_dir / "logs/rank0.restart2.stderr.log").exists()  # every incarnation ran, and ended
    good = run_dir / "checkpoints/step-000000005.pt"
    assert CheckpointStore(run_dir / "checkpoints", 1).latest_valid() == good


def test_a_killed_worker_is_restarted_and_the_run_finishes(demo_registry, tmp_path, uninterrupted):
    reference, _ = uninterrupted
    run_dir = tmp_path / "run"
    run = LiveRun("train", "configs/demo.toml", "--registry", str(demo_registry), "--run-dir",
                  str(run_dir), *EXACT, *EVERYTHING, "--set", "train.epochs=2",
                  "--set", "checkpoint.every_steps=4", "--max-restarts", "3",
                  env={"DDP_FAULTS": "sigkill@10:1"})  # rank 1 dies after step 10 (the first incarnation)
    assert run.wait(timeout=200) == 0, run.stderr
    out = json.loads((run_dir / "result.json").read_text())
    assert out["restarts"] == 1
    assert "resumed from" in run.stderr and "step-000000008.pt" in run.stderr
    assert out["final"] == reference["final"]  # restarted from step 8, as if never broken


def test_workers_do_not_outlive_a_launcher_killed_with_sigkill(demo_registry, tmp_path):
    """SIGKILL cannot be caught, so the workers (in sessions of their own) must notice by themselves."""
    run = LiveRun.demo_at_step_2(demo_registry, tmp_path / "run")
    workers = run.workers()
    assert len(workers) == 2
    run.proc.kill()
    deadline = time.monotonic() + 20
    while any(alive(pid) for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(alive(pid) for pid in workers), "orphaned workers"
    run.wait(timeout=10)


def alive(pid: int) -> bool:
    """Running, not a zombie waiting to be reaped."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_a_torn_checkpoint_is_skipped_for_the_previous_one(demo_registry, tmp_path):
    run_dir = tmp_path / "run"
    short = ["--set", "train.max_steps_per_epoch=12", "--set", "checkpoint.every_steps=5",
             "--set", "data.workers=0"]
    last_json(train(demo_registry, run_dir, "--set", "train.epochs=1", *short))
    newest = CheckpointStore(run_dir / "checkpoints", 1).steps()[-1]
    with open(newest, "r+b") as f:  # a kill mid-write (also tears last.pt: the same file, linked)
        f.truncate(newest.stat().st_size // 2)
    result = train(demo_registry, run_dir, "--set", "train.epochs=2", *short)
    out = last_json(result)  # steps 5, 10, 12 (epoch end, torn): resumes from 10
    assert "skipping checkpoint" in result.stderr and "resumed from" in result.stderr
    assert "step-000000010.pt" in result.stderr
    assert out["epochs"] == 2 and out["final"]["images"] == 359


class Payload:
    """Unpickling this runs `touch MARKER`: what a hostile checkpoint would do with a shell."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def plant_malicious(path: Path, marker: Path, fmt: str = "torch") -> Path:
    """A checkpoint-shaped file whose "model" runs code when unpickled (torch.save zip or bare pickle)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {"format": 1, "epoch": 0, "step": 99, "step_in_epoch": 0, "model": Payload(marker)}
    if fmt == "torch":
        torch.save(state, path)
    else:
        path.write_bytes(pickle.dumps(state))
    return path


def assert_refused(result, marker: Path) -> None:
    assert not marker.exists(), "the checkpoint's pickled code ran"
    assert result.returncode == 3, result.stderr[-3000:]
    refusals = [line for line in result.stderr.splitlines() if "refused" in line]
    assert len(refusals) == 1, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]


SHORT = ["--set", "train.epochs=1", "--set", "train.max_steps_per_epoch=1", "--set", "data.workers=0"]


@pytest.mark.parametrize("fmt", ["torch", "pickle"])
def test_validate_refuses_a_malicious_checkpoint_and_runs_nothing(tmp_path, fmt):
    marker = tmp_path / "pwned"
    evil = plant_malicious(tmp_path / "evil.pt", marker, fmt)
    assert_refused(run_ddp("validate", "--checkpoint", str(evil), timeout=60), marker)


def test_resume_path_refuses_a_malicious_checkpoint_and_runs_nothing(demo_registry, tmp_path):
    """The real resume path (no --dry-run): the workers load the file and must refuse it."""
    marker = tmp_path / "pwned"
    evil = plant_malicious(tmp_path / "evil.pt", marker)
    result = run_ddp("train", "configs/demo.toml", "--registry", str(demo_registry), "--run-dir",
                     str(tmp_path / "run"), "--resume", str(evil), *SHORT, timeout=120)
    assert_refused(result, marker)


def test_resume_auto_refuses_a_malicious_newest_checkpoint_and_runs_nothing(demo_registry, tmp_path):
    """Planted as the run dir's newest step file, with a manifest whose sha256 matches: auto picks it."""
    marker = tmp_path / "pwned"
    run_dir = tmp_path / "run"
    evil = plant_malicious(run_dir / "checkpoints" / "step-000000099.pt", marker)
    write_manifest(evil, {"epoch": 0, "step": 99, "step_in_epoch": 0, "top1": None})
    assert CheckpointStore(run_dir / "checkpoints", 1).latest_valid() == evil  # what --resume auto picks
    result = run_ddp("train", "configs/demo.toml", "--registry", str(demo_registry), "--run-dir",
                     str(run_dir), "--resume", "auto", *SHORT, timeout=120)
    assert_refused(result, marker)


def test_another_models_checkpoint_is_one_error_line_from_all_workers(demo_registry, tmp_path,
                                                                       uninterrupted):
    _, reference_dir = uninterrupted
    result = run_ddp("train", "configs/demo.toml", "--registry", str(demo_registry), "--run-dir",
                     str(tmp_path / "run"), "--resume", str(reference_dir / "checkpoints/last.pt"),
                     "--set", "model.name=resnet18", "--set", "data.workers=0")
    assert result.returncode == 2, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, result.stderr  # every worker meets it; the launcher says it once
    assert "another model or class count" in errors[0] and "Traceback" not in result.stderr
