"""[logging.mlflow]: one MLflow run per ddp run, fed from rank 0 by a thread of its own.

The run's params are the resolved config, flattened (`optim.lr_per_256`); its metrics every record's
numbers as `<split>/<name>` at the record's step (a logging window's, an epoch's validation); its
artefacts, at the end, what `attach` hands over (the exported model, the report picture), and the
model can be registered. Under `ddp sweep` the run is nested under the sweep's (PARENT_ENV).

Training never waits for the tracking server: `write` queues, the thread sends. A server that fails
is warned of once; what it refused is kept and sent again (every RETRY_S) until the run ends, and
what is still unsent then (after CLOSE_S at most, one more try if it never answered) is said in one
line, not raised.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from pathlib import Path
from typing import Any

from ddp_cli.config import MlflowConfig

log = logging.getLogger("ddp")
PARENT_ENV = "DDP_MLFLOW_PARENT_RUN"  # the sweep's MLflow run id, for its trials to nest under
RETRY_S = 5.0  # between tries while the server refuses
CLOSE_S = 20.0  # what is still unsent this long after the run ended is given up
BATCH = 100  # params per request (MLflow's limit); metrics are sent a record at a time
SCALARS = ("loss", "top1", "top5", "lr", "images_per_second", "sup_loss", "unsup_loss", "mask_rate",
           "pseudo_label_top1", "pair_top1", "epoch")
# what the MLflow client retries on its own before a call fails: short, the sink retries itself
CLIENT_ENV = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
              "MLFLOW_HTTP_REQUEST_TIMEOUT": "10"}


def tracking_uri(setting: str) -> str:
    """A server's URL as given; a folder (the default `mlruns`) as the file URI of a local store."""
    if "://" in setting or setting.startswith(("databricks", "file:")):
        return setting
    return Path(setting).resolve().as_uri()


def flatten(config: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """`{"optim": {"lr": 0.1}}` -> `{"optim.lr": "0.1"}`: MLflow params are flat strings."""
    out: dict[str, str] = {}
    for key, value in config.items():
        if isinstance(value, dict):
            out |= flatten(value, f"{prefix}{key}.")
        else:
            out[f"{prefix}{key}"] = str(value)
    return out


class MlflowSink:
    def __init__(self, settings: MlflowConfig, run_dir: Path, config: dict[str, Any]) -> None:
        for name, value in CLIENT_ENV.items():
            os.environ.setdefault(name, value)
        for noisy in ("urllib3.connectionpool", "mlflow"):  # retries and refusals: said once, by the sink
            logging.getLogger(noisy).setLevel(logging.ERROR)
        self.settings, self.uri = settings, tracking_uri(settings.tracking_uri)
        self.name = settings.run_name or run_dir.name
        self.parent = os.environ.get(PARENT_ENV)
        self.params = flatten(config)
        self.client: Any = None
        self.run_id: str | None = None
        self.inbox: queue.Queue = queue.Queue()
        self.backlog: list[tuple[str, Any]] = []
        self.warned = False
        self.next_try = 0.0  # no try before this (monotonic time), after a failure
        self.ready = threading.Event()  # set once the run is made
        self.thread = threading.Thread(target=self.send_loop, name="ddp-mlflow", daemon=True)
        self.thread.start()

    def write(self, record: dict[str, Any]) -> None:
        self.inbox.put(("metrics", record))

    def attach(self, path: Path, folder: str | None = None) -> None:
        """A file (or folder) to upload as an artefact, under `folder` of the run's artefacts."""
        self.inbox.put(("artifact", (path, folder)))

    def register(self) -> None:
        """Register the `model` artefact attached before in the model registry, if the config asks."""
        if self.settings.registered_model:
            self.inbox.put(("register", self.settings.registered_model))

    def wait_for_run(self, timeout: float = 15.0) -> str | None:
        """The run's id once made (a sweep hands it to its trials to nest under); None if the server
        has not answered within `timeout`."""
        self.ready.wait(timeout)
        return self.run_id

    def close(self) -> None:
        self.inbox.put(("close", None))
        self.thread.join(CLOSE_S + 30)
        if self.backlog:
            message = (f"logging.mlflow: {len(self.backlog)} update(s) of run {self.name!r} not sent to "
                       f"{self.uri}; they are in the run dir (metrics.jsonl)")
            (log.info if self.warned else log.warning)(("" if self.warned else "warning: ") + message)

    def send_loop(self) -> None:
        """Send what arrives, in order; after a failure try again every RETRY_S, until the run has
        ended and either all is sent or CLOSE_S has passed."""
        self.flush()  # the run and its params, before the first record
        closing_at = None
        while True:
            closing_at = self.take(closing_at)
            self.flush()
            waited = time.monotonic() - closing_at if closing_at is not None else None
            if waited is not None and (not self.backlog or waited > self.patience()):
                self.finish()
                return

    def patience(self) -> float:
        """How long the run's end waits for the server: CLOSE_S, or one more try for one that has not
        answered once (down since the run began)."""
        return CLOSE_S if self.run_id else RETRY_S / 2

    def take(self, closing_at: float | None) -> float | None:
        """Wait for the next update (RETRY_S at most while some wait to be sent again), then take every
        update queued; the time the run ended, once `close` said so."""
        wait = RETRY_S if self.backlog or closing_at is not None or not self.run_id else None
        try:
            items = [self.inbox.get(timeout=wait)]
        except queue.Empty:
            return closing_at
        while not self.inbox.empty():
            items.append(self.inbox.get_nowait())
        for kind, item in items:
            if kind == "close":
                closing_at = time.monotonic()
            else:
                self.backlog.append((kind, item))
        return closing_at

    def flush(self) -> None:
        """Send the backlog in order, unless the last failure was less than RETRY_S ago."""
        if time.monotonic() < self.next_try:
            return
        try:
            self.start()
            while self.backlog:
                self.send(*self.backlog[0])
                self.backlog.pop(0)
        except Exception as e:
            self.failed(e)

    def failed(self, error: Exception) -> None:
        self.next_try = time.monotonic() + RETRY_S
        if not self.warned:
            self.warned = True
            text = str(error).splitlines()[0] if str(error) else ""
            log.warning(f"warning: logging.mlflow: {self.uri} refused an update ({type(error).__name__}: "
                        f"{text[:200]}); training goes on, and the updates are sent again until the run ends")

    def start(self) -> None:
        """The run, made on first contact: in its experiment (created if missing), nested under the
        sweep's run if there is one, with the flattened config as its params."""
        if self.run_id:
            return
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        self.client = self.client or MlflowClient(self.uri)
        experiment = self.client.get_experiment_by_name(self.settings.experiment)
        experiment_id = experiment.experiment_id if experiment else \
            self.client.create_experiment(self.settings.experiment)
        tags = {"mlflow.parentRunId": self.parent} if self.parent else {}
        run = self.client.create_run(experiment_id, run_name=self.name, tags=tags)
        items = [Param(k, v[:6000]) for k, v in self.params.items()]
        for first in range(0, len(items), BATCH):
            self.client.log_batch(run.info.run_id, params=items[first:first + BATCH])
        self.run_id = run.info.run_id
        self.ready.set()

    def send(self, kind: str, item: Any) -> None:
        if kind == "metrics":
            self.send_metrics(item)
        elif kind == "artifact":
            path, folder = item
            if Path(path).is_dir():
                self.client.log_artifacts(self.run_id, str(path), folder)
            else:
                self.client.log_artifact(self.run_id, str(path), folder)
        elif kind == "register":
            self.send_registration(item)

    def send_metrics(self, record: dict[str, Any]) -> None:
        from mlflow.entities import Metric

        stamp = int(record.get("time", time.time()) * 1000)
        metrics = [Metric(f"{record['split']}/{name}", float(record[name]), stamp, int(record.get("step", 0)))
                   for name in SCALARS if isinstance(record.get(name), int | float)
                   and not isinstance(record.get(name), bool)]
        if metrics:
            self.client.log_batch(self.run_id, metrics=metrics)

    def send_registration(self, name: str) -> None:
        from mlflow.exceptions import MlflowException

        try:
            self.client.create_registered_model(name)
        except MlflowException as e:
            if "RESOURCE_ALREADY_EXISTS" not in str(e.error_code):
                raise
        source = f"{self.client.get_run(self.run_id).info.artifact_uri}/model"
        self.client.create_model_version(name, source, run_id=self.run_id)

    def finish(self) -> None:
        if self.run_id and not self.backlog:
            try:
                self.client.set_terminated(self.run_id, "FINISHED")
            except Exception as e:
                self.failed(e)
