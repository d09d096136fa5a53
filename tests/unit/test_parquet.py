"""Layout `parquet`: `datasets`-style Parquet indexed by row group and row, read a row group at a time."""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from conftest import KEY, SECRET, ddp_in_process, last_json
from synthetic import readme_with_classes, write_hf_parquet, write_registry

from ddp_cli.data.fetch.parquet_reader import ParquetReader
from ddp_cli.data.pipeline.check import check_dataset
from ddp_cli.data.pipeline.images import BadImage
from ddp_cli.data.pipeline.loaders import ImageDataset, open_reader, read_row
from ddp_cli.data.pipeline.sampler import ShardSampler
from ddp_cli.data.sources.layouts import build_index, infer_layout
from ddp_cli.data.sources.parquet import (
    ParquetOptions,
    class_label_features,
    info_features,
    parquet_files,
    readme_class_labels,
    split_names,
    split_of,
)
from ddp_cli.data.sources.table import IndexTable
from ddp_cli.errors import ConfigError, DataError

FS = fsspec.filesystem("file")
IMAGE = pa.struct([("bytes", pa.binary()), ("path", pa.string())])


@pytest.fixture(scope="module")
def hub(tmp_path_factory) -> tuple[Path, dict[str, list[int]]]:
    """3 classes: train 24 rows, validation 7, test 5, two files each of 4-row groups under data/."""
    root = tmp_path_factory.mktemp("hub")
    return root, write_hf_parquet(root, {"train": 24, "validation": 7, "test": 5})


def write_rows(path: Path, images: list[dict | None], labels: list[int | None], **columns) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    table = {"image": pa.array(images, IMAGE), "label": pa.array(labels, pa.int64()), **columns}
    pq.write_table(pa.table(table), path, row_group_size=2)


def row_group_reads(monkeypatch, with_columns: bool = False) -> list:
    """Every row group pyarrow reads from now on (with the columns asked for, if `with_columns`)."""
    reads = []
    original = pq.ParquetFile.read_row_group
    monkeypatch.setattr(pq.ParquetFile, "read_row_group", lambda self, g, **kw: reads.append(
        (g, kw["columns"]) if with_columns else g) or original(self, g, **kw))
    return reads


@pytest.mark.parametrize(("path", "split"), [
    ("data/train-00000-of-00294.parquet", "train"), ("data/validation-00003-of-00014.parquet", "val"),
    ("val-0.parquet", "val"), ("valid-00000.parquet", "val"), ("test-00000-of-00028.parquet", "test"),
    ("default/train/0000.parquet", "train"), ("validation/0001.parquet", "val"), ("train.parquet", "train"),
    ("data/extra-00000.parquet", None), ("data/trainer-0.parquet", None), ("training/0.parquet", None)])
def test_split_comes_from_the_file_name_or_else_its_folder(path, split):
    assert split_of(path) == split


def test_files_are_found_under_the_root_per_split_in_shard_order(tmp_path):
    for name in ("data/train-00001-of-00002.parquet", "data/train-00000-of-00002.parquet",
                 "data/validation-00000-of-00001.parquet", "data/notes-0.parquet",
                 ".cache/train-00000.parquet", "README.md"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(b"")
    assert parquet_files(FS, str(tmp_path)) == {
        "train": ["data/train-00000-of-00002.parquet", "data/train-00001-of-00002.parquet"],
        "val": ["data/validation-00000-of-00001.parquet"]}
    assert infer_layout(FS, str(tmp_path)) == "parquet"


def test_index_records_file_row_group_and_row_as_arrays(hub, tmp_path):
    root, labels = hub
    index = build_index(FS, str(root), "parquet")
    train = index.splits["train"]
    assert index.classes == ["class 0", "class 1", "class 2"]
    assert train.container == "parquet" and train.labels.tolist() == labels["train"]
    assert train.paths[13] == "data/train-00001-of-00002.parquet#1"
    assert train.members.tolist()[:6] == [[0, 0], [0, 1], [0, 2], [0, 3], [1, 0], [1, 1]]
    assert train.members.tolist()[12:14] == [[0, 0], [0, 1]]  # the second file starts again at group 0
    assert train.starts.tolist() == [0, 4, 8, 12, 16, 20, 24]
    assert index.counts()["val"] == {"images": 7, "classes": 3}
    index.save(tmp_path)
    for name in ("train", "val"):  # arrays only: loaded without pickles, the container kept
        assert IndexTable.load(tmp_path).splits[name] == index.splits[name]
    assert not any(np.load(f, allow_pickle=False).dtype == object for f in tmp_path.glob("*.npy"))


def test_class_subset_relabels_and_regroups_rows(hub):
    root, labels = hub
    index = build_index(FS, str(root), "parquet", classes=["class 2", "class 0"], splits=("test",))
    test = index.splits["test"]
    assert index.classes == ["class 2", "class 0"]
    kept = [i for i, label in enumerate(labels["test"]) if label in (2, 0)]
    assert test.labels.tolist() == [{2: 0, 0: 1}[labels["test"][i]] for i in kept]
    assert [test.paths[i] for i in range(len(test))] == [
        f"data/test-0000{i // 3}-of-00002.parquet#{i % 3}" for i in kept]
    assert test.starts[-1] == len(kept) and (np.diff(test.starts) >= 0).all()


def class_sources(root: Path, features_in_schema: bool) -> None:
    """Every source of class names, each with its own names: README, dataset_info.json, the schema's
    `datasets` features, classes.txt."""
    features = {"label": {"_type": "ClassLabel", "names": ["schema a", "schema b"]}}
    metadata = {b"huggingface": json.dumps({"info": {"features": features}})} if features_in_schema else None
    table = pa.table({"image": pa.array([{"bytes": b"x", "path": None}] * 2, IMAGE), "label": [0, 1]})
    (root / "data").mkdir(parents=True)
    for split in ("train", "validation"):
        pq.write_table(table.replace_schema_metadata(metadata), root / "data" / f"{split}-0.parquet")
    (root / "README.md").write_text(readme_with_classes(["readme a", "readme b"]))
    (root / "dataset_info.json").write_text(json.dumps({"default": {"features": {"label": {
        "_type": "ClassLabel", "names": ["info a", "info b"]}}}}))
    (root / "classes.txt").write_text("listed a\nlisted b\n")


def test_class_names_come_from_the_first_source_that_has_them(tmp_path):
    class_sources(tmp_path, features_in_schema=True)
    seen = []
    for remove in ("README.md", "dataset_info.json", None, "classes.txt"):
        seen.append(build_index(FS, str(tmp_path), "parquet").classes)
        if remove:
            (tmp_path / remove).unlink()
        else:  # the schema's features: rewrite the files without them
            pq.write_table(pq.read_table(tmp_path / "data/train-0.parquet").replace_schema_metadata(None),
                           tmp_path / "data/train-0.parquet")
    seen.append(build_index(FS, str(tmp_path), "parquet").classes)
    assert seen == [["readme a", "readme b"], ["info a", "info b"], ["schema a", "schema b"],
                    ["listed a", "listed b"], ["0", "1"]]


def test_readme_names_are_read_quoted_plain_or_listed_for_the_label_feature():
    card = """---
dataset_info:
  features:
  - name: image
    dtype: image
  - name: coarse
    dtype:
      class_label:
        names:
          '0': not these
  - name: label
    dtype:
      class_label:
        names:
          '0': tench, Tinca tinca
          '1': 'cock''s comb'
          "2": "quoted \\u00e9"
          '3': plain: with a colon
  splits:
  - name: train
---
"""
    assert readme_class_labels(card) == {"coarse": ["not these"], "label": [
        "tench, Tinca tinca", "cock's comb", "quoted é", "plain: with a colon"]}
    listed = card.replace("'0': tench, Tinca tinca", "- first").replace("'1': 'cock''s comb'", "- second")
    listed = listed.replace('"2": "quoted \\u00e9"\n', "").replace("'3': plain: with a colon\n", "")
    assert readme_class_labels(listed)["label"] == ["first", "second"]
    assert readme_class_labels("# no front matter\n") == {}


def test_dataset_info_is_read_flat_or_under_its_config_and_bad_json_is_named(tmp_path):
    flat = {"features": {"label": {"_type": "ClassLabel", "names": ["a", "b"]}}}
    assert class_label_features(info_features(json.dumps(flat), "x")) == {"label": ["a", "b"]}
    assert class_label_features(info_features(json.dumps({"cfg": flat}), "x")) == {"label": ["a", "b"]}
    plain = {"features": {"label": {"dtype": "int64"}}}
    assert class_label_features(info_features(json.dumps(plain), "x")) == {}
    with pytest.raises(DataError, match="^where/dataset_info.json: not JSON"):
        info_features("{", "where/dataset_info.json")


def test_loader_reads_a_row_group_once_and_keeps_a_bounded_few(hub, monkeypatch):
    root, labels = hub
    train = build_index(FS, str(root), "parquet").splits["train"]
    reads = row_group_reads(monkeypatch, with_columns=True)
    reader = open_reader(FS, str(root), train, window=1)  # keeps 3 row groups
    assert isinstance(reader, ParquetReader)
    for row in range(len(train)):  # in file order: each group read once, with the image column alone
        assert read_row(reader, train, row).size == (16, 16)
    assert reads == [(g, ["image"]) for g in (0, 1, 2)] * 2
    assert len(reader._groups) == 3
    read_row(reader, train, 0)  # group 0 of the first file was dropped: read again
    assert len(reads) == 7


def test_the_training_order_reads_each_row_group_once_per_epoch(hub, monkeypatch):
    """The shards' windows over row groups: a window's rows shuffled together, its groups kept meanwhile."""
    root, _ = hub
    train = build_index(FS, str(root), "parquet").splits["train"]
    reads = row_group_reads(monkeypatch)
    dataset = ImageDataset(FS, str(root), train, lambda image: image.size, "error", window=2)
    sampler = ShardSampler(len(train), 0, 1, shuffle=True, seed=5, batch_size=4, shards=train.starts,
                           window=2)
    order = list(sampler)
    assert sorted(order) == list(range(24)) and order != sorted(order)
    for index in order:
        dataset[index]
    assert len(reads) == 6  # 6 row groups, each read once


def test_undecodable_bytes_and_missing_images_are_bad_images(tmp_path):
    write_rows(tmp_path / "data/train-0.parquet",
               [{"bytes": b"not an image", "path": "x.jpg"}, {"bytes": None, "path": None}, None,
                {"bytes": None, "path": "missing.jpg"}], [0, 1, 0, 1])
    write_rows(tmp_path / "data/val-0.parquet", [{"bytes": b"?", "path": None}], [0])
    split = build_index(FS, str(tmp_path), "parquet", on_bad_image="skip").splits["train"]
    reader = open_reader(FS, str(tmp_path), split)
    reasons = []
    for row in range(4):
        with pytest.raises(BadImage) as info:
            read_row(reader, split, row)
        reasons.append(str(info.value))
    assert reasons == ["not an image", "missing file", "missing file", "missing file"]
    checked = check_dataset(FS, str(tmp_path), "parquet", ("train",))
    assert [b["path"] for b in checked["bad_files"]] == [f"data/train-0.parquet#{i}" for i in range(4)]


def test_a_path_only_row_is_read_under_the_root_and_an_unsafe_one_refused(tmp_path, monkeypatch):
    from synthetic import encoded, image

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # the node's copies are read by more than one process

    (tmp_path / "img").mkdir()
    image(1, 0).save(tmp_path / "img/a.jpg")
    rows = [{"bytes": None, "path": "img/a.jpg"}, {"bytes": None, "path": "../outside.jpg"},
            {"bytes": encoded(image(2, 1)), "path": "/abs/but/bytes/win.jpg"}]
    write_rows(tmp_path / "data/train-0.parquet", rows, [0, 1, 1])
    write_rows(tmp_path / "data/val-0.parquet", rows[:1], [0])
    with pytest.raises(DataError, match=r"/data/train-0.parquet#1: image path '\.\./outside\.jpg': unsafe "
                                        r"path .*\(1 such row\(s\)\).*on_bad_image = \"skip\""):
        build_index(FS, str(tmp_path), "parquet", on_bad_image="error")
    split = build_index(FS, str(tmp_path), "parquet", on_bad_image="skip").splits["train"]
    from ddp_cli.data.fetch.row_groups import NodeGroups

    shared = ParquetReader(FS, str(tmp_path), shared=NodeGroups(tmp_path / "node", keep=4))
    for reader in (open_reader(FS, str(tmp_path), split), shared):  # the node's copy: no bytes, its path
        assert read_row(reader, split, 0).size == (40, 40)
        with pytest.raises(BadImage, match="^unsafe path"):
            read_row(reader, split, 1)
        assert read_row(reader, split, 2).size == (40, 40)  # a row with bytes: its path is only a name


def test_rows_without_a_class_are_left_out_and_listed(tmp_path):
    write_rows(tmp_path / "data/train-0.parquet", [{"bytes": b"x", "path": None}] * 4, [0, None, -1, 5])
    write_rows(tmp_path / "data/val-0.parquet", [{"bytes": b"x", "path": None}], [0])
    (tmp_path / "classes.txt").write_text("a\nb\n")
    index = build_index(FS, str(tmp_path), "parquet")
    assert len(index.splits["train"]) == 1 and index.splits["train"].paths[0] == "data/train-0.parquet#0"
    assert index.problems == [{"path": "data/train-0.parquet#1", "reason": "no label"},
                              {"path": "data/train-0.parquet#2", "reason": "no label"},
                              {"path": "data/train-0.parquet#3", "reason": "label 5 is not a class"}]


@pytest.mark.parametrize(("columns", "message"), [
    ({"picture": pa.array([b"x"]), "label": [0]},
     r"data/train-0\.parquet: no image column \(a struct of bytes and/or path.*its columns: picture, label$"),
    ({"image": pa.array([{"bytes": b"x", "path": None}], IMAGE), "fine_label": [0]},
     r"data/train-0\.parquet: no column 'label' \(its columns: image, fine_label\)"),
    ({"image": pa.array([{"bytes": b"x", "path": None}], IMAGE), "label": ["cat"]},
     r"data/train-0\.parquet: column 'label' holds string, not class indices$")])
def test_a_missing_column_is_exit_3_naming_the_file_and_column(tmp_path, columns, message):
    (tmp_path / "data").mkdir()
    pq.write_table(pa.table(columns), tmp_path / "data/train-0.parquet")
    with pytest.raises(DataError, match=message) as info:
        build_index(FS, str(tmp_path), "parquet", splits=("train",))
    assert info.value.exit_code == 3


def write_cifar(root: Path, splits: tuple[str, ...] = ("train", "validation")) -> None:
    """CIFAR-100 as the hub ships it (but for `splits`): `img`, and two ClassLabels, `fine_label` and
    `coarse_label`, declared in the schema's `datasets` features only."""
    features = {"img": {"_type": "Image"},
                "fine_label": {"_type": "ClassLabel", "names": ["apple", "bee", "cup"]},
                "coarse_label": {"_type": "ClassLabel", "names": ["fruit", "insect"]}}
    metadata = {b"huggingface": json.dumps({"info": {"features": features}})}
    table = pa.table({"img": pa.array([{"bytes": b"x", "path": None}] * 3, IMAGE), "fine_label": [2, 0, 1],
                      "coarse_label": [0, 0, 1]}).replace_schema_metadata(metadata)
    (root / "data").mkdir()
    for split in splits:
        pq.write_table(table, root / "data" / f"{split}-0.parquet")


def test_of_two_class_label_columns_the_registry_names_one_else_the_error_names_both_and_the_fix(tmp_path):
    write_cifar(tmp_path)
    with pytest.raises(DataError) as info:
        build_index(FS, str(tmp_path), "parquet", splits=("train",))
    assert str(info.value) == (
        f"{tmp_path}/data/train-0.parquet: no column 'label' (its columns: img, fine_label, coarse_label) "
        "and 2 ClassLabel features (fine_label, coarse_label); name one in the registry entry: "
        '[datasets.parquet] label_column = "fine_label" or label_column = "coarse_label"')
    assert info.value.exit_code == 3
    registry = write_registry(tmp_path, [{"name": "cifar", "layout": "parquet", "parquet": {
        "label_column": "fine_label"}, "storage": {"driver": "FileSystem", "path": str(tmp_path)}}])
    shown = last_json(ddp_in_process("datasets", "show", "cifar", "--registry", str(registry), "--json"))
    assert shown["parquet"] == {"label_column": "fine_label"}
    assert [c["synset"] for c in shown["classes"]] == ["apple", "bee", "cup"]
    index = build_index(FS, str(tmp_path), "parquet", options=ParquetOptions(label_column="fine_label"))
    assert index.splits["train"].labels.tolist() == [2, 0, 1]


def test_a_root_of_train_and_test_only_validates_on_test_with_val_split(tmp_path):
    """CIFAR's files as the hub ships them: without val_split the error names the key to set; with it, val
    holds the test files' rows (a validation-* file then left out) wherever the index is built."""
    write_cifar(tmp_path, ("train", "test"))
    fine = {"label_column": "fine_label"}
    with pytest.raises(DataError) as info:
        build_index(FS, str(tmp_path), "parquet", options=ParquetOptions(**fine))
    assert str(info.value) == (
        f"{tmp_path}: no Parquet files of the val split (named validation-* or valid-* or val-* anywhere "
        "under the root, or in a folder so named); found: test (1 files), train (1 files); to validate on "
        'its test files, set [datasets.parquet] val_split = "test" in the registry entry')
    with pytest.raises(DataError, match=r"val split \(named dev-\* anywhere under the root, or in a folder "
                                        r"so named as \[datasets.parquet\] val_split says\); found: test "
                                        r"\(1 files\), train \(1 files\)$"):
        build_index(FS, str(tmp_path), "parquet", options=ParquetOptions(**fine, val_split="dev"))
    (tmp_path / "data/validation-0.parquet").write_bytes((tmp_path / "data/test-0.parquet").read_bytes())
    index = build_index(FS, str(tmp_path), "parquet", options=ParquetOptions(**fine, val_split="test"))
    val = index.splits["val"]
    assert [val.paths[i] for i in range(len(val))] == [f"data/test-0.parquet#{i}" for i in range(3)]
    registry = write_registry(tmp_path, [{"name": "cifar", "layout": "parquet", "parquet": {
        **fine, "val_split": "test"}, "storage": {"driver": "FileSystem", "path": str(tmp_path)}}])
    shown = last_json(ddp_in_process("datasets", "show", "cifar", "--registry", str(registry), "--json"))
    assert shown["splits"] == {"train": {"images": 3, "classes": 3}, "val": {"images": 3, "classes": 3}}


@pytest.mark.parametrize(("path", "names", "split"), [
    ("test/0000.parquet", split_names("test"), "val"), ("validation-0.parquet", split_names("test"), None),
    ("val_extra-0.parquet", split_names(extra=("val_extra",)), "val_extra"),
])
def test_val_split_and_unlabeled_names_are_read_as_their_split(path, names, split):
    assert split_of(path, names) == split


def test_the_one_class_label_column_is_taken_when_there_is_no_label_column(tmp_path):
    """`beans`: its ClassLabel is `labels`, declared in the README's dataset card."""
    (tmp_path / "data").mkdir()
    images = pa.array([{"bytes": b"x", "path": None}] * 2, IMAGE)
    pq.write_table(pa.table({"image": images, "labels": [1, 0]}), tmp_path / "data/train-0.parquet")
    (tmp_path / "README.md").write_text(readme_with_classes(["healthy", "rust"], label="labels"))
    index = build_index(FS, str(tmp_path), "parquet", splits=("train",))
    assert index.classes == ["healthy", "rust"] and index.splits["train"].labels.tolist() == [1, 0]


def test_a_split_without_files_names_the_names_it_looked_for(hub, tmp_path):
    (tmp_path / "train-0.parquet").write_bytes((hub[0] / "data/train-00000-of-00002.parquet").read_bytes())
    with pytest.raises(DataError, match=r"no Parquet files of the val split \(named validation-\* or "
                                        r"valid-\* or val-\* anywhere under the root.*found: train \(1 "
                                        r"files\)$"):
        build_index(FS, str(tmp_path), "parquet")


def test_without_pyarrow_the_layout_is_a_one_line_exit_2(hub, monkeypatch):
    from ddp_cli import errors

    monkeypatch.setitem(errors.EXTRAS, "parquet", ("ddp_no_such_module", "pyarrow"))
    with pytest.raises(ConfigError, match=r"layout parquet: the pyarrow package is not installed; "
                                          r"pip install 'ddp-cli\[parquet\]'$") as info:
        build_index(FS, str(hub[0]), "parquet")
    assert info.value.exit_code == 2


def test_datasets_commands_and_pack_read_parquet(hub, tmp_path):
    """list/show/check and pack in process; the shards hold every image with its label and its source row."""
    root, labels = hub
    registry = write_registry(tmp_path, [{"name": "hub", "layout": "parquet",
                                          "storage": {"driver": "FileSystem", "path": str(root)}},
                                         {"name": "packed", "storage": {"driver": "FileSystem",
                                                                        "path": str(tmp_path / "shards")}}])
    listed = last_json(ddp_in_process("datasets", "list", "--registry", str(registry), "--json"))
    assert listed[0]["layout"] == "parquet"
    shown = last_json(ddp_in_process("datasets", "show", "hub", "--registry", str(registry), "--json"))
    assert shown["splits"] == {"train": {"images": 24, "classes": 3}, "val": {"images": 7, "classes": 3}}
    assert shown["classes"][2] == {"index": 2, "synset": "class 2", "description": "class 2"}
    checked = last_json(ddp_in_process("datasets", "check", "hub", "--split", "all", "--registry",
                                       str(registry), "--json"))
    assert checked["bad_files"] == []
    packed = last_json(ddp_in_process("datasets", "pack", "hub", "--registry", str(registry), "--to",
                                      str(tmp_path / "shards"), "--split", "all", "--json"))
    assert packed["splits"]["train"]["images"] == 24 and packed["splits"]["val"]["images"] == 7
    shards = build_index(FS, str(tmp_path / "shards"), "shards")
    train = build_index(FS, str(root), "parquet").splits["train"]
    from ddp_cli.data.sources.shards import read_samples

    samples = read_samples(FS, str(tmp_path / "shards"), "train")
    source_rows = [train.paths.index(samples.path[i]) for i in range(len(samples))]
    assert sorted(source_rows) == list(range(24))
    assert shards.splits["train"].labels.tolist() == [labels["train"][r] for r in source_rows]
    assert torch.tensor(source_rows).diff().abs().sum() > 0  # shuffled, not copied in order


def test_the_reader_refuses_a_file_name_that_could_leave_the_root(hub):
    from ddp_cli.data.fetch.storage import UnsafePath

    reader = ParquetReader(FS, str(hub[0] / "data"))
    with pytest.raises(UnsafePath):
        reader.read("../data/train-00000-of-00002.parquet#0", (0, 0))
    assert reader.read("train-00000-of-00002.parquet#0", (0, 0))[:2] == b"\xff\xd8"


def test_predict_dataset_reads_a_parquet_split_with_the_checkpoints_classes(hub, tmp_path):
    from types import SimpleNamespace

    from ddp_cli.cli.commands.checkpoints import predict_inputs
    from ddp_cli.config import RunConfig

    registry = write_registry(tmp_path, [{"name": "hub", "layout": "parquet",
                                          "storage": {"driver": "FileSystem", "path": str(hub[0])}}])
    trained = SimpleNamespace(classes=["class 1", "class 2"])
    cfg = RunConfig().resolved({"data.dataset": "hub"})  # what `predict --dataset hub` sets
    entry, index = predict_inputs(cfg, trained, [], "hub", "val", str(registry))
    val = index.splits["val"]
    assert index.classes == ["class 1", "class 2"] and entry.layout == "parquet"
    kept = [i for i, label in enumerate(hub[1]["validation"]) if label in (1, 2)]
    assert [val.paths[i] for i in range(len(val))] == [
        f"data/validation-0000{i // 4}-of-00002.parquet#{i % 4}" for i in kept]
    assert val.labels.tolist() == [hub[1]["validation"][i] - 1 for i in kept]


def test_bench_data_times_parquet_against_files_in_the_same_run(hub, tmp_path):
    from synthetic import make_imagenet_loc

    make_imagenet_loc(tmp_path / "files", classes=3, train_per_class=8, size=16)
    registry = write_registry(tmp_path, [
        {"name": "files", "layout": "imagenet-loc", "storage": {"driver": "FileSystem", "path": "files"}},
        {"name": "hub", "layout": "parquet", "storage": {"driver": "FileSystem", "path": str(hub[0])}}])
    out = last_json(ddp_in_process("bench", "data", "files", "hub", "--registry", str(registry), "--workers",
                                   "0", "--seconds", "1", "--rounds", "1", "--batch-size", "4",
                                   "--image-size", "16", "--json"))
    files, parquet = out["rows"]
    assert (files["storage"], parquet["storage"]) == ("local files", "local parquet")
    assert parquet["images"] > 0 and parquet["ratio"] == pytest.approx(
        parquet["images_per_second"] / files["images_per_second"])


def test_loader_processes_of_a_node_decode_each_row_group_once_between_them(hub, tmp_path, monkeypatch):
    """Two readers of a node (two ranks here, each its own NodeGroups) reading every row of the same groups,
    as the training order has them do: each group decoded once, the other reader reads the node's copy.
    A node's only reader writes no copies: nobody would read them."""
    from ddp_cli.data.fetch.row_groups import NodeGroups, readers_on_node

    root, _ = hub
    train = build_index(FS, str(root), "parquet").splits["train"]
    lone = ParquetReader(FS, str(root), 3, shared=NodeGroups(tmp_path / "lone", keep=4))
    assert lone.read(train.paths[0], train.members[0]) and not (tmp_path / "lone").exists()
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setattr(torch.utils.data, "get_worker_info", lambda: SimpleNamespace(num_workers=3))
    assert readers_on_node() == 6  # 2 ranks, 3 loader processes each
    monkeypatch.undo()
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    reads = row_group_reads(monkeypatch)
    alone = open_reader(FS, str(root), train)
    expected = [alone.read(train.paths[r], train.members[r]) for r in range(len(train))]
    reads.clear()
    workers = [ParquetReader(FS, str(root), 3, shared=NodeGroups(tmp_path, keep=4)) for _ in range(2)]
    got = [[w.read(train.paths[r], train.members[r]) for w in workers] for r in range(len(train))]
    assert got == [[image, image] for image in expected]
    assert len(reads) == 6  # 6 row groups, each decoded once for both readers
    assert len(list(tmp_path.glob("*.rows"))) == 4  # the node keeps the 4 most recently written
    last = train.paths[-1].split("#")[0]
    os.utime(root / last, ns=(1, 1))  # the file rewritten: the node's copies of it are not read
    ParquetReader(FS, str(root), 3, shared=NodeGroups(tmp_path, keep=4)).read(train.paths[-1],
                                                                               train.members[-1])
    assert len(reads) == 7


def test_a_node_group_file_holds_each_row_at_its_place_and_no_bytes_as_none(tmp_path):
    """The node's copy of a group: every row's bytes (an empty image stays b""), None where the row has
    none (its bytes or its whole image null), past the first byte of the validity bitmap and for a slice
    of a larger array (Arrow's offsets into its parent's buffers)."""
    from ddp_cli.data.fetch.row_groups import NodeGroups

    rows = [{"bytes": bytes([i]) * i, "path": None} for i in range(12)]
    rows[1], rows[4], rows[9] = {"bytes": None, "path": "p.jpg"}, None, {"bytes": None, "path": None}
    images = pa.array(rows, IMAGE)
    for start in (0, 3):
        node = NodeGroups(tmp_path / str(start), keep=2)
        got = [node.read("group", i, lambda start=start: images.slice(start)) for i in range(12 - start)]
        assert got == [row and row["bytes"] for row in rows[start:]]


def test_remote_row_groups_read_next_are_read_ahead_once_and_then_taken(hub, tmp_path, s3_endpoint, aws,
                                                                     monkeypatch):
    """From S3 the groups read next are read on a background thread (a round trip and a group's bytes off
    the first image of a window): a node's only reader then takes them from there, readers of a shared
    node from the node's copies; each group read once, the images those of the local files."""
    import s3fs

    from ddp_cli.data.fetch.row_groups import NodeGroups

    root, _ = hub
    train = build_index(FS, str(root), "parquet").splits["train"]
    local = ParquetReader(FS, str(root))
    expected = [local.read(train.paths[r], train.members[r]) for r in range(len(train))]
    fs = s3fs.S3FileSystem(key=KEY, secret=SECRET, client_kwargs={"endpoint_url": s3_endpoint},
                           skip_instance_cache=True)
    fs.mkdir("hub-ahead")
    fs.put(f"{root}/", "hub-ahead/hub/", recursive=True)
    groups = sorted({(train.paths[r].split("#")[0], int(train.members[r][0])) for r in range(len(train))})
    for sharing in ("1", "2"):  # LOCAL_WORLD_SIZE: a node's only reader, then two
        monkeypatch.setenv("LOCAL_WORLD_SIZE", sharing)
        reads = row_group_reads(monkeypatch)
        readers = [ParquetReader(fs, "hub-ahead/hub", keep=8, shared=NodeGroups(tmp_path / sharing, keep=8))
                   for _ in range(int(sharing))]
        readers[0].read_ahead(groups)
        for pending in list(readers[0]._pending.values()):
            pending.result()
        assert len(reads) == len(groups)
        assert [[r.read(train.paths[i], train.members[i]) for r in readers] for i in range(len(train))] == [
            [image] * len(readers) for image in expected]
        assert len(reads) == len(groups)  # nothing read again on demand


def test_a_group_another_process_evicts_the_moment_it_is_written_is_still_read(tmp_path, monkeypatch):
    """Other processes write groups and evict the oldest at any time, so a group file can be unlinked
    as soon as it is in place: the writer reads it all the same (its file was open before), never
    "missing file"."""
    from ddp_cli.data.fetch import row_groups

    rows = [{"bytes": bytes([i]) * (i + 1), "path": None} for i in range(5)]
    renamed = os.replace

    def evicted_at_once(source, target):
        renamed(source, target)
        os.unlink(target)

    monkeypatch.setattr(row_groups.os, "replace", evicted_at_once)
    node = row_groups.NodeGroups(tmp_path, keep=4)
    assert [node.read("group", i, lambda: pa.array(rows, IMAGE)) for i in range(5)] == [
        row["bytes"] for row in rows]
    assert not list(tmp_path.glob("*.rows"))


def test_a_group_file_another_process_evicts_while_this_one_evicts_is_passed_over(tmp_path, monkeypatch):
    """Listed, then unlinked by another process's eviction before it is looked at: no "missing file"."""
    from ddp_cli.data.fetch.row_groups import NodeGroups

    (tmp_path / "gone.rows").write_bytes(b"")
    stat = Path.stat

    def listed_then_gone(path, *args, **kwargs):
        if path.name == "gone.rows":
            raise FileNotFoundError(path)
        return stat(path, *args, **kwargs)

    monkeypatch.setattr(Path, "stat", listed_then_gone)
    node = NodeGroups(tmp_path, keep=4)
    assert node.read("group", 0, lambda: pa.array([{"bytes": b"x", "path": None}], IMAGE)) == b"x"
