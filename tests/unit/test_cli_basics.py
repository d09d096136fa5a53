"""The CLI in-process: version and help, JSON listings, report errors, the metrics logger."""

from __future__ import annotations

import json
import logging

from typer.testing import CliRunner

from ddp_cli.cli import app
from ddp_cli.config import LoggingConfig
from ddp_cli.observe.sinks import build_sinks


def test_report_on_a_folder_that_is_not_a_run(tmp_path):
    result = CliRunner().invoke(app, ["report", str(tmp_path)])
    assert result.exit_code == 2 and "no metrics.jsonl" in result.stderr


def test_a_users_logging_handler_receives_every_record(tmp_path):
    seen = []

    class Collect(logging.Handler):
        def emit(self, record):
            seen.append(record.metrics)

    handler = Collect(level=logging.DEBUG)
    logger = logging.getLogger("ddp.metrics")
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        sinks = build_sinks(LoggingConfig(), tmp_path, {})
        sinks.write({"split": "train", "epoch": 1, "step": 3, "loss": 0.5, "lr": 0.1})
        sinks.close()
    finally:
        logger.removeHandler(handler)
    assert seen and seen[0]["step"] == 3 and "time" in seen[0]


def test_datasets_list_json(demo_registry):
    result = CliRunner().invoke(app, ["datasets", "list", "--registry", str(demo_registry), "--json"])
    assert result.exit_code == 0
    assert result.stdout.count("\n") == 1
    rows = json.loads(result.stdout)
    assert rows[0].keys() >= {"name", "driver", "path", "layout", "description"}


def test_version_and_help():
    runner = CliRunner()
    assert runner.invoke(app, ["--version"]).stdout.startswith("ddp ")
    for command in (["train"], ["validate"], ["datasets", "list"], ["report"]):
        result = runner.invoke(app, [*command, "--help"])
        assert result.exit_code == 0 and "Examples" in result.stdout, command
