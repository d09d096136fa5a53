"""Listed names that would leave their folder or the data set root: refused by file and value under
"error", bad files under "skip", and never read (the reader itself refuses them too)."""

from __future__ import annotations

from pathlib import Path

import fsspec
import pytest
from fsspec.implementations.memory import MemoryFileSystem
from synthetic import append_line, encoded, image, make_imagenet_loc

from ddp_cli.data.fetch.storage import UNSAFE_PATH, FileReader, UnsafePath, cache_folder
from ddp_cli.data.pipeline.check import check_dataset
from ddp_cli.data.sources.imagenet_loc import LOC_TRAIN_LIST
from ddp_cli.data.sources.layouts import build_index
from ddp_cli.errors import DataError

FS = fsspec.filesystem("file")
# where a name is listed -> (file under the root, what the message calls the value, the row for a name)
SOURCES = {
    "val": ("LOC_val_solution.csv", "ImageId", lambda name: f"{name},n00001000 1 1 5 5"),
    "train": (LOC_TRAIN_LIST, "path", lambda name: f"{name} 99"),
}
UNSAFE = ["../../../../secret",  # the root itself: out of the split folder
          "../../../../../secret",  # the root's parent
          "/etc/passwd",
          "n00001000/../../../../../../secret"]


@pytest.fixture
def root(tmp_path) -> Path:
    """A data set whose every escape target is a good image: read, it would pass as one."""
    make_imagenet_loc(tmp_path / "root", classes=3, train_per_class=2, val=3)
    for secret in (tmp_path / "secret.JPEG", tmp_path / "root" / "secret.JPEG"):
        secret.write_bytes(encoded(image(1, 0)))
    return tmp_path / "root"


@pytest.mark.parametrize("name", UNSAFE)
@pytest.mark.parametrize("source", SOURCES)
def test_unsafe_row_is_a_data_error_naming_file_and_value_under_error(root, source, name):
    file, what, row = SOURCES[source]
    append_line(root / file, row(name))
    with pytest.raises(DataError) as info:
        build_index(FS, str(root), "imagenet-loc", on_bad_image="error")
    assert str(info.value).startswith(f"{root}/{file}: {what} {name!r}: {UNSAFE_PATH}, never read (1 such")
    assert 'data.on_bad_image = "skip"' in str(info.value) and info.value.exit_code == 3


@pytest.mark.parametrize("name", UNSAFE)
@pytest.mark.parametrize("source", SOURCES)
def test_unsafe_row_is_a_bad_file_never_read_under_skip(root, source, name):
    file, what, row = SOURCES[source]
    append_line(root / file, row(name))
    index = build_index(FS, str(root), "imagenet-loc")
    assert index.unsafe == [f"{file}: {what} {name!r}"]
    out = check_dataset(FS, str(root), "imagenet-loc", workers=2)
    assert [b["reason"] for b in out["bad_files"]] == [UNSAFE_PATH]  # a read secret would pass as an image
    assert name in out["bad_files"][0]["path"]


def test_a_name_whose_dots_stay_inside_its_folder_is_normalised_not_refused(root):
    append_line(root / LOC_TRAIN_LIST, "n00001001/extra/../n00001001_0 99")
    index = build_index(FS, str(root), "imagenet-loc", on_bad_image="error")
    assert index.unsafe == []
    paths = list(index.splits["train"].paths)
    assert paths.count("ILSVRC/Data/CLS-LOC/train/n00001001/n00001001_0.JPEG") == 2


def memory_root(tmp_path: Path) -> tuple[fsspec.AbstractFileSystem, str]:
    """A remote-like root (not the local filesystem, as S3 is not) with a secret beside it."""
    fs = fsspec.filesystem("memory")
    fs.pipe("bucket/secret.JPEG", encoded(image(1, 0)))
    fs.pipe("bucket/data/ILSVRC/x.JPEG", encoded(image(2, 0)))
    return fs, "bucket/data"  # as s3_filesystem gives it: bucket/prefix


@pytest.mark.parametrize("path", ["../secret.JPEG", "ILSVRC/../../secret.JPEG", "/bucket/secret.JPEG",
                                  "ILSVRC/./../../secret.JPEG"])
@pytest.mark.parametrize("where", ["local", "remote"])
def test_file_reader_refuses_a_path_that_could_leave_the_root(tmp_path, where, path):
    if where == "local":
        (tmp_path / "secret.JPEG").write_bytes(b"secret")
        (tmp_path / "data" / "ILSVRC").mkdir(parents=True)
        fs, root = FS, str(tmp_path / "data")
    else:
        fs, root = memory_root(tmp_path)
    reader = FileReader(fs, root, cache_dir=tmp_path / "cache")
    with pytest.raises(UnsafePath, match=r"^unsafe path \(absolute, or \.\. out of its folder\)$"):
        reader.read(path)
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").rglob("*.JPEG"))


def test_file_reader_reads_a_remote_path_inside_the_root_and_caches_it(tmp_path):
    fs, root = memory_root(tmp_path)
    reader = FileReader(fs, root, cache_dir=tmp_path / "cache")
    assert reader.read("ILSVRC/x.JPEG") == encoded(image(2, 0))
    assert [p.name for p in (tmp_path / "cache").rglob("*.JPEG")] == ["x.JPEG"]


class FakeS3(MemoryFileSystem):
    """In memory, named as s3fs names itself."""

    protocol = ("s3", "s3a")


def test_the_cache_folder_is_the_endpoint_or_protocol_then_bucket_and_prefix(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("CACHES", str(tmp_path / "caches"))
    minio = FakeS3(skip_instance_cache=True, client_kwargs={"endpoint_url": "http://127.0.0.1:9000"})
    expected = tmp_path / "caches/ddp/127.0.0.1_9000/bucket/prefix"
    assert cache_folder(minio, "bucket/prefix", "$CACHES/ddp") == expected
    aws = FakeS3(skip_instance_cache=True, client_kwargs={"region_name": "eu-west-1"})
    assert cache_folder(aws, "/bucket", "~/cache") == tmp_path / "home/cache/s3/bucket"
    assert cache_folder(FakeS3(skip_instance_cache=True), "bucket", tmp_path) == tmp_path / "s3/bucket"
    assert cache_folder(aws, "bucket", None) is None and cache_folder(aws, "bucket", "") is None
    assert cache_folder(FS, str(tmp_path), tmp_path / "cache") is None  # local roots are read in place
    assert cache_folder(MemoryFileSystem(skip_instance_cache=True), "b", tmp_path) == tmp_path / "memory/b"
    assert FileReader(aws, "bucket/dataX/", tmp_path).cache == tmp_path / "s3/bucket/dataX"


def test_a_forked_reader_opens_a_filesystem_of_its_own_once():
    fs = FakeS3(skip_instance_cache=True)
    reader = FileReader(fs, "bucket")
    assert reader.fs is fs and reader.fs is fs
    reader._pid = -1  # as a forked DataLoader worker finds it
    own = reader.fs
    assert own is not fs and type(own) is FakeS3 and reader.fs is own
