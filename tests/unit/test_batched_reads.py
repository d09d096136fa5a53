"""A batch's remote files read together (`FileReader.prefetch`, what `__getitems__` starts with): several
requests really in flight at once and never more than io_concurrency, each file once, errors handed to
the item they belong to, transient ones retried and counted; then items equal to one-by-one loading.
A remote root here is fsspec's in-memory filesystem (not local), instrumented; no S3 server."""

from __future__ import annotations

import threading

import fsspec
import pytest
import torch
from botocore.exceptions import ClientError
from fsspec.implementations.local import LocalFileSystem
from fsspec.implementations.memory import MemoryFileSystem
from synthetic import make_imagefolder, make_imagenet_loc, plant

from ddp_cli.config import AugmentConfig, DataConfig
from ddp_cli.data.fetch import retry
from ddp_cli.data.fetch.retry import IoPolicy
from ddp_cli.data.fetch.storage import FileReader
from ddp_cli.data.pipeline.augment import train_transform
from ddp_cli.data.pipeline.loaders import EpochItems, ImageDataset
from ddp_cli.data.sources.layouts import build_index, infer_layout
from ddp_cli.errors import DataError


class Remote(MemoryFileSystem):
    """In-memory, remote as far as ddp can tell, recording each read and how many were in flight; the
    first `together` reads wait for each other at a barrier (a serial reader would time out there)."""

    protocol = "remotetest"
    root_marker = "/"

    def __init__(self, together: int = 0, **kwargs: object) -> None:
        super().__init__(**kwargs)
        self.store, self.pseudo_dirs = {}, [""]  # not MemoryFileSystem's class-wide ones
        self.reads: list[str] = []
        self.options: list[dict] = []  # each read's keyword arguments
        self.threads: set[str] = set()  # the names of the threads that read
        self.in_flight = self.peak = 0
        self.lock = threading.Lock()
        self.barrier = threading.Barrier(together, timeout=10) if together else None
        self.fail_once: dict[str, BaseException] = {}
        self.throttled: list[str] = []

    def throttled_once(self, *names: str) -> None:
        """Each of these listing calls answers 503 SlowDown the first time, as S3 under load does."""
        for name in names:
            real = getattr(self, name)

            def once(*args: object, real=real, name=name, **kwargs: object):
                if name not in self.throttled:
                    self.throttled.append(name)
                    raise OSError(16, "Please reduce your request rate.") from slow_down()
                return real(*args, **kwargs)
            setattr(self, name, once)

    def cat_file(self, path: str, start: int | None = None, end: int | None = None, **kwargs: object):
        with self.lock:
            self.reads.append(path)
            self.options.append(kwargs)
            self.threads.add(threading.current_thread().name)
            self.in_flight += 1
            self.peak = max(self.peak, self.in_flight)
            first = len(self.reads) <= (self.barrier.parties if self.barrier else 0)
        try:
            if first:
                self.barrier.wait()
            if path in self.fail_once:
                raise self.fail_once.pop(path)
            return super().cat_file(path, start, end)
        finally:
            with self.lock:
                self.in_flight -= 1


def slow_down() -> ClientError:
    return ClientError({"Error": {"Code": "SlowDown", "Message": "reduce your request rate"},
                        "ResponseMetadata": {"HTTPStatusCode": 503}}, "GetObject")


def remote(files: dict[str, bytes], together: int = 0) -> Remote:
    fs = Remote(together, skip_instance_cache=True)
    for path, data in files.items():
        fs.pipe_file(f"/root/{path}", data)
    return fs


FILES = {f"f{i}.jpg": bytes([i]) * (100 + i) for i in range(12)}


def test_a_batch_is_read_with_several_requests_in_flight_each_file_once():
    fs = remote(FILES, together=2)
    reader = FileReader(fs, "/root", policy=IoPolicy(concurrency=4))
    batch = [*FILES, "f0.jpg", "f3.jpg"]  # repeated augmentation: an image twice in a batch
    reader.prefetch(batch)
    assert 2 <= fs.peak <= 4
    assert sorted(fs.reads) == sorted(f"/root/{p}" for p in FILES)  # once each
    assert [reader.read(p) for p in batch] == [FILES[p] for p in batch]
    assert len(fs.reads) == len(FILES)  # the reads took what was fetched
    assert all(o == {"max_concurrency": 1} for o in fs.options)  # s3fs: one GET, no HEAD for the size
    assert all(name.startswith("fetch_") for name in fs.threads)  # as stack dumps (py-spy) name them
    pool = reader._threads[1]
    reader.prefetch(["f0.jpg", "f1.jpg"])
    assert reader._threads[1] is pool and pool._max_workers == 4  # one pool of io_concurrency threads
    reader._threads = (-1, pool)  # as a forked loader process inherits it: its threads are not there
    reader.prefetch(["f0.jpg", "f1.jpg"])
    assert reader._threads[1] is not pool


@pytest.mark.parametrize(("concurrency", "paths", "fetched"), [
    (2, ["f0.jpg", "f1.jpg"], 2),  # the least that is read together
    (1, ["f0.jpg", "f1.jpg", "f2.jpg"], 0),  # one request at a time: read on demand
    (4, ["f0.jpg", "f0.jpg"], 0),  # one file, twice
])
def test_a_batch_is_read_together_from_two_files_and_two_requests_in_flight(concurrency, paths, fetched):
    fs = remote(FILES)
    reader = FileReader(fs, "/root/", policy=IoPolicy(concurrency=concurrency))
    reader.prefetch(paths)
    assert len(fs.reads) == fetched and reader.read("f0.jpg") == FILES["f0.jpg"]
    assert "/root/f0.jpg" in fs.reads and all(r.startswith("/root/f") for r in fs.reads)  # no "//"


def test_a_remote_refusal_is_a_data_error_naming_the_object_and_a_local_one_an_os_error(tmp_path):
    fs = remote(FILES)
    fs.fail_once["/root/f4.jpg"] = PermissionError(13, "Access Denied")
    with pytest.raises(DataError, match=r"^/root/f4\.jpg: access refused \(.*Access Denied\); check the AWS"):
        FileReader(fs, "/root").read("f4.jpg")

    class Refusing(LocalFileSystem):
        def cat_file(self, path, start=None, end=None, **kwargs):
            raise PermissionError(13, "Permission denied", path)

    with pytest.raises(PermissionError):  # a bad image, as a local root's other I/O errors
        FileReader(Refusing(skip_instance_cache=True), str(tmp_path)).read("f4.jpg")


def test_errors_reach_the_read_of_their_file_and_transient_ones_are_retried_and_counted(monkeypatch):
    monkeypatch.setattr(retry.time, "sleep", lambda s: None)
    retry.count_retries()
    before = retry.retries_so_far()
    fs = remote(FILES)
    fs.fail_once["/root/f2.jpg"] = slow_down()
    reader = FileReader(fs, "/root", policy=IoPolicy(retries=1, wait_s=0.01, concurrency=4))
    reader.prefetch(["f1.jpg", "f2.jpg", "gone.jpg"])
    assert reader.read("f2.jpg") == FILES["f2.jpg"] and retry.retries_so_far() - before == 1
    with pytest.raises(FileNotFoundError):  # a bad image, as when read alone
        reader.read("gone.jpg")
    fs.fail_once["/root/f1.jpg"] = slow_down()
    reader.policy = IoPolicy(retries=0, concurrency=4)
    reader.prefetch(["f1.jpg", "f3.jpg"])
    with pytest.raises(DataError, match=r"^/root/f1.jpg: the storage failed 1 times in a row"):
        reader.read("f1.jpg")


def test_local_roots_and_a_local_cache_are_read_as_before(tmp_path):
    (tmp_path / "data").mkdir()
    for name, data in FILES.items():
        (tmp_path / "data" / name).write_bytes(data)
    local = FileReader(fsspec.filesystem("file"), str(tmp_path / "data"))
    local.prefetch(list(FILES))
    assert local._threads is None and [local.read(p) for p in FILES] == list(FILES.values())
    fs = remote(FILES)
    FileReader(fs, "/root", tmp_path / "cache").prefetch(list(FILES))
    cached = FileReader(fs, "/root", tmp_path / "cache")
    cached.prefetch(list(FILES))
    assert [cached.read(p) for p in FILES] == list(FILES.values())
    assert len(fs.reads) == len(FILES)  # the second reader found every file in the cache


@pytest.fixture(scope="module")
def image_root(tmp_path_factory):
    """A small data set with a truncated training image, on the instrumented remote filesystem."""
    folder = tmp_path_factory.mktemp("images")
    make_imagenet_loc(folder, classes=3, train_per_class=4, val=2, size=24)
    plant(folder, "ILSVRC/Data/CLS-LOC/train/n00001001/n00001001_1.JPEG", "truncated")
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


@pytest.mark.parametrize("on_bad", ["skip", "error"])
def test_getitems_equals_getitem_bit_for_bit_with_seeded_augmentation(image_root, on_bad):
    fs = remote(image_root)
    split = build_index(fs, "/root", "imagenet-loc", on_bad_image="skip").splits["train"]
    transform = train_transform(DataConfig(image_size=16), AugmentConfig(policy="trivialaugment"))

    def items() -> EpochItems:
        dataset = ImageDataset(fs, "/root", split, transform, on_bad, 16, policy=IoPolicy(concurrency=4))
        return EpochItems(dataset, seed=5)

    batch = [(i, 2, 0) for i in range(len(split))] + [(0, 2, 1), (3, 2, 1)]  # copies under repeats
    one_by_one = [items()[item] for item in batch]
    reads = len(fs.reads)
    together = items().__getitems__(batch)
    assert len(fs.reads) - reads == len(split)  # each file once (a stand-in is in the batch too)
    for a, b in zip(together, one_by_one, strict=True):
        assert torch.equal(a[0], b[0]) and a[1:] == b[1:]
    assert not torch.equal(together[0][0], together[-2][0])  # copy 1 augmented unlike copy 0
    bad = [item for item in together if item[2] or item[3]]
    assert bad and all("n00001001_1.JPEG" in (item[2] or item[3]) for item in bad)


def test_index_building_retries_a_throttled_listing(tmp_path, monkeypatch):
    """Before training, the launcher lists the root: a 503 there is retried too (s3fs's own retries
    are off), not a failed run."""
    monkeypatch.setattr(retry.time, "sleep", lambda s: None)
    make_imagefolder(tmp_path, classes=2, per_class=2, size=8)
    fs = remote({str(p.relative_to(tmp_path)): p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()})
    fs.throttled_once("exists", "isdir", "ls", "find")
    assert infer_layout(fs, "/root") == "imagefolder"
    index = build_index(fs, "/root", "imagefolder")
    assert sorted(fs.throttled) == ["exists", "find", "isdir", "ls"]
    assert index.classes == ["class_0", "class_1"] and len(index.splits["train"]) == 4
