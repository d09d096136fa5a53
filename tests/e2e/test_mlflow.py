"""[logging.mlflow] against a real `mlflow server` on loopback: a sweep's trial (a demo run) sends its
params, metrics and artefacts, nested under the sweep's run; against a server that is down a run
finishes all the same, with one warning."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from conftest import last_json, run_ddp

pytest.importorskip("mlflow")
FAST = ["--set", "train.epochs=2", "--set", "train.max_steps_per_epoch=2", "--set", "data.workers=0",
        "--set", "data.image_size=16", "--set", "data.val_resize=16"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    """`mlflow server` on a free loopback port, its store and artefacts in a temporary folder."""
    folder = tmp_path_factory.mktemp("mlflow")
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port),
         "--backend-store-uri", f"sqlite:///{folder / 'mlflow.db'}", "--artifacts-destination",
         str(folder / "artifacts"), "--workers", "1"],
        stdout=subprocess.DEVNULL, stderr=open(folder / "server.log", "w"), start_new_session=True)  # noqa: SIM115
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if urllib.request.urlopen(f"{url}/health", timeout=2).status == 200:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline or server.poll() is not None:
                pytest.fail(f"mlflow server did not start: {(folder / 'server.log').read_text()[-2000:]}")
            time.sleep(0.5)
        yield url
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(5)
        except subprocess.TimeoutExpired:  # its workers linger: a test's server, its store thrown away
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()


def test_a_sweeps_demo_run_reaches_the_server_nested_under_the_sweep(tmp_path, demo_registry, mlflow_server):
    from mlflow.tracking import MlflowClient

    space = tmp_path / "space.toml"
    space.write_text('[params]\n"optim.lr_per_256" = { choices = [0.4] }\n[pruner]\nname = "none"\n')
    result = last_json(run_ddp(
        "sweep", "configs/demo.toml", "--space", str(space), "--trials", "1",
        "--registry", str(demo_registry),
        "--sweep-dir", str(tmp_path / "sweep"), "--json", *FAST,
        "--set", f"logging.mlflow.tracking_uri={mlflow_server}", "--set", "logging.mlflow.experiment=e2e"))
    client = MlflowClient(mlflow_server)
    experiment = client.get_experiment_by_name("e2e")
    runs = {r.info.run_name: r for r in client.search_runs([experiment.experiment_id])}
    parent, trial = runs[f"sweep-{result['study']}"], runs["trial-0000"]
    assert trial.data.tags["mlflow.parentRunId"] == parent.info.run_id
    assert trial.info.status == parent.info.status == "FINISHED"
    params = trial.data.params
    assert params["optim.lr_per_256"] == "0.4" and params["train.epochs"] == "2"
    assert params["model.name"] == "resnet_tiny" and params["data.image_size"] == "16"  # the whole config
    top1 = client.get_metric_history(trial.info.run_id, "val/top1")
    assert [m.step for m in top1] == [2, 4]  # an epoch each
    served = client.get_metric_history(trial.info.run_id, "val_ema/top1")  # the weights best.pt holds
    assert max(m.value for m in served) == pytest.approx(result["best"]["value"])  # the best epoch's
    assert client.get_metric_history(trial.info.run_id, "train/loss")  # every logging window
    artefacts = {a.path for a in client.list_artifacts(trial.info.run_id)}
    assert artefacts == {"model", "report.png"}
    assert {a.path for a in client.list_artifacts(trial.info.run_id, "model")} == \
        {"model/model.pt", "model/model.pt.card.json"}
    assert {a.path for a in client.list_artifacts(parent.info.run_id)} >= {"best.toml", "history.png"}


def test_a_server_that_is_down_costs_one_warning_and_the_run_finishes(tmp_path, demo_registry):
    down = f"http://127.0.0.1:{free_port()}"
    result = run_ddp("train", "configs/demo.toml", "--registry", str(demo_registry), "--run-dir",
                     str(tmp_path / "run"), "--json", "--quiet", *FAST,
                     "--set", f"logging.mlflow.tracking_uri={down}")
    summary = last_json(result)
    assert summary["final"]["top1"] >= 0 and (tmp_path / "run" / "checkpoints" / "last.pt").is_file()
    warnings = [line for line in result.stderr.splitlines() if "warning" in line.lower()]
    assert len(warnings) == 1, result.stderr[-3000:]
    assert warnings[0].startswith(f"warning: logging.mlflow: {down} refused an update")
    assert Path(tmp_path / "run" / "model" / "model.pt").is_file()  # exported for the run that had no server
