"""One file per command family through the CLI (in-process): the exit code of the contract and one
line on stderr naming the file, for a mutant each reader above refuses."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import ddp_in_process
from fuzz_targets import JPEG, checkpoint_bytes, report_files
from synthetic import write_registry

UTF16 = "data_config_version = 1\n".encode("utf-16")


def one_line_naming(result, code: int, name: str) -> None:
    assert result.returncode == code, (result.returncode, result.stderr[-2000:])
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and name in lines[0] and "internal error" not in lines[0], result.stderr


def test_config_family(tmp_path: Path):
    (tmp_path / "run.toml").write_bytes(UTF16)
    one_line_naming(ddp_in_process("train", str(tmp_path / "run.toml"), "--dry-run"), 2, "run.toml")


def test_registry_family(tmp_path: Path):
    (tmp_path / "data.toml").write_bytes(UTF16)
    one_line_naming(ddp_in_process("datasets", "list", "--registry", str(tmp_path / "data.toml")), 2,
                    "data.toml")


@pytest.mark.parametrize("empty", ["train", "val"])
def test_datasets_check_fails_a_data_set_with_nothing_to_learn(tmp_path: Path, empty: str):
    for split in ("train", "val"):
        (tmp_path / "root" / split / "c0").mkdir(parents=True)
        if split != empty:
            (tmp_path / "root" / split / "c0" / "0.jpg").write_bytes(JPEG)
    registry = write_registry(tmp_path, [{"name": "tiny", "layout": "imagefolder",
                                          "storage": {"driver": "FileSystem", "path": "root"}}])
    result = ddp_in_process("datasets", "check", "tiny", "--registry", str(registry), "--json")
    assert result.returncode == 3, result.stderr
    assert f'"path": "{empty}/", "reason": "empty split' in result.stdout


def test_checkpoint_family(tmp_path: Path):
    pt = checkpoint_bytes()[0]
    (tmp_path / "cut.pt").write_bytes(pt[: len(pt) // 2])
    result = ddp_in_process("export", "--checkpoint", str(tmp_path / "cut.pt"), "--format", "state_dict",
                            "--out", str(tmp_path / "out.pt"))
    one_line_naming(result, 3, "cut.pt")


def test_report_family(tmp_path: Path):
    for name, data in report_files().items():
        (tmp_path / name).write_bytes(data)
    bad = {"split": "val", "epoch": 1, "step": 1, "loss": 1.0, "top1": "x", "top5": 1.0}
    (tmp_path / "metrics.jsonl").write_text(json.dumps(bad) + "\n")
    one_line_naming(ddp_in_process("report", str(tmp_path)), 3, "metrics.jsonl")


def test_webdataset_index_family(tmp_path: Path):
    (tmp_path / "w-000.tar").write_bytes(b"not a tar at all" * 64)
    one_line_naming(ddp_in_process("datasets", "index", str(tmp_path), "--split", "train=w-*.tar"), 3,
                    "w-000.tar")


def test_webdataset_index_of_a_root_read_as_it_is_says_so(tmp_path: Path):
    for split in ("train", "val"):
        (tmp_path / "tree" / split / "c0").mkdir(parents=True)
    one_line_naming(ddp_in_process("datasets", "index", str(tmp_path / "tree")), 3,
                    'no index needed): point a registry entry with layout = "imagefolder" at it')
    one_line_naming(ddp_in_process("datasets", "index", str(tmp_path / "tree" / "train")), 3,
                    "give --split train=GLOB")
