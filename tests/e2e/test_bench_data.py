"""`ddp bench data`: both pipelines measured on the same files, the shared bench shape."""

from __future__ import annotations

import json

from synthetic import make_imagenet_loc, write_registry
from typer.testing import CliRunner

from ddp_cli.cli import app


def test_bench_data_json_and_table(tmp_path):
    make_imagenet_loc(tmp_path / "d", classes=2, train_per_class=8, val=2, size=64)
    registry = write_registry(tmp_path, [{"name": "d", "layout": "imagenet-loc",
                                          "storage": {"driver": "FileSystem", "path": "d"}}])
    args = ["bench", "data", "d", "--registry", str(registry), "--workers", "0", "--seconds", "1",
            "--batch-size", "4", "--image-size", "32"]
    result = CliRunner().invoke(app, [*args, "--policy", "none,trivialaugment", "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["bench"] == "data" and out["files"] == 16 and out["workers"] == 0
    rows = {(row["policy"], row["pipeline"]): row for row in out["rows"]}
    assert set(rows) == {(p, kind) for p in ("none", "trivialaugment") for kind in ("ddp", "baseline")}
    rate = {key: row["images_per_second"] for key, row in rows.items()}
    for (policy, pipeline), row in rows.items():
        assert row["images"] > 0 and row["images"] % 4 == 0 and row["seconds"] > 0
        assert abs(rate[policy, pipeline] - row["images"] / row["seconds"]) < 1e-6
        assert abs(row["vs_none"] - rate[policy, pipeline] / rate["none", pipeline]) < 1e-9
        assert abs(out["ratios"][policy] - rate[policy, "ddp"] / rate[policy, "baseline"]) < 1e-9
    assert out["ratio"] == out["ratios"]["none"]
    human = CliRunner().invoke(app, args, env={"COLUMNS": "150"})
    assert human.exit_code == 0 and "baseline" in human.stdout and "ratio" in human.stdout
    unknown = CliRunner().invoke(app, [*args, "--policy", "none,autoaugmnet"])
    assert unknown.exit_code == 2 and "--policy autoaugmnet" in unknown.stderr


def test_bench_data_full_decode_adds_a_row_per_policy_and_its_ratio(tmp_path):
    make_imagenet_loc(tmp_path / "d", classes=2, train_per_class=4, val=2, size=64)
    registry = write_registry(tmp_path, [{"name": "d", "layout": "imagenet-loc",
                                          "storage": {"driver": "FileSystem", "path": "d"}}])
    result = CliRunner().invoke(app, ["bench", "data", "d", "--registry", str(registry), "--workers", "0",
                                      "--seconds", "1", "--batch-size", "4", "--image-size", "16",
                                      "--full-decode", "--rounds", "1", "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout.strip().splitlines()[-1])
    rate = {row["pipeline"]: row["images_per_second"] for row in out["rows"]}
    assert set(rate) == {"ddp", "ddp_full_decode", "baseline"}
    assert out["ratios_reduced_vs_full"]["none"] == rate["ddp"] / rate["ddp_full_decode"]


def test_bench_data_needs_a_batch_of_files(tmp_path):
    make_imagenet_loc(tmp_path / "d", classes=2, train_per_class=2, val=2)
    registry = write_registry(tmp_path, [{"name": "d", "layout": "imagenet-loc",
                                          "storage": {"driver": "FileSystem", "path": "d"}}])
    result = CliRunner().invoke(app, ["bench", "data", "d", "--registry", str(registry), "--batch-size", "8"])
    assert result.exit_code == 2 and "fewer than --batch-size 8" in result.stderr
