"""`ddp datasets pack`: shards that hold exactly the source's images, readable by webdataset, resumable."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import fsspec
import numpy as np
import pytest
import simplejpeg
import webdataset as wds
from PIL import Image
from synthetic import make_imagenet_loc, plant, write_registry

from ddp_cli.data.layouts import build_index
from ddp_cli.data.pack import Packer, PackOptions, Source, pack
from ddp_cli.data.shards import INDEX, read_index, read_samples
from ddp_cli.errors import ConfigError, DataError
from ddp_cli.registry import load_registry

TRAIN = "ILSVRC/Data/CLS-LOC/train/n00001001"
QUIRKS = {f"{TRAIN}/n00001001_0.JPEG": "cmyk", f"{TRAIN}/n00001001_1.JPEG": "gray",
          f"{TRAIN}/n00001001_2.JPEG": "png"}


@pytest.fixture
def source(tmp_path):
    """3 classes x 8 train (one CMYK, one grayscale, one PNG named .JPEG; one 90x60), 7 val."""
    root = tmp_path / "src"
    files = make_imagenet_loc(root, classes=3, train_per_class=8, val=7)
    for path, kind in QUIRKS.items():
        plant(root, path, kind, label=1)
    Image.new("RGB", (90, 60), (200, 10, 10)).save(root / files["train"][-1])
    registry = write_registry(tmp_path, [{"name": "src", "layout": "imagenet-loc",
                                          "storage": {"driver": "FileSystem", "path": str(root)}}])
    return load_registry(registry).get("src"), files


def run_pack(entry, to: Path, workers: int = 2, **options) -> dict:
    fs, root = entry.open()
    opts = PackOptions(**{"shard_mib": 0.02, **options})
    index = build_index(fs, root, entry.layout, splits=opts.splits, on_bad_image=opts.on_bad_image)
    return pack(Source(fs, root, entry.name, entry.layout, entry.storage.path), index, str(to), opts, workers)


def members(tar_path: Path) -> dict[str, bytes]:
    with tarfile.open(tar_path) as tar:
        return {m.name: tar.extractfile(m).read() for m in tar}


def test_every_source_image_is_in_one_shard_as_an_rgb_jpeg_at_the_offset_the_index_gives(source, tmp_path):
    entry, files = source
    out = run_pack(entry, tmp_path / "packed", max_side=64)
    assert out["splits"]["train"]["images"] == 24 and out["splits"]["val"]["images"] == 7
    assert out["splits"]["train"]["shards"] > 1  # 0.02 MiB shards: the size limit splits them
    fs = fsspec.filesystem("file")
    meta = read_index(fs, str(tmp_path / "packed"))
    source_labels = {p: int(lbl) for p, lbl in zip(*(lambda s: (list(s.paths), s.labels))(
        build_index(*entry.open(), entry.layout).splits["train"]), strict=True)}
    samples = read_samples(fs, str(tmp_path / "packed"), "train")
    assert sorted(samples.path) == sorted(files["train"])  # every image once
    for i in range(len(samples)):
        shard = tmp_path / "packed" / meta.splits["train"].shards[samples.shard[i]].name
        assert shard.stat().st_size <= 0.02 * 2**20 + 10240  # the limit, plus the tar's end record
        data = shard.read_bytes()[samples.offset[i]:samples.offset[i] + samples.size[i]]
        assert data == members(shard)[samples.member[i]]
        assert simplejpeg.decode_jpeg_header(data)[2] == "YCbCr"  # an RGB JPEG, quirks included
        assert max(simplejpeg.decode_jpeg_header(data)[:2]) <= 64
        assert samples.label[i] == source_labels[samples.path[i]]
    assert meta.max_side == 64 and meta.synsets == [f"n{1000 + c:08d}" for c in range(3)]
    assert meta.source["reencoded"]["train"] == len(QUIRKS) + 1  # and the one above --max-side
    big = list(samples.path).index(files["train"][-1])
    shard = tmp_path / "packed" / meta.splits["train"].shards[samples.shard[big]].name
    data = shard.read_bytes()[samples.offset[big]:samples.offset[big] + samples.size[big]]
    assert simplejpeg.decode_jpeg_header(data)[:2] == (43, 64)  # 90 x 60 shrunk, aspect kept


def test_plain_jpegs_are_copied_byte_for_byte_and_quirks_reencoded(source, tmp_path):
    entry, files = source
    run_pack(entry, tmp_path / "packed", splits=("train",))
    samples = read_samples(fsspec.filesystem("file"), str(tmp_path / "packed"), "train")
    meta = read_index(fsspec.filesystem("file"), str(tmp_path / "packed"))
    for i in range(len(samples)):
        name = meta.splits["train"].shards[samples.shard[i]].name
        data = (tmp_path / "packed" / name).read_bytes()[samples.offset[i]:][:samples.size[i]]
        original = (Path(entry.storage.path) / samples.path[i]).read_bytes()
        assert (data == original) == (samples.path[i] not in QUIRKS)
    assert meta.source["reencoded"]["train"] == len(QUIRKS)


def test_webdataset_reads_ddp_shards(source, tmp_path):
    entry, _ = source
    run_pack(entry, tmp_path / "packed", splits=("val",))
    shards = sorted(str(p) for p in (tmp_path / "packed").glob("val-*.tar"))
    seen = list(wds.WebDataset(shards, shardshuffle=False).decode("pil"))
    val = build_index(*entry.open(), entry.layout).splits["val"]
    assert [s["__key__"] for s in seen] == [f"val_{i:08d}" for i in range(7)]  # val keeps its order
    assert [s["cls"] for s in seen] == [int(v) for v in val.labels]
    assert [s["json"]["path"] for s in seen] == list(val.paths)
    assert all(s["jpg"].mode == "RGB" and s["jpg"].size == (40, 40) for s in seen)


def test_workers_do_not_change_a_byte(source, tmp_path):
    entry, _ = source
    run_pack(entry, tmp_path / "one", workers=1)
    run_pack(entry, tmp_path / "three", workers=3)
    tars = sorted(p.name for p in (tmp_path / "one").glob("*.tar"))
    assert tars == sorted(p.name for p in (tmp_path / "three").glob("*.tar"))
    for name in [*tars, INDEX, "train-samples.npz"]:
        assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "three" / name).read_bytes(), name


def test_a_bad_image_stops_the_pack_naming_it_or_is_skipped_and_listed(source, tmp_path):
    entry, files = source
    bad = files["train"][5]
    plant(Path(entry.storage.path), bad, "truncated")
    with pytest.raises(DataError, match=f"bad image .*{bad}: truncated .*--on-bad-image skip"):
        run_pack(entry, tmp_path / "stopped")
    assert not (tmp_path / "stopped" / INDEX).exists()
    out = run_pack(entry, tmp_path / "skipped", on_bad_image="skip")
    assert out["splits"]["train"] == {**out["splits"]["train"], "images": 23, "skipped": 1}
    meta = read_index(fsspec.filesystem("file"), str(tmp_path / "skipped"))
    assert meta.splits["train"].skipped == [{"path": bad, "reason": "truncated"}]


def test_a_killed_pack_resumes_without_rewriting_its_shards_and_ends_identical(source, tmp_path, monkeypatch):
    entry, _ = source
    run_pack(entry, tmp_path / "whole")
    closed = []
    real = Packer.close_shard

    def dies_after_two(self, *args):
        if len(closed) == 2:
            raise KeyboardInterrupt  # as a kill would, between two shards
        real(self, *args)
        closed.append(args[0].name)

    monkeypatch.setattr(Packer, "close_shard", dies_after_two)
    with pytest.raises(KeyboardInterrupt):
        run_pack(entry, tmp_path / "resumed")
    assert not (tmp_path / "resumed" / INDEX).exists()
    first = {name: (tmp_path / "resumed" / name).stat() for name in closed}
    monkeypatch.setattr(Packer, "close_shard", real)
    with pytest.raises(ConfigError, match="other options"):
        run_pack(entry, tmp_path / "resumed", quality=80)
    run_pack(entry, tmp_path / "resumed")
    for name, stat in first.items():  # the shards done before the kill were not written again
        assert (tmp_path / "resumed" / name).stat().st_ino == stat.st_ino
    whole = sorted(p.name for p in (tmp_path / "whole").iterdir())
    assert sorted(p.name for p in (tmp_path / "resumed").iterdir()) == whole  # no .pack left behind
    for name in whole:
        assert (tmp_path / "resumed" / name).read_bytes() == (tmp_path / "whole" / name).read_bytes(), name
    with pytest.raises(ConfigError, match="a finished pack is already there"):
        run_pack(entry, tmp_path / "resumed")


def test_packed_splits_index_with_class_subsets_and_shard_starts(source, tmp_path):
    entry, _ = source
    run_pack(entry, tmp_path / "packed")
    table = build_index(fsspec.filesystem("file"), str(tmp_path / "packed"), "shards", classes=["n00001002"])
    train = table.splits["train"]
    assert table.classes == ["n00001002"] and len(train) == 8 and set(train.labels.tolist()) == {0}
    assert train.starts[0] == 0 and train.starts[-1] == 8 and np.all(np.diff(train.starts) >= 0)
    shard_of_row = np.searchsorted(train.starts, np.arange(8), side="right") - 1
    assert [p.split("/")[0] for p in train.paths] == [f"train-{j:06d}.tar" for j in shard_of_row]
    data = (tmp_path / "packed" / train.paths[0].split("/")[0]).read_bytes()
    offset, size = train.members[0]
    assert Image.open(io.BytesIO(data[offset:offset + size])).size == (40, 40)
