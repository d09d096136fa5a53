"""`ddp sweep` end to end: a bad space stops before any trial; a sweep killed mid-trial resumes with
no trial lost or run twice and leaves no process behind; two sweep processes share one study in a
real PostgreSQL server (on loopback, started here) and run each trial once."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import optuna
import pytest
from conftest import LiveRun, ddp_in_process, last_json, run_ddp

# trials that check mechanisms, not accuracy: 2 short epochs of 16 px images, loading in-process
FAST = ["--set", "train.epochs=2", "--set", "train.max_steps_per_epoch=2", "--set", "data.workers=0",
        "--set", "data.image_size=16", "--set", "data.val_resize=16"]
SPACE = """
[params]
"optim.lr_per_256" = { low = 0.1, high = 1.0, log = true }
"optim.label_smoothing" = { choices = [0.0, 0.1] }
[pruner]
name = "none"
"""
PG_BIN = Path("/usr/lib/postgresql/15/bin")


@pytest.fixture(scope="module")
def space(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("space") / "space.toml"
    path.write_text(SPACE)
    return path


def sweep_args(space: Path, registry: Path, *more: str) -> list[str]:
    return ["sweep", "configs/demo.toml", "--space", str(space), "--registry", str(registry), *FAST, *more]


def processes_naming(text: str) -> list[str]:
    """Command lines of live processes that mention `text` (a sweep dir: its trials' launchers, workers)."""
    found = []
    for entry in Path("/proc").iterdir():
        with contextlib.suppress(OSError):
            if entry.name.isdigit() and int(entry.name) != os.getpid():
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                stat = (entry / "stat").read_text()
                if text in cmdline and ") Z" not in stat:
                    found.append(cmdline)
    return found


def load(folder: Path, name: str | None = None, url: str | None = None) -> optuna.Study:
    name = name or json.loads((folder / "sweep.json").read_text())["study"]
    return optuna.load_study(study_name=name, storage=url or f"sqlite:///{folder / 'study.db'}")


def test_a_bad_space_is_exit_2_naming_the_key_before_any_trial(tmp_path, demo_registry):
    bad = tmp_path / "space.toml"
    bad.write_text('[params]\n"optim.lr_per_265" = { low = 0.1, high = 1.0 }\n')
    result = ddp_in_process(*sweep_args(bad, demo_registry, "--sweep-dir", str(tmp_path / "sweep")))
    assert result.returncode == 2, result.stderr
    assert "optim.lr_per_265: unknown key" in result.stderr and "did you mean 'lr_per_256'" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "sweep").exists()  # no study, no trial


def test_a_sweep_killed_mid_trial_resumes_with_no_trial_lost_or_run_twice(tmp_path, space, demo_registry):
    folder = tmp_path / "sweep"
    args = sweep_args(space, demo_registry, "--trials", "2", "--sweep-dir", str(folder), "--json")
    first = LiveRun(*args)
    try:
        first.wait_for("trial 0: complete", timeout=180)
        deadline = time.monotonic() + 120
        while not (folder / "trial-0001" / "metrics.jsonl").is_file() and time.monotonic() < deadline:
            time.sleep(0.2)  # trial 1 training: its first metrics written
        os.kill(first.proc.pid, signal.SIGKILL)
        first.proc.wait(30)
    finally:
        first.kill()
    deadline = time.monotonic() + 90
    while processes_naming(str(folder)) and time.monotonic() < deadline:
        time.sleep(0.5)  # the trial was told to stop (SIGTERM) when its sweep died
    assert processes_naming(str(folder)) == []
    cut_log = (folder / "logs" / "trial-0001.log").read_text()
    assert "stopped by SIGTERM" in cut_log, cut_log[-2000:]  # told to stop, not left to run on its own
    assert not (folder / "trial-0001" / "result.json").exists()

    result = last_json(run_ddp(*args))
    assert result["trials"] == {"complete": 2, "pruned": 0, "failed": 1}
    trials = load(folder).get_trials()
    by_number = {t.number: t for t in trials}
    assert by_number[0].state.name == "COMPLETE" and by_number[1].state.name == "FAIL"
    assert by_number[1].user_attrs["ddp_failure"].startswith("cut")
    retry = [t for t in trials if t.user_attrs.get("ddp_retry_of") == 1]
    assert len(retry) == 1 and retry[0].state.name == "COMPLETE"
    assert retry[0].params == by_number[1].params  # the cut trial's values, run again
    assert [t.number for t in trials if t.state.name == "COMPLETE"] == [0, retry[0].number]  # 0 not again
    assert (folder / f"trial-{retry[0].number:04d}" / "result.json").is_file()
    best = result["best"]
    assert best["trial"] in (0, retry[0].number) and Path(best["config"]).is_file()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def postgres_url():
    """A PostgreSQL server on loopback in a temporary folder, for this module: as `nobody` when the tests
    run as root (initdb refuses root), stopped and removed afterwards."""
    if not (PG_BIN / "postgres").is_file():
        pytest.skip(f"no PostgreSQL server binaries in {PG_BIN}")
    pytest.importorskip("psycopg")
    as_user = ["runuser", "-u", "nobody", "--"] if os.geteuid() == 0 else []
    if as_user and not shutil.which("runuser"):
        pytest.skip("running as root without runuser: initdb cannot run as root")
    folder = Path(tempfile.mkdtemp(prefix="ddp-pg-"))
    if as_user:
        shutil.chown(folder, "nobody")
    server = None
    try:
        subprocess.run([*as_user, str(PG_BIN / "initdb"), "-D", str(folder / "data"), "-U", "ddp",
                        "--auth=trust", "--no-sync"], check=True, capture_output=True, timeout=120)
        port = free_port()
        server = subprocess.Popen(
            [*as_user, str(PG_BIN / "postgres"), "-D", str(folder / "data"), "-p", str(port),
             "-h", "127.0.0.1", "-k", str(folder), "-c", "fsync=off"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        import psycopg

        deadline = time.monotonic() + 60
        while True:
            try:
                connection = psycopg.connect(host="127.0.0.1", port=port, user="ddp", dbname="postgres",
                                             autocommit=True)
                break
            except psycopg.OperationalError:
                if time.monotonic() > deadline or server.poll() is not None:
                    pytest.fail("PostgreSQL did not start")
                time.sleep(0.3)
        connection.execute("CREATE DATABASE optuna")
        connection.close()
        yield f"postgresql://ddp@127.0.0.1:{port}/optuna"
    finally:
        if server:
            os.killpg(server.pid, signal.SIGINT)  # fast shutdown
            try:
                server.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)
        shutil.rmtree(folder, ignore_errors=True)


def test_two_sweep_processes_share_one_postgresql_study_and_run_each_trial_once(
        tmp_path, space, demo_registry, postgres_url):
    runs = [LiveRun(*sweep_args(space, demo_registry, "--trials", "2", "--study", "shared",
                                "--storage", postgres_url, "--sweep-dir", str(tmp_path / name), "--json"))
            for name in ("a", "b")]
    try:
        codes = [run.wait(timeout=240) for run in runs]
    finally:
        for run in runs:
            run.kill()
    assert codes == [0, 0], [run.stderr[-2000:] for run in runs]
    trials = load(tmp_path, "shared", postgres_url).get_trials()
    numbers = [t.number for t in trials]
    assert len(numbers) == len(set(numbers)) and all(t.state.name == "COMPLETE" for t in trials)
    assert 2 <= len(trials) <= 3  # each process checks the count before it asks: one more at most
    ran = {name: sorted(int(p.name[6:]) for p in (tmp_path / name).glob("trial-*")) for name in ("a", "b")}
    assert sorted(ran["a"] + ran["b"]) == sorted(numbers)  # every trial run, by one process only
    assert ran["a"] and ran["b"]  # both took part
    assert {t.user_attrs["run_dir"] for t in trials} == {str(tmp_path / n / f"trial-{i:04d}")
                                                         for n in ran for i in ran[n]}


def test_a_pruned_trial_stops_at_its_epoch_end_cleanly_and_the_report_reads_it(tmp_path, demo_registry):
    """A study whose one finished trial reached 0.99 at epoch 1: the sweep's next trial is below that
    median at epoch 1 and is pruned there (of 2 epochs): exit 0, its epoch's checkpoint kept, PRUNED."""
    url, folder = f"sqlite:///{tmp_path / 'study.db'}", tmp_path / "sweep"
    seeded = optuna.create_study(storage=url, study_name="s", direction="maximize")
    choice = optuna.distributions.CategoricalDistribution([0.4])
    seeded.add_trial(optuna.trial.create_trial(params={"optim.lr_per_256": 0.4}, value=0.99,
                                               distributions={"optim.lr_per_256": choice},
                                               intermediate_values={1: 0.99, 2: 0.99}))
    space = tmp_path / "space.toml"
    space.write_text('[params]\n"optim.lr_per_256" = { choices = [0.4] }\n'
                     '[pruner]\nname = "median"\nn_startup_trials = 1\nn_warmup_steps = 0\n')
    run = run_ddp(*sweep_args(space, demo_registry, "--trials", "2", "--study", "s", "--storage", url,
                              "--sweep-dir", str(folder), "--json"))
    result = last_json(run)
    assert result["trials"] == {"complete": 1, "pruned": 1, "failed": 0}, run.stderr[-2000:]
    assert "trial 1: pruned at epoch 1" in run.stderr
    trial = load(folder, "s", url).trials[1]
    assert trial.state.name == "PRUNED" and list(trial.intermediate_values) == [1]
    trained = json.loads((folder / "trial-0001" / "result.json").read_text())
    assert trained["pruned_at_epoch"] == 1 and trained["epochs"] == 2
    lines = (folder / "trial-0001" / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert [r["epoch"] for r in records if r["split"] == "val"] == [1]
    assert (folder / "trial-0001" / "checkpoints" / "last.pt").exists()
    assert processes_naming(str(folder)) == []  # its workers ended with it

    report = ddp_in_process("sweep", "report", str(folder), "--json")
    assert report.returncode == 0, report.stderr
    got = last_json(report)
    assert [(r["trial"], r["state"], r["epochs"]) for r in got["trials"]] == [(0, "complete", 2),
                                                                            (1, "pruned", 1)]
    assert got["best"]["trial"] == 0
    assert set(got["plots"]) <= {"history", "importances", "parallel_coordinate"}
    assert Path(got["plots"]["history"]).is_file()
    dry = ddp_in_process("train", got["best"]["config"], "--registry", str(demo_registry), "--dry-run")
    assert dry.returncode == 0, dry.stderr  # the best config as `ddp train` takes it
