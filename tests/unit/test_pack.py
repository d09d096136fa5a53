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
from synthetic import append_line, make_imagenet_loc, plant, write_registry

from ddp_cli.data.pack.writer import Packer, PackOptions, Source, pack, pack_index
from ddp_cli.data.registry import load_registry
from ddp_cli.data.sources.layouts import build_index
from ddp_cli.data.sources.shards import INDEX, read_index, read_samples
from ddp_cli.errors import ConfigError, DataError

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
    index = pack_index(fs, root, entry.layout, opts.splits, opts.on_bad_image)
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
        assert shard.stat().st_size <= 0.02 * 2**20  # the limit, the tar's end record and padding included
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
    assert read_index(fsspec.filesystem("file"), str(tmp_path / "packed")).quality is None  # all copied


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

    def dies_after_two(self, split, writer, *args):
        if len(closed) == 2:
            raise KeyboardInterrupt  # as a kill would, between two shards
        real(self, split, writer, *args)
        closed.append(writer.name)

    monkeypatch.setattr(Packer, "close_shard", dies_after_two)
    with pytest.raises(KeyboardInterrupt):
        run_pack(entry, tmp_path / "resumed")
    assert not (tmp_path / "resumed" / INDEX).exists()
    first = {name: (tmp_path / "resumed" / name).stat() for name in closed}
    monkeypatch.setattr(Packer, "close_shard", real)
    stale = tmp_path / "resumed" / ".pack" / ".train-000002.tar.99999.tmp"  # as a SIGKILL leaves it
    stale.write_bytes(b"half a shard")
    with pytest.raises(ConfigError, match="other options"):
        run_pack(entry, tmp_path / "resumed", quality=80)
    assert not stale.exists()  # a dead run's scratch file is removed by the next
    listing = Path(entry.storage.path) / "ILSVRC/ImageSets/CLS-LOC/train_cls.txt"
    lines = listing.read_text()
    listing.write_text(lines.replace("n00001000_7 ", "n00001000_9 "))  # as many images, one another
    with pytest.raises(ConfigError, match="other options or another source"):
        run_pack(entry, tmp_path / "resumed")
    listing.write_text(lines)
    run_pack(entry, tmp_path / "resumed")
    for name, stat in first.items():  # the shards done before the kill were not written again
        now = (tmp_path / "resumed" / name).stat()
        assert (now.st_ino, now.st_mtime_ns) == (stat.st_ino, stat.st_mtime_ns)
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


def test_shards_close_before_the_image_that_would_take_them_over_the_limit(source, tmp_path):
    """Exactly: every shard but the last would have passed --shard-size with the next image's members."""
    entry, _ = source
    limit = 25_000  # tar pads to 10 KiB records: shards that would end in (20480, 25000] must close earlier
    run_pack(entry, tmp_path / "packed", splits=("train",), shard_mib=limit / 2**20)
    fs = fsspec.filesystem("file")
    shards = read_index(fs, str(tmp_path / "packed")).splits["train"].shards
    samples = read_samples(fs, str(tmp_path / "packed"), "train")
    sizes = [(tmp_path / "packed" / s.name).stat().st_size for s in shards]
    assert sizes == [s.bytes for s in shards] and max(sizes) <= limit
    for j, shard in enumerate(shards[:-1]):
        nxt = (tmp_path / "packed" / shards[j + 1].name).read_bytes()
        first = samples.starts(len(shards))[j + 1]  # the image that opened the next shard
        members = sum(512 + -(-len(data) // 512) * 512 for data in members_of(nxt, str(samples.key[first])))
        with tarfile.open(tmp_path / "packed" / shard.name) as tar:
            last = tar.getmembers()[-1]
            end = last.offset_data + -(-last.size // 512) * 512  # where the members end
        assert -(-(end + members + 1024) // 10240) * 10240 > limit


def members_of(tar_bytes: bytes, key: str) -> list[bytes]:
    with tarfile.open(fileobj=io.BytesIO(tar_bytes)) as tar:
        return [tar.extractfile(m).read() for m in tar if m.name.split(".")[0] == key]


def test_rows_the_index_left_out_stop_the_pack_or_are_listed_in_their_split(source, tmp_path):
    entry, _ = source
    csv = Path(entry.storage.path) / "LOC_val_solution.csv"
    append_line(csv, "ILSVRC2012_val_00000099,n09999999 1 1 5 5")  # a synset the mapping does not name
    missing = "ILSVRC/Data/CLS-LOC/val/ILSVRC2012_val_00000099.JPEG"
    with pytest.raises(DataError, match=f"{missing}: unknown synset .*--on-bad-image skip"):
        run_pack(entry, tmp_path / "stopped")
    assert not (tmp_path / "stopped").exists()  # stopped before anything was written
    out = run_pack(entry, tmp_path / "skipped", on_bad_image="skip")
    assert out["splits"]["val"]["skipped"] == 1 and out["splits"]["train"]["skipped"] == 0
    meta = read_index(fsspec.filesystem("file"), str(tmp_path / "skipped"))
    assert meta.splits["val"].skipped == [{"path": missing, "reason": "unknown synset"}]


def test_a_pack_stopped_by_a_bad_image_goes_on_with_skip_but_not_the_other_way(source, tmp_path):
    entry, files = source
    order = [files["train"][i] for i in np.random.default_rng(0).permutation(24)]  # pack_order of train
    bad = order[12]  # after a few shards closed
    plant(Path(entry.storage.path), bad, "truncated")
    with pytest.raises(DataError, match=bad):
        run_pack(entry, tmp_path / "out")
    done = sorted(p.name for p in (tmp_path / "out").glob("*.tar"))
    assert done and not list((tmp_path / "out").rglob("*.tmp"))  # finished shards only, no scratch left
    out = run_pack(entry, tmp_path / "out", on_bad_image="skip")
    assert out["splits"]["train"]["skipped"] == 1
    whole = run_pack(entry, tmp_path / "whole", on_bad_image="skip")
    assert out["splits"] == whole["splits"]
    for path in (tmp_path / "whole").iterdir():
        assert (tmp_path / "out" / path.name).read_bytes() == path.read_bytes(), path.name
    plant(Path(entry.storage.path), order[20], "truncated")
    closed = []
    real = Packer.close_shard

    def dies_after_three(self, *args):
        if len(closed) == 3:
            raise KeyboardInterrupt
        real(self, *args)
        closed.append(1)

    Packer.close_shard = dies_after_three
    try:
        with pytest.raises(KeyboardInterrupt):
            run_pack(entry, tmp_path / "again", on_bad_image="skip")
    finally:
        Packer.close_shard = real
    with pytest.raises(ConfigError, match="skipped 1 bad image.*--on-bad-image skip"):
        run_pack(entry, tmp_path / "again")
