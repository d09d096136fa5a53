"""Index tables per layout, the embedded demo data set, class subsets."""

from __future__ import annotations

import multiprocessing
import shutil
from pathlib import Path

import fsspec
import numpy as np
import pandas as pd
import pytest
from synthetic import make_imagefolder, make_imagenet_loc

from ddp_cli.data.sources import demo
from ddp_cli.data.sources.imagenet_loc import LOC_TRAIN_LIST
from ddp_cli.data.sources.layouts import build_index, infer_layout
from ddp_cli.data.sources.packed import Split
from ddp_cli.data.sources.table import IndexTable
from ddp_cli.errors import ConfigError, DataError

FS = fsspec.filesystem("file")


def rows(split: Split) -> list[tuple[str, int]]:
    return list(zip(split.paths, split.labels.tolist(), strict=True))


@pytest.fixture(scope="module")
def demo_index(demo_root: Path) -> IndexTable:
    return build_index(FS, str(demo_root), "imagenet-loc")


def test_demo_sizes_and_classes(demo_index):
    assert len(demo_index.splits["train"]) == 1438
    assert len(demo_index.splits["val"]) == 359
    assert demo_index.classes == list(demo.SYNSETS)
    assert demo_index.descriptions == [f"digit {n}" for n in demo.NAMES]
    for split in demo_index.splits.values():
        assert np.unique(split.labels).tolist() == list(range(10))
    assert demo_index.problems == []


def test_demo_index_points_at_existing_files(demo_root, demo_index):
    for split in demo_index.splits.values():
        assert all((demo_root / p).is_file() for p in split.paths)
    on_disk = {p.relative_to(demo_root).as_posix() for p in demo_root.rglob("*.JPEG")}
    indexed = set(demo_index.splits["train"].paths) | set(demo_index.splits["val"].paths)
    assert indexed == on_disk


def test_demo_train_labels_are_the_synset_folders(demo_index):
    for path, label in rows(demo_index.splits["train"]):
        assert path.split("/")[-2] == demo_index.classes[label]
        assert path.startswith("ILSVRC/Data/CLS-LOC/train/")


def test_demo_val_labels_are_the_first_synset_of_the_solution(demo_root, demo_index):
    csv = pd.read_csv(demo_root / "LOC_val_solution.csv")
    expected = {f"ILSVRC/Data/CLS-LOC/val/{i}.JPEG": s.split()[0]
                for i, s in zip(csv["ImageId"], csv["PredictionString"], strict=True)}
    got = {p: demo_index.classes[label] for p, label in rows(demo_index.splits["val"])}
    assert got == expected


def test_train_solution_lists_half_but_index_has_all(demo_root, demo_index):
    boxed = pd.read_csv(demo_root / "LOC_train_solution.csv")
    assert 600 < len(boxed) < 840  # about half of 1438: the Kaggle trap
    train_ids = {p.split("/")[-1].removesuffix(".JPEG") for p in demo_index.splits["train"].paths}
    assert set(boxed["ImageId"]) < train_ids
    assert len(train_ids) == 1438


def test_ensure_demo_second_call_rebuilds_nothing(demo_root, monkeypatch):
    marker = demo_root / demo.COMPLETE
    before = marker.stat().st_mtime_ns

    def explode(out):
        raise AssertionError(f"rebuilt the demo into {out}")

    monkeypatch.setattr(demo, "_write_demo", explode)
    assert demo.ensure_demo(demo_root) == demo_root
    assert marker.stat().st_mtime_ns == before


def _build_after_barrier(barrier, root: str) -> None:
    barrier.wait(timeout=30)
    demo.ensure_demo(Path(root))


@pytest.mark.processes
def test_ensure_demo_is_safe_from_several_processes(tmp_path):
    root = tmp_path / "shared" / "demo"
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(3)
    procs = [ctx.Process(target=_build_after_barrier, args=(barrier, str(root))) for _ in range(3)]
    for p in procs:
        p.start()
    try:
        for p in procs:
            p.join(60)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    assert [p.exitcode for p in procs] == [0, 0, 0]
    assert (root / demo.COMPLETE).is_file()
    leftovers = [p.name for p in root.parent.iterdir() if ".building-" in p.name]
    assert leftovers == []
    index = build_index(FS, str(root), "imagenet-loc")
    assert (len(index.splits["train"]), len(index.splits["val"])) == (1438, 359)
    assert len(list(root.rglob("*.JPEG"))) == 1438 + 359


def test_class_subset_first_n(demo_index, demo_root):
    sub = build_index(FS, str(demo_root), "imagenet-loc", classes=3)
    assert sub.classes == list(demo.SYNSETS[:3])
    assert sub.descriptions == ["digit zero", "digit one", "digit two"]
    for name, split in sub.splits.items():
        assert rows(split) == [(p, label) for p, label in rows(demo_index.splits[name]) if label < 3]


def test_class_subset_by_synset_and_description_relabels(demo_index, demo_root):
    sub = build_index(FS, str(demo_root), "imagenet-loc", classes=["n09000007", "digit two"])
    assert sub.classes == ["n09000007", "n09000002"]
    for name, split in sub.splits.items():
        assert set(split.labels.tolist()) == {0, 1}
        relabelled = {7: 0, 2: 1}
        assert rows(split) == [(p, relabelled[label]) for p, label in rows(demo_index.splits[name])
                               if label in relabelled]


def test_unknown_class_name_is_a_config_error(demo_root):
    with pytest.raises(ConfigError, match=r"data\.classes: unknown class 'digit twoo'.*'digit two'"):
        build_index(FS, str(demo_root), "imagenet-loc", classes=["digit twoo"])
    with pytest.raises(ConfigError, match=r"data\.classes: 11 is out of range"):
        build_index(FS, str(demo_root), "imagenet-loc", classes=11)


@pytest.mark.parametrize("classes", [[], ["n09000002", "digit two"], ["digit one", "digit one"]],
                         ids=["empty", "same-class-by-synset-and-name", "repeated-name"])
def test_empty_or_repeated_class_list_is_a_config_error(demo_root, classes):
    """An empty subset trains nothing; a repeated class leaves a head output with no samples."""
    with pytest.raises(ConfigError, match=r"data\.classes"):
        build_index(FS, str(demo_root), "imagenet-loc", classes=classes)


@pytest.fixture(scope="module")
def demo_without_listing(demo_root, tmp_path_factory) -> Path:
    copy = tmp_path_factory.mktemp("nolist") / "demo"
    shutil.copytree(demo_root, copy)
    (copy / LOC_TRAIN_LIST).unlink()
    return copy


def test_listing_train_folders_finds_the_same_images(demo_index, demo_without_listing):
    listed = build_index(FS, str(demo_without_listing), "imagenet-loc")
    assert listed.classes == demo_index.classes
    assert sorted(rows(listed.splits["train"])) == sorted(rows(demo_index.splits["train"]))
    assert listed.splits["val"] == demo_index.splits["val"]


def test_train_index_order_does_not_depend_on_train_cls(demo_index, demo_without_listing):
    """Same data set, same seed, same samples per step: the row order must not depend on the source."""
    listed = build_index(FS, str(demo_without_listing), "imagenet-loc").splits["train"]
    from_file = demo_index.splits["train"]
    pairs = zip(listed.paths, from_file.paths, strict=True)
    first = next((i for i, (a, b) in enumerate(pairs) if a != b), None)
    assert first is None, (f"train row {first}: {listed.paths[first]} when listing the folders, "
                           f"{from_file.paths[first]} from train_cls.txt")
    assert listed.labels.tolist() == from_file.labels.tolist()


def test_synthetic_loc_with_and_without_listing(tmp_path):
    make_imagenet_loc(tmp_path / "a", classes=3, train_per_class=5, val=7, train_list=True)
    make_imagenet_loc(tmp_path / "b", classes=3, train_per_class=5, val=7, train_list=False)
    a = build_index(FS, str(tmp_path / "a"), "imagenet-loc")
    b = build_index(FS, str(tmp_path / "b"), "imagenet-loc")
    assert a.splits == b.splits
    assert len(a.splits["train"]) == 15
    assert a.splits["val"].labels.tolist() == [i % 3 for i in range(7)]


def test_val_row_with_unknown_synset_is_reported_and_dropped(tmp_path):
    make_imagenet_loc(tmp_path, classes=2, train_per_class=2, val=4)
    with (tmp_path / "LOC_val_solution.csv").open("a") as f:
        f.write("ILSVRC2012_val_00000099,n77777777 1 1 5 5\n")
    index = build_index(FS, str(tmp_path), "imagenet-loc")
    assert len(index.splits["val"]) == 4
    assert index.problems == [{"path": "ILSVRC/Data/CLS-LOC/val/ILSVRC2012_val_00000099.JPEG",
                               "reason": "unknown synset"}]


def test_imagefolder_layout(tmp_path):
    make_imagefolder(tmp_path, classes=3, per_class=4)
    (tmp_path / "train" / "class_1" / "notes.txt").write_text("not an image")
    (tmp_path / "train" / "README").write_text("a stray file, not a class")
    index = build_index(FS, str(tmp_path), "imagefolder")
    assert index.classes == ["class_0", "class_1", "class_2"]
    assert index.descriptions == index.classes
    assert len(index.splits["train"]) == 12
    assert len(index.splits["val"]) == 6
    for split in index.splits.values():
        assert all(path.split("/")[-2] == f"class_{label}" for path, label in rows(split))
    assert not any(path.endswith(".txt") for path in index.splits["train"].paths)
    sub = build_index(FS, str(tmp_path), "imagefolder", classes=["class_2"])
    assert sub.classes == ["class_2"]
    assert rows(sub.splits["val"]) == [("val/class_2/img_0.jpg", 0), ("val/class_2/img_1.jpg", 0)]


def test_index_table_save_load_round_trip(tmp_path):
    make_imagenet_loc(tmp_path / "root", classes=3, train_per_class=3, val=5)
    index = build_index(FS, str(tmp_path / "root"), "imagenet-loc", classes=["n00001002", "n00001000"])
    index.save(tmp_path / "cache")
    loaded = IndexTable.load(tmp_path / "cache")
    assert loaded.classes == ["n00001002", "n00001000"]
    assert loaded.descriptions == ["class 2, thing 2", "class 0, thing 0"]
    assert loaded.splits == index.splits  # same paths, labels and order
    assert set(loaded.splits) == {"train", "val"}
    assert len(loaded.splits["train"]) == 6
    for split in loaded.splits.values():
        assert split.labels.dtype == np.uint8  # two classes
        assert isinstance(split.labels.base, np.memmap)  # read from the page cache, not copied
        assert isinstance(split.paths.data.base, np.memmap)


def test_unknown_layout_is_a_config_error_naming_it_and_the_known_ones(tmp_path):
    make_imagefolder(tmp_path)
    with pytest.raises(ConfigError, match=r"layout 'coco' is unknown; known layouts: imagenet-loc, "
                                          r"imagefolder, shards, csv, parquet$") as info:
        build_index(FS, str(tmp_path), "coco")
    assert info.value.exit_code == 2


@pytest.mark.parametrize(("make", "layout"), [(make_imagenet_loc, "imagenet-loc"),
                                              (make_imagefolder, "imagefolder")])
def test_infer_layout_from_the_root(tmp_path, make, layout):
    make(tmp_path)
    assert infer_layout(FS, str(tmp_path)) == layout


def test_infer_layout_wants_both_imagefolder_splits(tmp_path):
    (tmp_path / "train" / "class_0").mkdir(parents=True)
    with pytest.raises(DataError, match="cannot tell its layout"):
        infer_layout(FS, str(tmp_path))


@pytest.mark.parametrize(("header", "missing"), [("ImageId,Boxes", "PredictionString"),
                                                 ("Id,PredictionString", "ImageId")])
def test_val_solution_without_a_column_is_a_data_error_naming_file_and_column(tmp_path, header, missing):
    make_imagenet_loc(tmp_path, classes=2, train_per_class=1, val=2)
    csv = tmp_path / "LOC_val_solution.csv"
    csv.write_text(header + "\n" + "".join(csv.read_text().splitlines(True)[1:]))
    with pytest.raises(DataError, match=rf"LOC_val_solution\.csv: no {missing} column \(found "
                                        rf"{header.replace(',', ', ')}\); its header must be "
                                        r"ImageId,PredictionString") as info:
        build_index(FS, str(tmp_path), "imagenet-loc")
    assert str(csv) in str(info.value) and info.value.exit_code == 3


def test_empty_val_solution_is_a_data_error_naming_the_file(tmp_path):
    make_imagenet_loc(tmp_path, classes=2, train_per_class=1, val=2)
    (tmp_path / "LOC_val_solution.csv").write_text("")
    with pytest.raises(DataError, match=r"LOC_val_solution\.csv: not a CSV"):
        build_index(FS, str(tmp_path), "imagenet-loc")
