"""`ddp bench memory`: both forms of the index walked by real loader processes, the contract's keys."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from ddp_cli.cli import app


@pytest.mark.slow
def test_bench_memory_json_has_the_contract_keys_and_both_forms():
    result = CliRunner().invoke(app, ["bench", "memory", "--rows", "2000", "--workers", "2", "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert (out["bench"], out["rows"], out["workers"]) == ("memory", 2000, 2)
    assert out["rank_index_mb"] >= 0 and out["worker_start_mb"] > 0 and out["worker_end_mb"] > 0
    forms = {row["index"]: row for row in out["forms"]}
    assert forms["packed"]["paths_held_as"] == "PackedStrings"  # no Python list of str in the dataset
    assert forms["lists"]["paths_held_as"] == "list"  # the baseline measured in the same run
    assert forms["parquet"]["paths_held_as"] == "PackedStrings"  # Parquet's index: arrays too
    assert out["parquet_worker_end_vs_start"] == forms["parquet"]["end_vs_start"]
    for row in forms.values():
        assert row["images"] == 2000  # one full pass
        assert row["worker_start_mb"] > 0 and row["worker_end_mb"] > 0
    assert out["worker_end_mb"] == forms["packed"]["worker_end_mb"]
    baseline = forms["lists"]["worker_end_mb"]
    assert out["worker_end_vs_baseline"] == pytest.approx(out["worker_end_mb"] / baseline)
