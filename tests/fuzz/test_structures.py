"""Inputs whose bytes are fine but whose structure is not: `--set` values, output paths, ImageFolder
trees (empty splits, classes with no image), webdataset tar members (`..`, absolute names, links,
sizes that lie, cut-short archives) and checkpoints holding the wrong keys. The same rule as for
mutated files (`fuzzing.user_error_or_none`), and a data set with nothing to train or validate on
must fail `datasets check`."""

from __future__ import annotations

import io
import tarfile
import tempfile
from pathlib import Path

import fsspec
import numpy as np
import pytest
import torch
from fuzz_targets import JPEG, REPO, SYNSETS, read_shards, shards_files
from fuzzing import budget, user_error_or_none
from hypothesis import example, given
from hypothesis import strategies as st
from mutants import ABSURD

from ddp_cli.cli.commands.checkpoints import writable
from ddp_cli.cli.plan import image_sizes
from ddp_cli.config import RunConfig, load_config
from ddp_cli.data.pack.wds_index import index_shards
from ddp_cli.data.pipeline.check import check_dataset
from ddp_cli.train.checkpoint import save_checkpoint
from ddp_cli.train.checkpoint_model import load_trained

LOCAL = fsspec.filesystem("file")
ABSURD_TEXT = [v.decode("utf-8", "replace") for v in ABSURD]


def config_keys() -> list[str]:
    """Every key of the run config, as `--set` names it (`section.key`)."""
    keys = []
    for section, value in RunConfig().model_dump().items():
        keys += [f"{section}.{k}" for k in value] if isinstance(value, dict) else [section]
    return keys


@budget(150)
@given(key=st.sampled_from(config_keys()) | st.text(max_size=20),
       value=st.sampled_from(ABSURD_TEXT) | st.text(max_size=30) | st.floats().map(str)
       | st.integers().map(str))
@example(key="data.image_size", value="1e308").via("a float where a size goes")
@example(key="model.name", value="'\\u0000.py:Net'").via("a NUL byte in a model file's path")
@example(key="train.epochs", value="1000000000000").via("epochs the dry run's plan would walk for hours")
@example(key="data.ramp_epochs", value="[0, inf]").via("a ramp that never ends")
def test_set_value(key: str, value: str):
    """`--set KEY=VALUE` with any value: the config or the flag named in the error; a config it takes
    gives the dry run's plan of image sizes (which walks the epochs) in time."""
    def read() -> None:
        cfg = load_config(REPO / "configs/demo.toml", [f"{key}={value}"])
        image_sizes(cfg)
        cfg.data.sizes(cfg.train.epochs)

    error = user_error_or_none(read, "")
    if error is not None:
        assert "--set" in str(error) or "demo.toml" in str(error), str(error)


@budget(100)
@given(name=st.text(st.characters(codec="utf-8") | st.sampled_from("/.\0~"), max_size=300))
@example(name="a\0b").via("a NUL byte")
@example(name="x" * 300).via("a file name longer than the filesystem allows")
@example(name="file.txt/out.csv").via("a file where a folder must be")
def test_output_path(name: str):
    """`--predictions` and `--confusion`: a path that cannot be written is refused up front."""
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "file.txt").write_text("a file")
        given_path = f"{tmp}/{name.replace('..', '__').replace('~', '_')}"
        user_error_or_none(lambda: writable(given_path, "--predictions"), "--predictions")


# ---- ImageFolder trees, checked as `ddp datasets check` does ----

tree = st.fixed_dictionaries({
    "classes": st.lists(st.tuples(st.integers(0, 2), st.integers(0, 2)), max_size=3),  # (train, val) images
    "no_val": st.booleans(),
    "not_an_image": st.booleans(),
})


@budget(40)
@given(spec=tree)
@example(spec={"classes": [], "no_val": False, "not_an_image": False}).via("no class at all")
@example(spec={"classes": [(1, 0)], "no_val": False, "not_an_image": False}).via("an empty val split")
@example(spec={"classes": [(1, 1), (0, 1)], "no_val": False, "not_an_image": False}).via("a class, no image")
def test_imagefolder_tree(spec: dict):
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        splits = ("train",) if spec["no_val"] else ("train", "val")
        for c, counts in enumerate(spec["classes"]):
            for split, count in zip(splits, counts, strict=False):
                (root / split / f"c{c}").mkdir(parents=True)
                for i in range(count):
                    (root / split / f"c{c}" / f"{i}.jpg").write_bytes(JPEG)
        for split in splits:
            (root / split).mkdir(exist_ok=True)
        if spec["not_an_image"]:
            (root / "train" / "c0").mkdir(exist_ok=True)
            (root / "train" / "c0" / "x.jpg").write_bytes(b"")
        result = {}
        error = user_error_or_none(lambda: result.update(check_dataset(LOCAL, tmp, "imagefolder", workers=1)),
                                   tmp)
        if error is None:
            trains = [counts[0] for counts in spec["classes"]] + ([1] if spec["not_an_image"] else [])
            vals = sum(counts[1] for counts in spec["classes"])
            nothing = not vals or not sum(trains) or spec["not_an_image"] or 0 in trains
            assert bool(result["bad_files"]) == nothing, result


# ---- webdataset tars, indexed and checked ----

def member(tar: tarfile.TarFile, name: str, data: bytes = b"", kind: bytes = tarfile.REGTYPE,
           size: int | None = None, link: str = "") -> None:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = kind, link
    info.size = len(data) if size is None else size
    tar.addfile(info, io.BytesIO(data) if info.isfile() else None)


LABELS = {"label": b"1", "huge-label": b"9" * 100_000, "superscript-label": "\u00b2".encode(),
          "binary-label": b"\xff\xfe", "negative-label": b"-1"}
NAMES = st.sampled_from(["s/0001", "../up", "/abs/0002", "a/../../b", "ok", "x" * 200, "dot.ted.name", "s/"])
MEMBERS = st.lists(st.tuples(NAMES, st.sampled_from(["jpg", "cls", "png", "txt", ""]),
                             st.sampled_from(list(LABELS) + ["data", "symlink", "hardlink", "dir",
                                                             "lying-size"])), max_size=6)


def wds_shard(members: list[tuple[str, str, str]], cut: int) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.GNU_FORMAT) as tar:
        for key, ext, what in members:
            name = f"{key}.{ext}" if ext else key
            if what == "data":
                member(tar, name, JPEG)
            elif what in LABELS:
                member(tar, name, LABELS[what])
            elif what in ("symlink", "hardlink"):
                member(tar, name, kind=tarfile.SYMTYPE if what == "symlink" else tarfile.LNKTYPE,
                       link="/etc/passwd")
            elif what == "dir":
                member(tar, name, kind=tarfile.DIRTYPE)
            else:  # a header promising more bytes than follow
                info = tarfile.TarInfo(name)
                info.size = 10**6
                tar.addfile(info, io.BytesIO(JPEG + b"\0" * (10**6 - len(JPEG))))
    data = out.getvalue()
    return data[:cut] if cut else data


@budget(60)
@given(members=MEMBERS, cut=st.sampled_from([0, 0, 100, 511, 512, 1500, 10**5]))
@example(members=[("../up", "jpg", "data"), ("../up", "cls", "label")], cut=0).via("a key climbing out")
@example(members=[("/abs/0002", "jpg", "symlink"), ("/abs/0002", "cls", "label")], cut=0).via("a link")
@example(members=[("s/0001", "jpg", "lying-size"), ("s/0001", "cls", "label")], cut=1500).via("cut short")
@example(members=[("s/0001", "jpg", "data"), ("s/0001", "cls", "huge-label")], cut=0).via("a huge label")
@example(members=[("s/0001", "jpg", "data"), ("s/0001", "cls", "superscript-label")], cut=0).via("not 0-9")
@example(members=[("s/0001", "jpg", "data"), ("s/0001", "cls", "binary-label")], cut=0).via("not UTF-8")
def test_webdataset_shard(members: list, cut: int):
    """`ddp datasets index` on a tar of any members, then `datasets check` reading every image."""
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "w-000.tar").write_bytes(wds_shard(members, cut))
        error = user_error_or_none(lambda: index_shards(tmp, {"train": "w-*.tar", "val": "w-*.tar"}, None),
                                   "w-000.tar")
        if error is None:
            user_error_or_none(lambda: check_dataset(LOCAL, tmp, "shards", workers=1), tmp)


# ---- samples tables whose arrays are well-formed npz but mean nothing ----

@pytest.mark.parametrize("column, value", [("label", 7), ("label", -1), ("shard", 3), ("offset", -5),
                                           ("size", 1.5), ("key_offsets", 10**6)])
def test_samples_table_values(column: str, value: float, tmp_path: Path):
    """A label or shard the index does not list, a negative offset, a float, a string past its buffer."""
    files = shards_files()
    with np.load(io.BytesIO(files["train-samples.npz"])) as z:
        arrays = dict(z)
    arrays[column] = arrays[column].astype(type(value))
    arrays[column][-1] = value
    out = io.BytesIO()
    np.savez(out, **arrays)
    for name, data in {**files, "train-samples.npz": out.getvalue()}.items():
        (tmp_path / name).write_bytes(data)
    error = user_error_or_none(lambda: read_shards(tmp_path), "train-samples.npz")
    assert error is not None


# ---- checkpoints whose keys are missing or of the wrong type ----

STATE = {"config": RunConfig().model_dump(mode="json"), "classes": list(SYNSETS),
         "descriptions": list(SYNSETS), "model": {"w": torch.ones(2)}, "ema": None, "final": {},
         "dataset": {},
         "format_version": 3}
WRONG = st.sampled_from([None, 1, -1, 1e308, float("nan"), "x", [], {}, [1], {"a": 1}, True])


@budget(60)
@given(changes=st.dictionaries(st.sampled_from([*STATE, "rng", "running"]), WRONG | st.just("drop"),
                               max_size=3),
       weights=st.sampled_from(["model", "ema"]))
@example(changes={"classes": "drop"}, weights="model").via("no classes")
@example(changes={"format_version": "x"}, weights="model").via("a version that is no number")
@example(changes={"config": 1}, weights="model").via("a config that is no table")
def test_checkpoint_keys(changes: dict, weights: str):
    state = {k: v for k, v in {**STATE, **changes}.items() if v != "drop"}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "last.pt"
        save_checkpoint(state, path)
        user_error_or_none(lambda: load_trained(path, weights), "last.pt")


@pytest.mark.parametrize("split", ["train", "val"])
def test_check_fails_on_an_empty_split(split: str, tmp_path: Path):
    """The rule itself, one case each, so a regression names it."""
    for s in ("train", "val"):
        (tmp_path / s / "c0").mkdir(parents=True)
        if s != split:
            (tmp_path / s / "c0" / "0.jpg").write_bytes(JPEG)
    result = check_dataset(LOCAL, str(tmp_path), "imagefolder", workers=1)
    empty = {"path": f"{split}/", "reason": "empty split: no image to train or validate on"}
    assert empty in result["bad_files"]
