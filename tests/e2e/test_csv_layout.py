"""`layout = "csv"` through the commands: the demo's digits listed in a table (one Parquet listing per
split, integer labels, a classes file) are shown, checked, trained on, and validated exactly as the demo
they are. In-process but for `train` and `validate`, which start workers."""

from __future__ import annotations

from pathlib import Path

import fsspec
import pandas as pd
import pytest
import torch
from conftest import REPO, ddp_in_process, last_json, run_ddp
from synthetic import write_registry

from ddp_cli.data.sources import demo
from ddp_cli.data.sources.layouts import build_index

pytestmark = pytest.mark.slow
DEMO = str(REPO / "configs/demo.toml")
SMALL = ["data.image_size=8", "data.val_resize=8", "data.workers=0", "train.precision=fp32"]


@pytest.fixture(scope="module")
def tabled(demo_root, tmp_path_factory) -> Path:
    """A registry whose `tabled` is the demo listed in `train.parquet` and `val.parquet` (`file`, `digit`:
    an index into `synsets.txt`, written in reverse so the file, not the names, must order the classes);
    the images are the demo's, through a link."""
    root = tmp_path_factory.mktemp("tabled") / "tabled"
    root.mkdir()
    (root / "images").symlink_to(demo_root / "ILSVRC/Data/CLS-LOC")
    (root / "synsets.txt").write_text("".join(f"{s}\n" for s in reversed(demo.SYNSETS)))
    index = build_index(fsspec.filesystem("file"), str(demo_root), "imagenet-loc")
    for split, rows in index.splits.items():
        pd.DataFrame({
            "file": [path.replace("ILSVRC/Data/CLS-LOC/", "images/") for path in rows.paths],
            "digit": [len(demo.SYNSETS) - 1 - label for label in rows.labels.tolist()],
        }).to_parquet(root / f"{split}.parquet", index=False)
    return write_registry(root.parent, [{
        "name": "tabled", "layout": "csv", "storage": {"driver": "FileSystem", "path": str(root)},
        "csv": {"listing": "{split}.parquet", "path_column": "file", "label_column": "digit",
                "classes": "synsets.txt"}}])


def test_show_and_check_read_the_table(tabled):
    shown = last_json(ddp_in_process("datasets", "show", "tabled", "--registry", str(tabled), "--json"))
    assert shown["layout"] == "csv" and shown["csv"]["listing"] == "{split}.parquet"
    assert shown["splits"] == {"train": {"images": 1438, "classes": 10},
                               "val": {"images": 359, "classes": 10}}
    assert [c["synset"] for c in shown["classes"]] == list(reversed(demo.SYNSETS))
    checked = last_json(ddp_in_process("datasets", "check", "tabled", "--split", "val", "--registry",
                                       str(tabled), "--json"))
    assert checked["bad_files"] == [] and checked["splits"]["val"]["images"] == 359


def test_train_then_validate_the_demo_from_its_table_as_from_the_demo(tabled, trained_demo, tmp_path):
    """Training reads the table in the launcher's index build and in every worker; validate --dataset
    scores the demo's checkpoint on the table's val split exactly as the demo's own."""
    sets = ['data.dataset="tabled"', "train.epochs=1", "train.max_steps_per_epoch=3", *SMALL]
    run = last_json(run_ddp("train", DEMO, "--registry", str(tabled), "--run-dir", str(tmp_path / "run"),
                            "--nproc-per-node", "1", "--json", "--quiet",
                            *[a for s in sets for a in ("--set", s)]))
    assert run["world_size"] == 1 and run["final"]["images"] == 359 and run["skipped_images"] == 0
    checkpoint = trained_demo / "checkpoints/last.pt"
    scored = last_json(run_ddp("validate", "--checkpoint", str(checkpoint), "--dataset", "tabled",
                               "--registry", str(tabled), "--json"))
    demo_final = torch.load(checkpoint, weights_only=True)["final"]  # as validate scores the demo's own val
    assert scored["dataset"] == "tabled" and scored["images"] == 359
    assert (scored["top1"], scored["top5"]) == (demo_final["top1"], demo_final["top5"])
