"""[logging.mlflow]: the sink's run (params flattened, metrics per record, artefacts, nesting, the model
registry) in a local store, and a tracking server that is down: one warning, never an error."""

from __future__ import annotations

import logging
import socket
import time

import pytest

from ddp_cli.config import LoggingConfig, MlflowConfig, config_from_dict
from ddp_cli.errors import ConfigError
from ddp_cli.observe import mlflow_sink
from ddp_cli.observe.mlflow_sink import PARENT_ENV, MlflowSink, flatten, tracking_uri
from ddp_cli.observe.sinks import Sinks, check_sinks

CONFIG = {"name": "demo", "optim": {"lr_per_256": 0.4, "name": "sgd"}, "train": {"epochs": 2}}


def records() -> list[dict]:
    return [{"split": "train", "epoch": 1, "step": 5, "loss": 2.1, "lr": 0.1, "lrs": [0.1], "time": 1.0},
            {"split": "val", "epoch": 1, "step": 10, "loss": 1.5, "top1": 0.5, "top5": 0.9, "time": 2.0},
            {"split": "val", "epoch": 2, "step": 20, "loss": 0.5, "top1": 0.8, "top5": 1.0, "time": 3.0}]


def test_params_metrics_and_artefacts_reach_the_run(tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    store = (tmp_path / "store").as_uri()  # a sqlite store's artefacts go to ./mlruns unless told
    experiment = MlflowClient(uri).create_experiment("sweeps", artifact_location=store)
    parent = MlflowClient(uri).create_run(experiment).info.run_id
    monkeypatch.setenv(PARENT_ENV, parent)
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "model.pt").write_bytes(b"weights")
    (tmp_path / "report.png").write_bytes(b"png")
    sink = MlflowSink(MlflowConfig(tracking_uri=uri, experiment="sweeps", registered_model="digits"),
                      tmp_path / "demo-1", CONFIG)
    sinks = Sinks([sink])
    for record in records():
        sinks.write(record)
    sink.attach(tmp_path / "model", "model")
    sink.attach(tmp_path / "report.png")
    sink.register()
    sinks.close()
    client = MlflowClient(uri)
    run = client.get_run(sink.run_id)
    assert run.info.run_name == "demo-1" and run.info.status == "FINISHED"
    assert run.data.params == {"name": "demo", "optim.lr_per_256": "0.4", "optim.name": "sgd",
                               "train.epochs": "2"}
    assert run.data.tags["mlflow.parentRunId"] == parent  # nested under the sweep's run
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "val/top1")] == \
        [(10, 0.5), (20, 0.8)]
    assert [m.value for m in client.get_metric_history(run.info.run_id, "train/loss")] == [2.1]
    assert sorted(a.path for a in client.list_artifacts(run.info.run_id)) == ["model", "report.png"]
    assert [a.path for a in client.list_artifacts(run.info.run_id, "model")] == ["model/model.pt"]
    assert [v.run_id for v in client.search_model_versions("name = 'digits'")] == [run.info.run_id]


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_server_that_is_down_is_one_warning_and_the_run_goes_on(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(mlflow_sink, "RETRY_S", 0.2)
    monkeypatch.setattr(mlflow_sink, "CLOSE_S", 1.0)
    url = f"http://127.0.0.1:{closed_port()}"
    with caplog.at_level(logging.INFO, "ddp"):
        sink = MlflowSink(MlflowConfig(tracking_uri=url), tmp_path / "run", CONFIG)
        started = time.monotonic()
        for record in records():
            sink.write(record)  # queued: never waits for the server
        assert time.monotonic() - started < 0.5
        time.sleep(1)
        sink.close()
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1, warnings
    assert warnings[0].startswith(f"warning: logging.mlflow: {url} refused an update")
    assert "training goes on" in warnings[0]
    assert any("3 update(s)" in r.getMessage() and "not sent" in r.getMessage() for r in caplog.records)
    assert not sink.thread.is_alive()


def test_flatten_and_where_a_folder_goes():
    assert flatten({"a": {"b": {"c": 1}}, "d": [1, 2]}) == {"a.b.c": "1", "d": "[1, 2]"}
    assert tracking_uri("http://host:5000") == "http://host:5000"
    assert tracking_uri("mlruns").startswith("file:///") and tracking_uri("mlruns").endswith("/mlruns")


def test_the_config_section_and_its_extra(monkeypatch):
    cfg = config_from_dict({"logging": {"mlflow": {"experiment": "digits"}}})
    assert cfg.logging.mlflow.tracking_uri == "mlruns" and cfg.logging.mlflow.log_model
    with pytest.raises(ConfigError, match="logging.mlflow.registered_model: registers the logged model"):
        config_from_dict({"logging": {"mlflow": {"registered_model": "m", "log_model": False}}})
    with pytest.raises(ConfigError, match=r"logging.mlflow.experimnt: unknown key \(did you mean 'experim"):
        config_from_dict({"logging": {"mlflow": {"experimnt": "x"}}})
    monkeypatch.setitem(__import__("sys").modules, "mlflow", None)
    with pytest.raises(ConfigError, match=r"^logging.mlflow: the mlflow package is not installed; "
                                          r"pip install 'ddp-cli\[mlflow\]' or remove \[logging.mlflow\]$"):
        check_sinks(LoggingConfig(mlflow=MlflowConfig()))
