"""`ddp bench step|scaling|allreduce`: each runs end to end with tiny settings and gives its keys."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from ddp_cli.cli import app

TINY = ["--model", "resnet_tiny", "--batch-size", "4", "--image-size", "16", "--steps", "1", "--rounds", "1"]


def bench_json(*args: str) -> dict:
    result = CliRunner().invoke(app, ["bench", *args, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_bench_step_rows_ratios_and_breakdown():
    out = bench_json("step", *TINY)
    assert out["bench"] == "step" and out["world_size"] == 2 and out["threads_per_worker"] == 1
    fast = out["fast_precision"]
    assert fast in ("bf16", "fp32")
    rate = {(r["loop"], r["precision"], r["channels_last"]): r["images_per_second"] for r in out["rows"]}
    assert set(rate) == {("ddp", fast, True), ("ddp", "fp32", False), ("tutorial", "fp32", False),
                         ("tutorial", fast, True), ("ddp_ema", fast, True), ("bare", fast, True)}
    for row in out["rows"]:
        assert row["images"] == 1 * 1 * 4 * 2  # rounds x steps x batch x world
        assert abs(row["images_per_second"] - row["images"] / row["seconds"]) < 1e-6
    baseline = rate[("tutorial", "fp32", False)]
    assert abs(out["ratio_equal_fp32"] - rate[("ddp", "fp32", False)] / baseline) < 1e-9
    assert abs(out["ratio_defaults_vs_baseline"] - rate[("ddp", fast, True)] / baseline) < 1e-9
    assert abs(out["ratio_equal_fast"] - rate[("ddp", fast, True)] / rate[("tutorial", fast, True)]) < 1e-9
    ema, defaults = rate[("ddp_ema", fast, True)], rate[("ddp", fast, True)]
    assert abs(out["ratio_ema_vs_defaults"] - ema / defaults) < 1e-9
    paired = out["paired_step_ms"]  # median step of each loop, stepped in turn
    assert set(paired) == {"ddp", "ddp_ema", "bare"} and all(ms > 0 for ms in paired.values())
    assert abs(out["ratio_vs_bare"] - paired["bare"] / paired["ddp"]) < 1e-9
    assert abs(out["ratio_ema_vs_bare"] - paired["bare"] / paired["ddp_ema"]) < 1e-9
    assert "host_syncs_per_step" not in out  # CPU
    assert out["device"] == "cpu" and all("peak_memory_mib" not in row for row in out["rows"])
    assert out["ema_ms"] > 0
    # MFU: each row's images/s x the model's FLOPs per image over the measured peak x the world size
    flops = out["flops_per_image"]["16"]
    assert out["peak_source"].startswith(f"measured: 1024x1024 {fast} matmul") and out["peak_flops"] > 0
    defaults = ("ddp", fast, True)
    ddp = next(r for r in out["rows"] if (r["loop"], r["precision"], r["channels_last"]) == defaults)
    assert abs(out["mfu"] - ddp["mfu"]) < 1e-12
    assert abs(ddp["mfu"] - ddp["images_per_second"] * flops / (out["peak_flops"] * 2)) < 1e-9 * ddp["mfu"]
    assert all(0 < r["mfu"] < 1 for r in out["rows"])
    assert abs(out["ema_share_of_step"] - out["ema_ms"] / out["breakdown"]["step_ms"]) < 1e-9
    parts = out["breakdown"]
    assert set(parts) == {"data_ms", "forward_ms", "backward_ms", "exposed_allreduce_ms", "optimizer_ms",
                          "step_ms"}
    assert all(v >= 0 for v in parts.values()) and parts["forward_ms"] > 0
    assert out["parameters"] > 0


def test_bench_options_rows_and_ratios_against_the_defaults():
    out = bench_json("options", *TINY, "--only", "defaults,static_graph=true,bucket_cap_mb=1")
    assert out["bench"] == "options"
    rows = {row["variant"]: row for row in out["rows"]}
    assert list(rows) == ["defaults", "static_graph=true", "bucket_cap_mb=1"]
    assert rows["static_graph=true"]["set"] == "distributed.static_graph=true"
    base = rows["defaults"]["images_per_second"]
    for row in rows.values():
        assert abs(row["vs_defaults"] - row["images_per_second"] / base) < 1e-9


def test_bench_options_refuses_an_unknown_variant():
    result = CliRunner().invoke(app, ["bench", "options", "--only", "defaults,turbo"])
    assert result.exit_code == 2 and "turbo" in result.output


def test_bench_scaling_efficiency():
    out = bench_json("scaling", *TINY)
    assert out["bench"] == "scaling"
    one, two = out["rows"]
    assert (one["world_size"], two["world_size"]) == (1, 2)
    assert two["images"] == 2 * one["images"]
    assert abs(out["efficiency"] - two["images_per_second"] / (2 * one["images_per_second"])) < 1e-9
    share = out["exposed_allreduce_share"]
    assert 0 <= share <= 1
    assert abs(share - out["breakdown"]["exposed_allreduce_ms"] / out["breakdown"]["step_ms"]) < 1e-9


def test_bench_allreduce_sizes():
    out = bench_json("allreduce", "--sizes", "0.25,1", "--budget", "2")
    assert out["bench"] == "allreduce" and out["backend"] == "gloo" and out["world_size"] == 2
    assert [row["size_mb"] for row in out["rows"]] == [0.25, 1.0]
    for row in out["rows"]:
        assert row["allreduce_gb_s"] > 0 and row["copy_gb_s"] > 0
        assert abs(row["ratio"] - row["allreduce_gb_s"] / row["copy_gb_s"]) < 1e-6
    assert out["ratio_largest"] == out["rows"][-1]["ratio"]


def test_bench_usage_errors_are_one_line():
    result = CliRunner().invoke(app, ["bench", "step", "--model", "resnet_tinyy"])
    assert result.exit_code == 2 and "did you mean" in result.stderr.lower()
    result = CliRunner().invoke(app, ["bench", "allreduce", "--sizes", "1,x"])
    assert result.exit_code == 2 and "--sizes 1,x" in result.stderr


def test_e2e_outcome_is_the_first_epoch_at_the_target_or_the_whole_run():
    from ddp_cli.bench.e2e import outcome

    curve = [{"epoch": 1, "top1": 0.5, "time": 110.0}, {"epoch": 2, "top1": 0.96, "time": 120.0},
             {"epoch": 3, "top1": 0.97, "time": 130.0}]
    hit = outcome("ddp", 100.0, curve, 0.95)
    assert (hit["to_target_s"], hit["reached"], hit["at_epoch"], hit["total_s"]) == (20.0, True, 2, 30.0)
    assert hit["curve"] == [[1, 10.0, 0.5], [2, 20.0, 0.96], [3, 30.0, 0.97]]
    miss = outcome("ddp", 100.0, curve, 0.99)
    assert (miss["to_target_s"], miss["reached"], miss["at_epoch"]) == (30.0, False, None)


def test_e2e_baseline_script_trains_under_torchrun_and_reports_each_epoch(tmp_path):
    """The hand-written baseline, on a tiny Kaggle-layout set, with torchvision's reference recipe (its
    constant LR; the demo's own recipe, the other baseline, differs only in the arguments
    tests/unit/test_bench_e2e.py checks)."""
    from conftest import REPO
    from synthetic import make_imagenet_loc

    from ddp_cli.bench.e2e import run_baseline
    from ddp_cli.config import load_config

    make_imagenet_loc(tmp_path, classes=3, train_per_class=8, val=7, size=32)
    cfg = load_config(REPO / "configs/demo.toml", ["train.epochs=2", "data.batch_size=4", "data.workers=0"])
    out = run_baseline(str(tmp_path), cfg, 2, target=0.0, baseline="reference", loaders=0)
    assert out["pipeline"] == "baseline" and out["precision"] == "fp32"
    assert out["reached"] and out["at_epoch"] == 1
    assert 0 < out["to_target_s"] <= out["total_s"] and 0 <= out["final_top1"] <= 1
