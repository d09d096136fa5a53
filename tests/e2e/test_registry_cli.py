"""The registry and its data through the CLI: the Julia seeds' own Data.toml, and bad data or
registries stopping with one line and the documented exit code. In this process (no worker starts), but
for the one training run that must stop before any worker does."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import REPO, ddp_in_process, last_json, run_ddp
from synthetic import append_line, make_imagefolder, make_imagenet_loc, write_julia_registry, write_registry

DEMO = str(REPO / "configs/demo.toml")
TINY = ["--set", "data.batch_size=2", "--set", "train.epochs=1"]


def one_error_line(result) -> str:
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), result.stderr[-3000:]
    return lines[0]


@pytest.fixture(scope="module")
def seeds(tmp_path_factory) -> Path:
    """A Data.toml in FluxDistributed.jl's style: `loc` (Kaggle layout) and `folder` (imagefolder)."""
    base = tmp_path_factory.mktemp("seeds")
    make_imagenet_loc(base / "loc", classes=3, train_per_class=8, val=7)
    make_imagefolder(base / "folder", classes=2, per_class=4)
    return write_julia_registry(base, {"loc": base / "loc", "folder": base / "folder"})


def test_seed_registry_lists_without_opening_the_roots(seeds):
    listed = last_json(ddp_in_process("datasets", "list", "--registry", str(seeds), "--json"))
    assert [(d["name"], d["driver"], d["layout"]) for d in listed] == [
        ("loc", "FileSystem", "auto"), ("folder", "FileSystem", "auto")]
    assert listed[0]["path"] == str(seeds.parent / "loc")


@pytest.mark.parametrize(("name", "layout", "splits"), [
    ("loc", "imagenet-loc", {"train": {"images": 24, "classes": 3}, "val": {"images": 7, "classes": 3}}),
    ("folder", "imagefolder", {"train": {"images": 8, "classes": 2}, "val": {"images": 4, "classes": 2}}),
])
def test_seed_registry_shows_each_data_set_with_its_inferred_layout(seeds, name, layout, splits):
    shown = last_json(ddp_in_process("datasets", "show", name, "--registry", str(seeds), "--json"))
    assert (shown["layout"], shown["splits"]) == (layout, splits)
    assert "type" not in shown["storage"]


def test_seed_registry_resolves_for_training(seeds):
    plan = last_json(ddp_in_process("train", DEMO, "--dry-run", "--json", "--registry", str(seeds),
                                    "--set", 'data.dataset="loc"', *TINY))
    assert plan["splits"] == {"train": 24, "val": 7} and plan["classes"] == 3


@pytest.fixture
def loc(tmp_path) -> Path:
    make_imagenet_loc(tmp_path / "loc", classes=3, train_per_class=4, val=4)
    return tmp_path / "loc"


@pytest.mark.parametrize("missing", ["PredictionString", "ImageId"])
def test_val_solution_without_its_column_is_exit_3_naming_file_and_column(loc, missing):
    csv = loc / "LOC_val_solution.csv"
    csv.write_text(csv.read_text().replace(missing, "Other", 1))
    registry = write_julia_registry(loc.parent, {"loc": loc})
    result = ddp_in_process("datasets", "show", "loc", "--registry", str(registry))
    assert result.returncode == 3
    assert f"error: {csv}: no {missing} column (found " in one_error_line(result)


def test_unsafe_listing_row_stops_training_before_any_worker_with_exit_3(loc, tmp_path):
    append_line(loc / "LOC_val_solution.csv", "../../../../secret,n00001000 1 1 5 5")
    registry = write_julia_registry(loc.parent, {"loc": loc})
    expected = f"error: {loc}/LOC_val_solution.csv: ImageId '../../../../secret': unsafe path"
    dry = ddp_in_process("train", DEMO, "--dry-run", "--registry", str(registry),
                         "--set", 'data.dataset="loc"', *TINY)
    assert dry.returncode == 3 and one_error_line(dry).startswith(expected)
    run_dir = tmp_path / "run"
    real = run_ddp("train", DEMO, "--registry", str(registry), "--run-dir", str(run_dir),
                   "--set", 'data.dataset="loc"', *TINY)
    assert real.returncode == 3 and one_error_line(real).startswith(expected)
    assert not run_dir.exists()  # stopped before the run directory, so before any worker


def test_unsafe_listing_row_is_a_bad_file_for_datasets_check(loc):
    row = "n00001000/../../../../../../etc/hosts 99"
    append_line(loc / "ILSVRC/ImageSets/CLS-LOC/train_cls.txt", row)
    registry = write_julia_registry(loc.parent, {"loc": loc})
    result = ddp_in_process("datasets", "check", "loc", "--registry", str(registry), "--json")
    assert result.returncode == 3
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["bad_files"] == [{"path": f"ILSVRC/Data/CLS-LOC/train/{row.split()[0]}.JPEG",
                                 "reason": "unsafe path (absolute, or .. out of its folder)"}]


def test_unknown_storage_driver_is_exit_2_naming_registry_entry_and_value(tmp_path):
    registry = write_registry(tmp_path, [{"name": "cloud", "layout": "imagefolder",
                                          "storage": {"driver": "GCS", "path": "gs://bucket/x"}}])
    result = ddp_in_process("datasets", "list", "--registry", str(registry))
    assert result.returncode == 2
    assert one_error_line(result) == (f"error: {registry}: datasets[0] ('cloud'): storage.driver: "
                                      "unknown driver 'GCS'; known: FileSystem, S3")
