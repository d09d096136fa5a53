"""`ddp datasets show` and `ddp datasets check`: every planted fault found, oddities passed."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from synthetic import make_imagenet_loc, plant, write_registry
from typer.testing import CliRunner

from ddp_cli.cli import app
from ddp_cli.data.pipeline.check import check_dataset
from ddp_cli.data.registry import load_registry

runner = CliRunner()
TRAIN = "ILSVRC/Data/CLS-LOC/train"
VAL = "ILSVRC/Data/CLS-LOC/val"

# path under the root -> (what is planted there, the reason check must give; None = must pass)
PLANTED = {
    f"{TRAIN}/n00001000/n00001000_0.JPEG": ("cmyk", None),
    f"{TRAIN}/n00001000/n00001000_1.JPEG": ("gray", None),
    f"{TRAIN}/n00001001/n00001001_0.JPEG": ("png", None),
    f"{TRAIN}/n00001001/n00001001_1.JPEG": ("truncated", "truncated"),
    f"{TRAIN}/n00001002/n00001002_0.JPEG": ("missing", "missing file"),
    f"{TRAIN}/n00001002/n00001002_1.JPEG": ("garbage", "not an image"),
    f"{VAL}/ILSVRC2012_val_00000002.JPEG": ("corrupt", "corrupt"),
    f"{VAL}/ILSVRC2012_val_00000003.JPEG": ("truncated", "truncated"),
}
UNREADABLE = f"{TRAIN}/n00001002/n00001002_2.JPEG"  # a folder where a file should be
UNKNOWN = f"{VAL}/ILSVRC2012_val_00000099.JPEG"  # a CSV row whose synset is not in the mapping


def expected(split: str) -> dict[str, str]:
    prefix = TRAIN if split == "train" else VAL
    out = {p: r for p, (_, r) in PLANTED.items() if r and p.startswith(prefix)}
    if split == "train":
        return out | {UNREADABLE: "unreadable (Is a directory)"}
    return out | {UNKNOWN: "unknown synset"}


@pytest.fixture(scope="module")
def faulty(tmp_path_factory) -> Path:
    """A registry with `faulty` (every fault planted) and `clean` (the same before planting)."""
    base = tmp_path_factory.mktemp("check")
    make_imagenet_loc(base / "clean", classes=3, train_per_class=4, val=6)
    shutil.copytree(base / "clean", base / "faulty")
    for path, (kind, _) in PLANTED.items():
        plant(base / "faulty", path, kind)
    (base / "faulty" / UNREADABLE).unlink()
    (base / "faulty" / UNREADABLE).mkdir()
    with (base / "faulty" / "LOC_val_solution.csv").open("a") as f:
        f.write("ILSVRC2012_val_00000099,n77777777 1 1 5 5\n")
    return write_registry(base, [
        {"name": name, "layout": "imagenet-loc", "uuid": uuid,
         "storage": {"driver": "FileSystem", "path": name}}
        for name, uuid in (("faulty", "7c9e6679-7425-40de-944b-e07fc1f90ae7"),
                           ("clean", "1b4e28ba-2fa1-11d2-883f-0016d3cca427"))])


def invoke(*args: str):
    return runner.invoke(app, list(args), env={"COLUMNS": "200"})  # rich folds long paths to fit


def bad_files(result) -> dict[str, str]:
    return {b["path"]: b["reason"].split(" (")[0] if b["reason"].startswith("corrupt") else b["reason"]
            for b in result["bad_files"]}


def test_check_json_finds_every_planted_fault_and_passes_the_oddities(faulty):
    result = invoke("datasets", "check", "faulty", "--registry", str(faulty), "--json")
    assert result.exit_code == 3, result.output
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["name"] == "faulty"
    assert out["splits"] == {"train": {"images": 12, "classes": 3}, "val": {"images": 6, "classes": 3}}
    assert bad_files(out) == expected("train") | expected("val")
    assert [b["path"] for b in out["bad_files"]] == sorted(b["path"] for b in out["bad_files"])
    assert "7 bad file(s) in data set 'faulty'" in result.stderr
    assert out["exit_code"] == 3 and out["error"].startswith("7 bad file(s)")  # the list and the error
    assert "checking" not in result.stderr  # no progress bar: not a TTY, and --json


def opened(registry, name: str) -> tuple:
    """(fs, root, layout) of a registry entry: what check_dataset takes."""
    entry = load_registry(registry).get(name)
    return (*entry.open(), entry.layout)


@pytest.mark.parametrize("split", ["train", "val"])
def test_check_one_split(faulty, split):
    out = check_dataset(*opened(faulty, "faulty"), (split,), workers=2)
    assert set(out["splits"]) == {split}
    assert bad_files(out) == expected(split)


def test_check_is_the_same_with_one_thread_or_many(faulty):
    entry = opened(faulty, "faulty")
    one, many = check_dataset(*entry, workers=1), check_dataset(*entry, workers=16)
    assert one["bad_files"] == many["bad_files"] and one["splits"] == many["splits"]


def test_check_reports_progress_up_to_the_total(faulty):
    calls: list[tuple[int, int]] = []
    check_dataset(*opened(faulty, "clean"), workers=3, progress=lambda d, t: calls.append((d, t)))
    assert calls[-1] == (18, 18)
    assert [d for d, _ in calls] == list(range(1, 19))


def test_check_human_output_lists_every_bad_file(faulty):
    result = invoke("datasets", "check", "faulty", "--registry", str(faulty), "--split", "train")
    assert result.exit_code == 3
    for path in expected("train"):
        assert path in result.stdout
    assert "error:" in result.stderr and "Traceback" not in result.output


def test_check_clean_data_set_exits_zero(faulty):
    result = invoke("datasets", "check", "clean", "--registry", str(faulty), "--json")
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["bad_files"] == [] and out["splits"]["train"] == {"images": 12, "classes": 3}


def test_check_bad_split_and_unknown_data_set_are_usage_errors(faulty):
    assert invoke("datasets", "check", "clean", "--registry", str(faulty), "--split", "test").exit_code == 2
    result = invoke("datasets", "check", "claen", "--registry", str(faulty))
    assert result.exit_code == 2 and "did you mean 'clean'" in result.stderr


def test_show_json_and_human(faulty):
    result = invoke("datasets", "show", "clean", "--registry", str(faulty), "--json")
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["name"] == "clean" and out["uuid"] == "1b4e28ba-2fa1-11d2-883f-0016d3cca427"
    assert out["layout"] == "imagenet-loc" and out["storage"]["driver"] == "FileSystem"
    assert out["splits"] == {"train": {"images": 12, "classes": 3}, "val": {"images": 6, "classes": 3}}
    assert out["classes"][2] == {"index": 2, "synset": "n00001002", "description": "class 2, thing 2"}
    human = invoke("datasets", "show", "clean", "--registry", str(faulty))
    assert human.exit_code == 0
    assert "storage.path" in human.stdout and "n00001002" in human.stdout


def test_show_missing_root_is_a_data_error(tmp_path):
    registry = write_registry(tmp_path, [{"name": "gone", "layout": "imagefolder",
                                          "storage": {"driver": "FileSystem", "path": "nowhere"}}])
    result = invoke("datasets", "show", "gone", "--registry", str(registry))
    assert result.exit_code == 3 and "nowhere" in result.stderr
