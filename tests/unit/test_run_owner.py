"""One owner per run dir (run.owner): a live owner refuses a second run (exit 2, naming its host and pid);
a gone one (dead pid on this host, an old heartbeat from another) is taken over with one warning; of
two runs racing for a stale lock one wins; the same on object storage with conditional writes (moto's
loopback S3 honours If-None-Match and If-Match), and a lease with a warning where a store ignores them."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import time
from dataclasses import replace

import pytest
from conftest import KEY, SECRET

from ddp_cli.errors import ConfigError
from ddp_cli.run import owner as ownermod
from ddp_cli.run.bucket import RunBucket
from ddp_cli.run.owner import LOCK, BucketLock, FileLock, Owner, take, take_run_dir


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def plant(store, **fields) -> Owner:
    owner = replace(Owner.me(), **fields)
    assert store.create(owner.encode()) is not None
    return owner


def test_a_live_owner_refuses_a_second_run_naming_its_host_and_pid(tmp_path):
    first = take(FileLock(tmp_path), "--run-dir R")
    try:
        written = (tmp_path / LOCK).read_bytes()
        with pytest.raises(ConfigError) as refused:
            take(FileLock(tmp_path), "--run-dir R")
        assert refused.value.exit_code == 2
        assert f"--run-dir R: owned by a live run, host {first.owner.host} pid {first.owner.pid} " in str(
            refused.value)
        assert (tmp_path / LOCK).read_bytes() == written  # the first's lock untouched
    finally:
        first.release()
    assert not (tmp_path / LOCK).exists()  # released: the next run takes it without a word
    take(FileLock(tmp_path), "--run-dir R").release()


def test_a_dead_owner_on_this_host_is_taken_over_with_one_warning(tmp_path, caplog):
    plant(FileLock(tmp_path), pid=dead_pid())
    with caplog.at_level(logging.WARNING, logger="ddp"):
        mine = take(FileLock(tmp_path), "--run-dir R")
    mine.release()
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "its process is gone: taken over by this run" in warnings[0]


def test_a_reused_pid_is_not_the_owner(tmp_path):
    plant(FileLock(tmp_path), pid_started=1)  # this very pid, but started at another time: another process
    take(FileLock(tmp_path), "--run-dir R").release()


def test_another_hosts_owner_is_gone_only_once_its_heartbeat_is_older_than_the_bound(tmp_path):
    store = FileLock(tmp_path)
    plant(store, host="elsewhere", heartbeat=time.time() - ownermod.STALE_S + 30)
    with pytest.raises(ConfigError, match="host elsewhere pid"):
        take(store, "--run-dir R")
    (tmp_path / LOCK).unlink()
    plant(store, host="elsewhere", heartbeat=time.time() - ownermod.STALE_S - 1)
    take(store, "--run-dir R").release()


def test_of_two_runs_taking_over_one_stale_lock_one_wins(tmp_path):
    stale = plant(FileLock(tmp_path), pid=dead_pid())
    version = stale.encode().decode()
    a, b = Owner.me(), replace(Owner.me(), token="b")
    assert FileLock(tmp_path).take_over(a.encode(), version) is not None
    assert FileLock(tmp_path).take_over(b.encode(), version) is None
    assert json.loads((tmp_path / LOCK).read_text())["token"] == a.token


def test_the_heartbeat_is_renewed_and_a_lock_taken_over_is_let_go(tmp_path, monkeypatch):
    monkeypatch.setattr(ownermod, "HEARTBEAT_S", 0.05)
    held = take(FileLock(tmp_path), "--run-dir R")
    started, deadline = held.owner.heartbeat, time.monotonic() + 10  # a loaded machine's thread runs late
    while json.loads((tmp_path / LOCK).read_text())["heartbeat"] <= started and time.monotonic() < deadline:
        time.sleep(0.05)
    assert json.loads((tmp_path / LOCK).read_text())["heartbeat"] > started
    (tmp_path / LOCK).write_text(replace(held.owner, token="thief").encode().decode())
    held.thread.join(timeout=10)
    assert not held.thread.is_alive()  # no longer ours: not renewed, and not removed on release
    held.release()
    assert json.loads((tmp_path / LOCK).read_text())["token"] == "thief"


@pytest.fixture
def run_url(s3_endpoint, aws, tmp_path):
    import s3fs

    fs = s3fs.S3FileSystem(key=KEY, secret=SECRET, client_kwargs={"endpoint_url": s3_endpoint},
                           skip_instance_cache=True)
    if not fs.exists("ddp-owned"):
        fs.mkdir("ddp-owned")
    aws.setenv("AWS_ENDPOINT_URL", s3_endpoint)
    return f"s3://ddp-owned/runs/{tmp_path.name}"


def test_in_a_bucket_conditional_writes_refuse_a_second_owner_and_let_one_taker_win(run_url):
    store = BucketLock(RunBucket(run_url))
    assert store.honours_conditional_writes()  # moto's loopback S3, as S3 itself
    first = take_run_dir(run_url, "--run-dir")
    try:
        with pytest.raises(ConfigError, match=f"owned by a live run, host {first.owner.host} pid"):
            take_run_dir(run_url, "--run-dir")
    finally:
        first.release()
    assert RunBucket(run_url).names() == []  # released, and the probe object gone
    stale = plant(store, pid=dead_pid())
    version = store.read()[1]
    assert store.take_over(Owner.me().encode(), version) is not None
    assert store.take_over(Owner.me().encode(), version) is None  # If-Match on the stale version: too late
    del stale


def test_a_store_that_ignores_conditional_writes_gets_a_lease_with_a_warning(run_url, monkeypatch, caplog):
    monkeypatch.setattr(BucketLock, "honours_conditional_writes", lambda self: False)
    monkeypatch.setattr(ownermod, "LEASE_SETTLE_S", 0.01)
    with caplog.at_level(logging.WARNING, logger="ddp"):
        held = take_run_dir(run_url, "--run-dir")
    assert any("ignores conditional writes" in r.getMessage() and "lease" in r.getMessage()
               for r in caplog.records)
    with pytest.raises(ConfigError, match="owned by a live run"):
        take_run_dir(run_url, "--run-dir")  # a lease still looks before it writes
    held.release()


def test_a_renewal_whose_answer_was_lost_keeps_the_lock(tmp_path, monkeypatch):
    """Through a store that drops connections, a renewal that landed is retried and refused (If-Match on
    the old version): the lock still holds this run's token, so it goes on renewing."""
    monkeypatch.setattr(ownermod, "HEARTBEAT_S", 0.05)
    store = FileLock(tmp_path)
    held = take(store, "--run-dir R")
    real = store.renew

    def landed_but_refused(data, version):
        real(data, version)
        return None

    monkeypatch.setattr(store, "renew", landed_but_refused)
    time.sleep(0.3)
    assert held.thread.is_alive()
    assert json.loads((tmp_path / LOCK).read_text())["heartbeat"] > held.owner.started
    held.release()


def test_validate_holds_the_run_dir_its_files_land_in(tmp_path):
    """`validate --predictions/--confusion/--per-class` into a run dir (known by its metrics.jsonl or
    its lock) holds it as a run would; a file elsewhere holds nothing."""
    from ddp_cli.cli.commands.run_dirs import run_dir_of

    run = tmp_path / "run"
    (run / "evaluations").mkdir(parents=True)
    (run / "metrics.jsonl").write_text("")
    assert run_dir_of(run / "predictions.csv") == run
    assert run_dir_of(run / "evaluations" / "last-model.json") == run
    assert run_dir_of(tmp_path / "elsewhere" / "predictions.csv") is None
    held = take(FileLock(run), "--run-dir R")
    try:
        from ddp_cli.cli.commands.run_dirs import owned

        with pytest.raises(ConfigError, match="--predictions into run dir .*: owned by a live run"), \
                owned(run, True, "--predictions into run dir"):
            pass
    finally:
        held.release()
