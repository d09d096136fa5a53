"""Packed index rows: exact round trips, and nothing per row that a forked reader would copy."""

from __future__ import annotations

import gc
import pickle

import fsspec
import numpy as np
import pytest
from torch.utils.data import Dataset

from ddp_cli.data.pipeline.loaders import ImageDataset, make_loader
from ddp_cli.data.pipeline.sampler import ShardSampler
from ddp_cli.data.pipeline.transforms import ValTransform
from ddp_cli.data.sources.packed import PackedStrings, Split
from ddp_cli.data.sources.table import IndexTable

NAMES = ["train/n01/a.JPEG", "", "val/ünïcødé/ß.jpg", "日本/画像.png", "odd\udcff", "x" * 300]


def test_packed_strings_round_trip_every_string():
    packed = PackedStrings.pack(NAMES)
    assert len(packed) == len(NAMES)
    assert list(packed) == NAMES
    assert [packed[i] for i in range(-len(NAMES), 0)] == NAMES
    assert packed.data.dtype == np.uint8 and packed.offsets.dtype == np.int64


def test_packed_strings_refuse_an_index_out_of_range():
    packed = PackedStrings.pack(["a", "b"])
    for index in (2, -3):
        with pytest.raises(IndexError, match="out of range for 2 strings"):
            packed[index]


def test_empty_packed_strings():
    assert list(PackedStrings.pack([])) == []
    assert list(PackedStrings.pack(["", ""])) == ["", ""]
    assert PackedStrings.pack([]) == PackedStrings.pack(iter([]))


def test_packed_strings_pickle_as_two_buffers_not_one_object_per_row():
    names = [f"ILSVRC/Data/CLS-LOC/train/n{i % 1000:08d}/n{i:08d}.JPEG" for i in range(20_000)]
    packed = PackedStrings.pack(names)
    pickled = pickle.dumps(packed, protocol=pickle.HIGHEST_PROTOCOL)
    copy = pickle.loads(pickled)
    assert copy == packed and list(copy) == names
    assert vars(copy).keys() == {"data", "offsets"}  # two arrays come back, not 20,000 objects
    assert len(pickled) < packed.data.nbytes + packed.offsets.nbytes + 1000


def test_split_labels_take_the_smallest_int_dtype_that_fits():
    assert Split.of(["a", "b"], [0, 255]).labels.dtype == np.uint8
    assert Split.of(["a", "b"], [0, 999]).labels.dtype == np.uint16
    assert Split.of(["a"], [70_000]).labels.dtype == np.uint32
    assert Split.of([], []).labels.dtype == np.uint8


def test_split_equality_is_same_rows_in_the_same_order():
    split = Split.of(["a", "b"], [0, 1])
    assert split == Split(PackedStrings.pack(["a", "b"]), np.array([0, 1], dtype=np.int64))
    assert split != Split.of(["b", "a"], [1, 0])
    assert split != Split.of(["a", "b"], [0, 2])


def test_joined_splits_are_one_then_the_other_each_shard_s_rows_still_together():
    files = Split.of(["a.png", "b.png"], [0, 2]).joined(Split.of(["ü/c.png"], [-1]))
    assert files == Split.of(["a.png", "b.png", "ü/c.png"], [0, 2, -1])
    first = Split.of(["s0/a", "s0/b", "s1/c"], [1, 0, 1], [[0, 5], [5, 5], [0, 7]], [0, 2, 3])
    second = Split.of(["u0/d", "u1/e", "u1/f"], [-1, -1, -1], [[0, 9], [0, 3], [3, 4]], [0, 1, 3])
    joined = first.joined(second)
    assert list(joined.paths) == [*first.paths, *second.paths]
    assert joined.labels.tolist() == [1, 0, 1, -1, -1, -1]
    assert joined.members.tolist() == [[0, 5], [5, 5], [0, 7], [0, 9], [0, 3], [3, 4]]
    assert joined.starts.tolist() == [0, 2, 3, 4, 6] and joined.container == first.container
    parquet = Split.of(["f#0"], [0], [[0, 0]], [0, 1], container="parquet")
    for other in (Split.of(["x"], [0]), parquet):
        with pytest.raises(ValueError, match="one layout"):
            first.joined(other)


def test_index_table_save_load_keeps_paths_labels_and_classes(tmp_path):
    index = IndexTable(["n2", "n0"], ["två, 2", "zero"], {
        "train": Split.of(NAMES, [i % 2 for i in range(len(NAMES))]),
        "val": Split.of([], []),
    })
    index.save(tmp_path / "index")
    loaded = IndexTable.load(tmp_path / "index")
    assert (loaded.classes, loaded.descriptions) == (index.classes, index.descriptions)
    assert loaded.splits == index.splits
    assert list(loaded.splits["train"].paths) == NAMES
    assert loaded.counts() == {"train": {"images": 6, "classes": 2}, "val": {"images": 0, "classes": 0}}


def test_image_dataset_holds_the_packed_rows_not_python_lists(tmp_path):
    index = IndexTable(["n0"], ["zero"], {"train": Split.of(["a.JPEG", "b.JPEG"], [0, 0])})
    index.save(tmp_path / "index")
    split = IndexTable.load(tmp_path / "index").splits["train"]
    dataset = ImageDataset(fsspec.filesystem("file"), str(tmp_path), split, ValTransform(8, 10))
    assert not [name for name, value in vars(dataset).items() if isinstance(value, list | tuple | dict)]
    assert dataset.paths is split.paths and dataset.labels is split.labels
    assert len(dataset) == 2


class FreezeCount(Dataset):
    def __len__(self) -> int:
        return 2

    def __getitem__(self, index: int) -> tuple[int, int, str, str]:
        return gc.get_freeze_count(), 0, "", ""  # ImageDataset's (image, label, skipped, error)


@pytest.mark.processes
def test_loader_processes_keep_the_objects_they_inherit_out_of_the_gc():
    """A collection in a loader process would write to, and so copy, every page of the rank's objects."""
    sampler = ShardSampler(2, 0, 1, shuffle=False)
    loader = make_loader(FreezeCount(), sampler, 2, 1, 2, pin_memory=False, drop_last=False, seed=0)
    (batch,) = list(loader)
    assert batch.images.min() > 1000
