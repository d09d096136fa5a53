"""`layout = "csv"`: a table (CSV or Parquet) of paths and labels, its class names and splits, and every
bad row refused or set aside as the other layouts do (unsafe paths, missing columns, unusable labels,
rows listed twice, encodings, undecodable images)."""

from __future__ import annotations

import sys
from pathlib import Path

import fsspec
import pandas as pd
import pytest
from synthetic import CSV_CLASSES, make_csv_listed, plant, write_listing, write_registry

from ddp_cli.data.fetch.storage import UNSAFE_PATH
from ddp_cli.data.pipeline.check import check_dataset
from ddp_cli.data.registry import load_registry
from ddp_cli.data.sources.csv_layout import CsvListing
from ddp_cli.data.sources.layouts import build_index
from ddp_cli.data.sources.packed import Split
from ddp_cli.errors import ConfigError, DataError

FS = fsspec.filesystem("file")
NAMES = sorted(CSV_CLASSES)  # ant, moth, zebra


def rows_of(split: Split) -> list[tuple[str, int]]:
    return list(zip(split.paths, split.labels.tolist(), strict=True))


def index(root: Path, on_bad_image: str = "skip", fs=FS, **spec):
    return build_index(fs, str(root), "csv", on_bad_image=on_bad_image,
                       options=CsvListing(**spec) if spec else None)


@pytest.fixture
def listed(tmp_path) -> tuple[Path, list[dict[str, str]]]:
    """A root of 3 classes (3 train, 1 val image each) and its `labels.csv`; the listing's rows."""
    return tmp_path, make_csv_listed(tmp_path)


def expected(rows: list[dict[str, str]], split: str) -> list[tuple[str, int]]:
    return [(r["path"], NAMES.index(r["label"])) for r in rows if r["split"] == split]


def test_class_names_are_the_labels_sorted_and_rows_keep_the_listings_order(listed):
    root, rows = listed
    table = index(root)
    assert table.classes == table.descriptions == NAMES
    assert {split: rows_of(table.splits[split]) for split in ("train", "val")} == {
        split: expected(rows, split) for split in ("train", "val")}
    assert table.problems == [] and table.unsafe == []


def test_one_listing_per_split_reads_as_one_listing_with_a_split_column(listed):
    root, rows = listed
    one = index(root)
    (root / "labels.csv").unlink()
    for split in ("train", "val"):
        write_listing(root / f"{split}.csv", [{"image": r["path"], "class": r["label"]} for r in rows
                                              if r["split"] == split])
    per_split = index(root, listing="{split}.csv", path_column="image", label_column="class")
    assert per_split.splits == one.splits and per_split.classes == NAMES


def test_pack_reads_the_entrys_listing_a_split_at_a_time_each_problem_with_its_split(listed):
    from ddp_cli.data.pack.writer import pack_index

    root, rows = listed
    rows[-1]["label"] = ""
    write_listing(root / "table.csv", rows)
    packed = pack_index(FS, str(root), "csv", ("train", "val"), "skip", CsvListing(listing="table.csv"))
    assert packed.classes == NAMES
    assert {split: rows_of(packed.splits[split]) for split in ("train", "val")} == {
        split: expected(rows[:-1], split) for split in ("train", "val")}
    assert packed.problems == [{"path": rows[-1]["path"], "split": "val",
                                "reason": f"empty label (table.csv line {len(rows) + 1})"}]


def test_a_parquet_listing_reads_as_the_csv_and_its_integer_labels_as_indices(listed):
    root, rows = listed
    write_listing(root / "labels.parquet", rows)
    assert index(root, listing="labels.parquet").splits == index(root).splits
    numbered = pd.DataFrame({"path": [r["path"] for r in rows], "split": [r["split"] for r in rows],
                             "label": [NAMES.index(r["label"]) for r in rows]})
    numbered.to_parquet(root / "numbered.parquet", index=False)  # label: an int64 column
    table = index(root, listing="numbered.parquet")
    assert table.classes == ["0", "1", "2"] and table.splits == index(root).splits


def test_integer_labels_are_indices_0_to_the_largest_and_a_negative_one_is_rejected(listed):
    root, rows = listed
    val = [(p, 2 * label) for p, label in expected(rows, "val")]
    for r in rows:
        r["label"] = str(NAMES.index(r["label"]) * 2)  # 0, 2, 4: classes 1 and 3 have no image
    rows.append({"path": "images/val_ant_0.png", "label": "-1", "split": "train"})
    write_listing(root / "labels.csv", rows)
    table = index(root)
    assert table.classes == ["0", "1", "2", "3", "4"]
    assert rows_of(table.splits["val"]) == val
    reason = f"label '-1' is not a class index (0 or more) (labels.csv line {len(rows) + 1})"
    assert table.problems == [{"path": "images/val_ant_0.png", "reason": reason}]


def test_a_classes_file_orders_the_classes_and_takes_names_or_indices(listed):
    root, rows = listed
    (root / "classes.txt").write_text("zebra\n\nmoth\nant\nspare\n")  # blank lines skipped
    order = ["zebra", "moth", "ant", "spare"]
    rows[0]["label"] = "2"  # an index into the file: ant
    write_listing(root / "labels.csv", rows)
    table = index(root, classes="classes.txt")
    assert table.classes == order
    assert rows_of(table.splits["train"])[0] == (rows[0]["path"], 2)
    assert rows_of(table.splits["train"])[1:] == [(r["path"], order.index(r["label"])) for r in rows[1:]
                                                  if r["split"] == "train"]


@pytest.mark.parametrize(("label", "reason"), [
    ("tiger", "label 'tiger' is neither a class of classes.txt nor an index 0 to 2"),
    ("3", "label '3' is neither a class of classes.txt nor an index 0 to 2"),
    ("", "empty label"),
])
def test_an_unusable_label_is_refused_naming_its_row_under_error_left_out_under_skip(listed, label, reason):
    root, rows = listed
    (root / "classes.txt").write_text("\n".join(NAMES) + "\n")
    rows[4]["label"] = label
    write_listing(root / "labels.csv", rows)
    with pytest.raises(DataError) as info:
        index(root, "error", classes="classes.txt")
    assert str(info.value) == (f"{root}/labels.csv line 6: {reason} (1 such row(s)); fix the listing, or set "
                               'data.on_bad_image = "skip" to leave them out')
    assert info.value.exit_code == 3
    table = index(root, classes="classes.txt")
    assert rows[4]["path"] not in list(table.splits["train"].paths)
    assert table.problems == [{"path": rows[4]["path"], "reason": f"{reason} (labels.csv line 6)"}]


def test_an_empty_path_is_rejected(listed):
    root, rows = listed
    rows[0]["path"] = ""
    write_listing(root / "labels.csv", rows)
    assert index(root).problems == [{"path": "", "reason": "empty path (labels.csv line 2)"}]


def test_a_path_listed_twice_is_refused_under_error_and_its_later_row_left_out_under_skip(listed):
    """Twice in one split weighs an image double; in train and val it leaks val into training."""
    root, rows = listed
    rows.append({"path": rows[1]["path"], "label": rows[1]["label"], "split": "val"})
    write_listing(root / "labels.csv", rows)
    with pytest.raises(DataError, match=rf"^{root}/labels.csv line {len(rows) + 1}: already listed at "
                                        r"labels.csv line 3 \(1 such row"):
        index(root, "error")
    table = index(root)
    assert rows_of(table.splits["val"]) == expected(rows[:-1], "val")
    assert rows_of(table.splits["train"]) == expected(rows, "train")
    assert table.problems == [{"path": rows[1]["path"], "reason": "already listed at labels.csv line 3 "
                                                                  f"(labels.csv line {len(rows) + 1})"}]


def test_split_cells_train_val_validation_in_any_case_and_other_splits_not_read(listed):
    root, rows = listed
    for r in rows:
        r["split"] = {"train": " Train", "val": "VALIDATION"}[r["split"]]
    rows.append({"path": "images/test_0.png", "label": "unseen", "split": "test"})
    write_listing(root / "labels.csv", rows)
    table = index(root)
    assert table.counts() == {"train": {"images": 9, "classes": 3}, "val": {"images": 3, "classes": 3}}
    assert table.classes == NAMES and table.problems == []


def test_the_classes_come_from_train_and_val_whatever_split_is_read(listed):
    """`predict --dataset --split val` and pack (a split at a time) number the classes as training did."""
    root, rows = listed
    rows.append({"path": "images/train_ant_0.png", "label": "aardvark", "split": "train"})
    del rows[0]
    write_listing(root / "labels.csv", rows)
    val = build_index(FS, str(root), "csv", splits=("val",))
    assert val.classes == ["aardvark", *NAMES] and set(val.splits) == {"val"}
    assert val.splits["val"] == index(root).splits["val"]


def test_a_class_subset_relabels_as_for_every_layout(listed):
    root, rows = listed
    sub = build_index(FS, str(root), "csv", classes=["zebra", "ant"])
    assert sub.classes == ["zebra", "ant"]
    assert rows_of(sub.splits["val"]) == [(r["path"], ["zebra", "ant"].index(r["label"])) for r in rows
                                          if r["split"] == "val" and r["label"] != "moth"]


UNSAFE = ["../secret.png", "/etc/passwd", "images/../../secret.png"]


@pytest.mark.parametrize("name", UNSAFE)
def test_an_unsafe_path_is_refused_naming_file_column_and_value_under_error(listed, name):
    root, rows = listed
    write_listing(root / "labels.csv", [*rows, {"path": name, "label": "ant", "split": "val"}])
    with pytest.raises(DataError) as info:
        index(root, "error")
    assert str(info.value).startswith(f"{root}/labels.csv: path {name!r}: {UNSAFE_PATH}, never read (1 such")
    assert info.value.exit_code == 3


@pytest.mark.parametrize("name", UNSAFE)
def test_an_unsafe_path_is_a_bad_file_never_read_under_skip(listed, name):
    root, rows = listed
    (root.parent / "secret.png").write_bytes((root / rows[0]["path"]).read_bytes())  # would pass as an image
    write_listing(root / "labels.csv", [*rows, {"path": name, "label": "ant", "split": "val"}])
    assert index(root).unsafe == [f"labels.csv: path {name!r}"]
    out = check_dataset(FS, str(root), "csv", workers=2)
    assert [b["reason"] for b in out["bad_files"]] == [UNSAFE_PATH]


def test_dots_that_stay_inside_the_root_are_normalised(listed):
    root, rows = listed
    rows[0]["path"] = "images/x/../" + rows[0]["path"].removeprefix("images/")
    write_listing(root / "labels.csv", rows)
    table = index(root, "error")
    assert table.unsafe == [] and list(table.splits["train"].paths)[0] == "images/train_zebra_0.png"


@pytest.mark.parametrize("column", ["path", "label", "split"])
def test_a_missing_column_is_a_data_error_naming_file_column_and_fix(listed, column):
    root, rows = listed
    renamed = [{("other" if key == column else key): value for key, value in r.items()} for r in rows]
    write_listing(root / "labels.csv", renamed)
    with pytest.raises(DataError) as info:
        index(root)
    message = str(info.value)
    assert message.startswith(f"{root}/labels.csv: no {column} column (found ") and info.value.exit_code == 3
    assert "[datasets.csv]" in message
    if column == "split":
        assert 'listing = "{split}.csv"' in message


def test_a_missing_parquet_column_is_named_too(listed):
    root, rows = listed
    write_listing(root / "labels.parquet", [{"file": r["path"], "label": r["label"]} for r in rows])
    with pytest.raises(DataError, match=r"labels.parquet: no path column \(found file, label\)"):
        index(root, listing="labels.parquet")


def test_a_missing_listing_names_the_file(tmp_path):
    with pytest.raises(DataError, match=rf"^{tmp_path}/labels.csv: missing"):
        index(tmp_path)


@pytest.mark.parametrize("encoding", ["utf-8-sig", "utf-16"])
def test_a_listing_saved_with_a_byte_order_mark_reads_as_utf8(listed, encoding):
    """Spreadsheets save CSV as UTF-8 with a BOM or as UTF-16: the header must still read `path`."""
    root, rows = listed
    rows[0]["label"] = "zébra"
    write_listing(root / "labels.csv", rows)
    plain = index(root)
    (root / "labels.csv").write_bytes((root / "labels.csv").read_text().encode(encoding))
    again = index(root)
    assert again.splits == plain.splits and "zébra" in again.classes


def test_a_listing_in_another_encoding_is_a_data_error_not_a_traceback(listed):
    root, rows = listed
    rows[0]["label"] = "zébra"
    write_listing(root / "labels.csv", rows)
    (root / "labels.csv").write_bytes((root / "labels.csv").read_text().encode("latin-1"))
    with pytest.raises(DataError, match=rf"^{root}/labels.csv: not UTF-8 text: byte 0xe9 at offset \d+; "
                                        "save it as UTF-8$") as info:
        index(root)
    assert info.value.exit_code == 3


def test_a_parquet_listing_without_pyarrow_is_exit_2_naming_the_install(listed, monkeypatch):
    root, rows = listed
    write_listing(root / "labels.parquet", rows)
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    with pytest.raises(ConfigError, match=r"labels.parquet: a Parquet listing: the pyarrow package is "
                                          r"not installed; pip install 'ddp-cli\[parquet\]' or give a CSV "
                                          r"listing$"):
        index(root, listing="labels.parquet")


def test_a_file_that_is_not_parquet_is_a_data_error(listed):
    root, _ = listed
    (root / "labels.parquet").write_text("path,label\n")
    with pytest.raises(DataError, match=r"labels.parquet: not a Parquet file"):
        index(root, listing="labels.parquet")


def test_a_classes_file_naming_a_class_twice_is_a_data_error(listed):
    root, _ = listed
    (root / "classes.txt").write_text("ant\nmoth\nant\n")
    with pytest.raises(DataError, match=r"classes.txt: class 'ant' is listed twice \(lines 1 and 3\)"):
        index(root, classes="classes.txt")


def test_a_remote_root_is_read_through_fsspec(listed):
    """As an S3 root is: the listing and the classes file through the filesystem, not `open`."""
    root, rows = listed
    memory = fsspec.filesystem("memory")
    for path in root.rglob("*"):
        if path.is_file():
            memory.pipe(f"/bucket/data/{path.relative_to(root)}", path.read_bytes())
    write_listing(root / "labels.parquet", rows)
    memory.pipe("/bucket/data/labels.parquet", (root / "labels.parquet").read_bytes())
    assert index("/bucket/data", fs=memory).splits == index(root).splits
    assert index("/bucket/data", fs=memory, listing="labels.parquet").splits == index(root).splits


def test_datasets_check_lists_undecodable_images_and_rejected_rows(listed):
    root, rows = listed
    plant(root, rows[0]["path"], "garbage")
    plant(root, rows[9]["path"], "truncated")
    rows[1]["label"] = ""
    write_listing(root / "labels.csv", rows)
    out = check_dataset(FS, str(root), "csv", workers=2)
    assert out["bad_files"] == sorted([
        {"path": rows[0]["path"], "reason": "not an image"},
        {"path": rows[1]["path"], "reason": "empty label (labels.csv line 3)"},
        {"path": rows[9]["path"], "reason": "truncated"}], key=lambda b: b["path"])


def registry_with(tmp_path: Path, **entry) -> Path:
    return write_registry(tmp_path, [{"name": "tabled", "storage": {"driver": "FileSystem", "path": "."},
                                      **entry}])


def test_the_registry_takes_a_csv_table_for_layout_csv(tmp_path):
    got = load_registry(registry_with(tmp_path, layout="csv", csv={"listing": "{split}.parquet",
                                                                   "label_column": "class"})).get("tabled")
    assert got.csv == CsvListing(listing="{split}.parquet", label_column="class")
    assert load_registry(registry_with(tmp_path, layout="csv")).get("tabled").csv is None  # the defaults


@pytest.mark.parametrize(("entry", "message"), [
    ({"layout": "imagefolder", "csv": {}}, '[datasets.csv] is for layout = "csv" (this entry\'s layout: '
                                           'imagefolder); set layout = "csv" or remove the table'),
    ({"layout": "csv", "csv": {"label": "class"}}, "csv.label: unknown key"),
    ({"layout": "csv", "csv": {"listing": "../labels.csv"}}, "csv.listing: '../labels.csv' must name a file "
                                                             "under the data set's root (relative, no ..)"),
    ({"layout": "csv", "csv": {"label_column": "path"}}, "path_column, label_column and split_column must "
                                                         "differ (found ['path', 'path', 'split'])"),
    ({"layout": "imagefolder", "parquet": {"label_column": "fine_label"}},
     '[datasets.parquet] is for layout = "parquet" (this entry\'s layout: imagefolder); set layout = '
     '"parquet" or remove the table'),
    ({"layout": "parquet", "parquet": {"label": "fine_label"}}, "parquet.label: unknown key"),
    ({"layout": "parquet", "parquet": {"val_split": "train"}},
     'parquet.val_split: "train" is the train split; name the split to validate on, e.g. "test"'),
    ({"layout": "parquet", "unlabeled": "extra", "parquet": {"val_split": "extra"}},
     "[datasets.parquet] val_split 'extra' is this entry's unlabeled split too; name another split for one "
     "of them"),
])
def test_a_wrong_layout_table_is_exit_2_naming_the_entry_and_key(tmp_path, entry, message):
    """[datasets.csv], and [datasets.parquet] as its twin."""
    path = registry_with(tmp_path, **entry)
    with pytest.raises(ConfigError) as info:
        load_registry(path)
    assert str(info.value).startswith(f"{path}: datasets[0] ('tabled'): ")
    assert message in str(info.value) and info.value.exit_code == 2


def test_a_row_with_more_cells_than_the_header_is_a_data_error_not_a_shifted_row(listed):
    """An unquoted comma in a path: read as it stands, each cell would land in the wrong column."""
    root, _ = listed
    with (root / "labels.csv").open("a") as f:
        f.write("images/a,b.png,ant,train\n")
    with pytest.raises(DataError, match=rf"^{root}/labels.csv: not a CSV \(.*Expected 3 columns, got 4"):
        index(root)
