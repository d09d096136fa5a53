"""A run dir in a bucket (run.bucket, run.mirror, run.pull) against moto's S3 server in this process:
the order that makes a checkpoint count, pruning in the bucket, torn checkpoints skipped on resume,
transient faults retried, an upload that keeps failing named with the last safe checkpoint."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
import torch
from conftest import KEY, REPO, SECRET

from ddp_cli.bench.faultproxy import FaultProxy, Faults
from ddp_cli.data.fetch.retry import IoPolicy
from ddp_cli.errors import ConfigError, DataError
from ddp_cli.run.bucket import PER_RANK, RunBucket
from ddp_cli.run.mirror import BucketMirror, upload_files
from ddp_cli.run.pull import fetch_checkpoint, stage
from ddp_cli.train.checkpoint import Checkpointer, CheckpointStore

BUCKET = "ddp-runs"
FAST = IoPolicy(retries=3, wait_s=0.001)
EVERY_METHOD = ("GET", "PUT", "HEAD", "DELETE", "POST")


@pytest.fixture
def run_url(s3_endpoint, aws, tmp_path):
    """A fresh prefix of the bucket, the loopback endpoint in AWS_ENDPOINT_URL, fake credentials."""
    import s3fs

    fs = s3fs.S3FileSystem(key=KEY, secret=SECRET, client_kwargs={"endpoint_url": s3_endpoint},
                           skip_instance_cache=True)
    if not fs.exists(BUCKET):
        fs.mkdir(BUCKET)
    aws.setenv("AWS_ENDPOINT_URL", s3_endpoint)
    aws.setenv("DDP_STAGING_DIR", str(tmp_path / "staging"))
    return f"s3://{BUCKET}/runs/{tmp_path.name}"


def mirrored_store(folder, url, keep_last=2):
    (folder / "checkpoints").mkdir(parents=True)
    mirror = BucketMirror(RunBucket(url, FAST), folder)
    return CheckpointStore(folder / "checkpoints", keep_last, mirror), mirror


def save(store, step, best=False):
    info = {"step": step, "epoch": 0, "top1": None}
    store.save({"model": {"w": torch.full((8,), float(step))}}, info, best)


def contents(url):
    bucket = RunBucket(url)
    return {name: bucket.read(name) for name in bucket.names()}


def test_a_checkpoint_counts_in_the_bucket_only_once_whole_and_pruning_follows(run_url, tmp_path,
                                                                               monkeypatch):
    calls = []
    for method, at in (("put", 1), ("write", 0), ("copy", 1), ("remove", 0)):  # where the name is
        original = getattr(RunBucket, method)

        def spy(self, *args, _method=method, _original=original, _at=at):
            calls.append((_method, args[_at]))
            return _original(self, *args)
        monkeypatch.setattr(RunBucket, method, spy)
    folder = tmp_path / "run"
    store, mirror = mirrored_store(folder, run_url)
    save(store, 1, best=True)
    (folder / "metrics.jsonl").write_text('{"step": 1}\n')
    save(store, 2)
    (folder / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')  # appended: uploaded whole again
    save(store, 3)
    mirror.close()
    stored = contents(run_url)
    names = ("step-000000002.pt", "step-000000003.pt", "last.pt", "best.pt")
    expected = {f"checkpoints/{n}{m}" for n in names for m in ("", ".json")}
    assert set(stored) == expected | {"metrics.jsonl"}  # step 1 pruned here, so in the bucket too
    assert stored["metrics.jsonl"] == b'{"step": 1}\n{"step": 2}\n'
    assert stored["checkpoints/last.pt"] == (folder / "checkpoints/step-000000003.pt").read_bytes()
    assert stored["checkpoints/best.pt"] == (folder / "checkpoints/best.pt").read_bytes()  # step 1's
    for i, (method, name) in enumerate(calls):
        if name.endswith(".pt.json") and method != "remove":  # a manifest: its object went up before it
            assert name.removesuffix(".json") in [n for m, n in calls[:i] if m in ("put", "copy")], calls
    pruned = [name for method, name in calls if method == "remove"]
    assert pruned == ["checkpoints/step-000000001.pt.json", "checkpoints/step-000000001.pt"]


def test_resume_from_the_bucket_skips_torn_checkpoints_and_leftovers_of_the_node(run_url, tmp_path):
    folder = tmp_path / "run"
    store, mirror = mirrored_store(folder, run_url, keep_last=3)
    for step in (1, 2, 3):
        save(store, step)
    (folder / "metrics.jsonl").write_text('{"step": 3}\n')
    mirror.close()
    bucket = RunBucket(run_url)
    (tmp_path / "x").write_bytes(b"not the checkpoint")
    bucket.put(tmp_path / "x", "checkpoints/step-000000004.pt")  # an upload cut before its manifest
    bucket.put(tmp_path / "x", "checkpoints/step-000000003.pt")  # altered: its manifest's sha256 differs
    bucket.remove("checkpoints/last.pt.json")  # last.pt (step 3) torn as well
    staging = tmp_path / "fresh"
    (staging / "checkpoints").mkdir(parents=True)
    (staging / "checkpoints/step-000000009.pt").write_bytes(b"a leftover of this node")
    stage(bucket, staging, "auto")
    assert sorted(p.name for p in (staging / "checkpoints").iterdir()) == [
        "step-000000002.pt", "step-000000002.pt.json"]
    assert (staging / "checkpoints/step-000000002.pt").read_bytes() == \
        (folder / "checkpoints/step-000000002.pt").read_bytes()
    assert (staging / "metrics.jsonl").read_text() == '{"step": 3}\n'  # the run's metrics go on from here


def test_fetch_checkpoint_checks_the_manifest(run_url, tmp_path):
    folder = tmp_path / "run"
    store, mirror = mirrored_store(folder, run_url)
    save(store, 1)
    mirror.close()
    local = fetch_checkpoint(f"{run_url}/checkpoints/last.pt")
    assert local.read_bytes() == (folder / "checkpoints/last.pt").read_bytes()
    bucket = RunBucket(run_url)
    bucket.put(tmp_path / "run/checkpoints/last.pt", "checkpoints/orphan.pt")
    with pytest.raises(DataError, match="orphan.pt: no manifest"):
        fetch_checkpoint(f"{run_url}/checkpoints/orphan.pt")
    with pytest.raises(ConfigError, match="nope.pt: no such object"):
        fetch_checkpoint(f"{run_url}/checkpoints/nope.pt")
    bucket.put(folder / "checkpoints/last.pt.json", "checkpoints/step-000000001.pt")  # its sha256 differs
    with pytest.raises(DataError, match="differs from its manifest"):
        fetch_checkpoint(f"{run_url}/checkpoints/step-000000001.pt")


def test_transient_faults_on_every_request_leave_the_same_checkpoints(run_url, tmp_path, monkeypatch):
    endpoint = os.environ["AWS_ENDPOINT_URL"]
    with FaultProxy(endpoint, Faults(fail_rate=0.2, methods=EVERY_METHOD, seed=3)) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
        folder = tmp_path / "run"
        store, mirror = mirrored_store(folder, run_url)
        for step in (1, 2, 3):
            save(store, step, best=step == 2)
        mirror.close()
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    assert proxy.counts.refused > 0
    local = {p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*") if p.is_file()}
    assert contents(run_url) == local


def test_an_upload_that_keeps_failing_ends_the_run_naming_it_and_the_last_safe_checkpoint(
        run_url, tmp_path, monkeypatch):
    endpoint = os.environ["AWS_ENDPOINT_URL"]
    with FaultProxy(endpoint, Faults(fail_paths=("step-000000002.pt",))) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
        store, mirror = mirrored_store(tmp_path / "run", run_url, keep_last=5)
        checkpointer = Checkpointer(store)
        for step in (1, 2, 3):
            save(store, step)
        deadline = time.monotonic() + 30
        while mirror.failure is None and time.monotonic() < deadline:
            time.sleep(0.01)
        with pytest.raises(DataError) as failed:
            checkpointer.due()  # the next step boundary
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    message = str(failed.value)
    assert message.startswith(f"{run_url}/checkpoints/step-000000002.pt: the storage failed 4 times in a row")
    assert f"the last checkpoint complete in the bucket is {run_url}/checkpoints/step-000000001.pt" in message
    with pytest.raises(DataError):
        mirror.close()
    stage(RunBucket(run_url), tmp_path / "resume", "auto")
    assert sorted(p.name for p in (tmp_path / "resume/checkpoints").iterdir()) == [
        "step-000000001.pt", "step-000000001.pt.json"]  # never step 3, uploaded after the failure



def test_a_checkpoint_pruned_before_its_turn_to_upload_is_skipped_and_said(run_url, tmp_path, monkeypatch,
                                                                         caplog):
    reached, held, write = threading.Event(), threading.Event(), RunBucket.write

    def slow_write(self, name, data):  # step 1's upload ends as late as the test says
        if name == "checkpoints/step-000000001.pt.json":
            reached.set()
            assert held.wait(30)
        return write(self, name, data)
    monkeypatch.setattr(RunBucket, "write", slow_write)
    store, mirror = mirrored_store(tmp_path / "run", run_url, keep_last=1)
    save(store, 1)
    assert reached.wait(30)
    for step in (2, 3):  # 2 is pruned on the node while 1 goes up
        save(store, step)
    held.set()
    mirror.close()
    assert "checkpoints/step-000000002.pt" not in contents(run_url)
    said = [r.getMessage() for r in caplog.records if "pruned on the node" in r.getMessage()]
    assert len(said) == 1 and f"{run_url}/checkpoints/step-000000002.pt was pruned" in said[0], said
    assert f"the bucket's newest is {run_url}/checkpoints/step-000000001.pt" in said[0]
    assert "checkpoint.every_steps" in said[0]

def test_a_node_other_than_rank_0s_uploads_its_ranks_logs_only(run_url, tmp_path):
    """Its metrics.jsonl is the copy it downloaded at start: uploaded, it would undo rank 0's."""
    folder = tmp_path / "node-1"
    for name in ("metrics.jsonl", "result.json", "logs/rank2.stderr.log", "errors/rank3.json"):
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(name)
    upload_files(RunBucket(run_url), folder, {}, PER_RANK)
    assert sorted(contents(run_url)) == ["errors/rank3.json", "logs/rank2.stderr.log"]


@pytest.mark.parametrize(("flag", "configured", "expected"), [
    (None, "s3://b/runs/x", ("s3://b/runs/x", "checkpoint.dir")),
    (None, "elsewhere/x", (Path("elsewhere/x"), "checkpoint.dir")),
    (Path("mine"), "s3://b/runs/x", (Path("mine"), "--run-dir")), (None, None, "runs/demo-"),
    (None, "gs://b/r", ConfigError)])
def test_checkpoint_dir_is_the_run_dir_where_no_flag_gives_one(flag, configured, expected, monkeypatch):
    """And what chose it, for an error about it to name; with neither, runs/<name>-<time>."""
    from contextlib import contextmanager

    from ddp_cli.cli.commands import training
    from ddp_cli.config import load_config

    @contextmanager
    def indexed(config, overrides, registry):
        yield load_config(config, overrides), None

    seen = []
    monkeypatch.setattr(training, "indexed", indexed)
    monkeypatch.setattr(training, "launch_training",
                        lambda cfg, build, run_dir, flag, *rest: seen.append((run_dir, flag)))
    sets = [f"checkpoint.dir={configured}"] if configured else []
    train = lambda: training.train(REPO / "configs/demo.toml", sets, None, flag,  # noqa: E731
                                   training.LaunchFlags(), "auto", True)
    if expected is ConfigError:
        with pytest.raises(ConfigError, match="checkpoint.dir gs://b/r: ddp writes runs to a folder or"):
            train()
    elif isinstance(expected, str):
        train()
        assert str(seen[0][0]).startswith(expected) and seen[0][1] == "--run-dir"
    else:
        train()
        assert seen == [expected]


def test_a_stop_names_the_bucket_to_resume_from_not_the_staging_folder(tmp_path):
    import signal
    from types import SimpleNamespace

    from ddp_cli.errors import DdpError

    store = CheckpointStore(tmp_path / "checkpoints", 1, SimpleNamespace(url="s3://b/runs/x"))
    checkpointer = Checkpointer(store)
    checkpointer.stopping = signal.SIGTERM
    with pytest.raises(DdpError, match="the same command with --run-dir s3://b/runs/x resumes it"):
        checkpointer.end_if_stopping(tmp_path / "checkpoints/step-000000005.pt")
