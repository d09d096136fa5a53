"""Reading images out of packed shards: exact bytes, a bounded node cache for remote shards, one
download per shard, bad members handled as bad files."""

from __future__ import annotations

import contextlib
import threading

import fsspec
import pytest
import torch
from synthetic import make_imagenet_loc, write_registry

from ddp_cli.data.fetch.shard_reader import ShardReader
from ddp_cli.data.pack.writer import PackOptions, Source, pack
from ddp_cli.data.pipeline.loaders import ImageDataset
from ddp_cli.data.pipeline.transforms import ValTransform
from ddp_cli.data.registry import load_registry
from ddp_cli.data.sources.layouts import build_index


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    """3 classes x 8 train images packed into ~8 small shards (local)."""
    folder = tmp_path_factory.mktemp("shards")
    make_imagenet_loc(folder / "src", classes=3, train_per_class=8, val=7)
    entry = load_registry(write_registry(folder, [{"name": "s", "layout": "imagenet-loc", "storage": {
        "driver": "FileSystem", "path": str(folder / "src")}}])).get("s")
    fs, root = entry.open()
    opts = PackOptions(splits=("train",), shard_mib=0.01)
    pack(Source(fs, root, "s", entry.layout, root), build_index(fs, root, entry.layout, splits=("train",)),
         str(folder / "out"), opts, 1)
    return folder / "out"


def remote_copy(packed) -> tuple[fsspec.AbstractFileSystem, str, list]:
    """The shards in fsspec's in-memory filesystem (a remote one: not local), counting downloads."""
    memory = fsspec.filesystem("memory", skip_instance_cache=True)
    for path in packed.iterdir():
        memory.pipe_file(f"/remote/{path.name}", path.read_bytes())
    downloads: list[str] = []
    real = memory.get_file

    def counted(remote, local, **kw):
        downloads.append(remote)
        return real(remote, local, **kw)

    memory.get_file = counted
    return memory, "/remote", downloads


def test_each_image_is_the_exact_member_bytes_locally_and_from_a_remote_copy(packed, tmp_path):
    local_fs = fsspec.filesystem("file")
    split = build_index(local_fs, str(packed), "shards", splits=("train",)).splits["train"]
    memory, root, _ = remote_copy(packed)
    local, remote = ShardReader(local_fs, str(packed)), ShardReader(memory, root, tmp_path / "cache")
    for row in range(len(split)):
        shard = split.paths[row].split("/")[0]
        offset, size = split.members[row]
        expected = (packed / shard).read_bytes()[offset:offset + size]
        assert local.read(split.paths[row], split.members[row]) == expected
        assert remote.read(split.paths[row], split.members[row]) == expected


def test_the_remote_cache_keeps_a_bounded_number_of_whole_shards(packed, tmp_path):
    memory, root, downloads = remote_copy(packed)
    split = build_index(memory, root, "shards", splits=("train",)).splits["train"]
    shards = sorted({p.split("/")[0] for p in split.paths})
    assert len(shards) >= 5
    reader = ShardReader(memory, root, tmp_path / "cache", keep=2)
    for row in range(len(split)):
        reader.read(split.paths[row], split.members[row])
        assert len(list((tmp_path / "cache").rglob("*.tar"))) <= 2
    assert sorted(d.rsplit("/", 1)[-1] for d in downloads) == shards  # rows grouped by shard: once each


def test_readers_on_one_node_wait_for_one_download_of_a_shard(packed, tmp_path):
    memory, root, downloads = remote_copy(packed)
    split = build_index(memory, root, "shards", splits=("train",)).splits["train"]
    readers = [ShardReader(memory, root, tmp_path / "cache") for _ in range(4)]
    out: list[bytes] = []
    threads = [threading.Thread(target=lambda r=r: out.append(r.read(split.paths[0], split.members[0])))
               for r in readers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert len(out) == 4 and len(set(out)) == 1 and len(downloads) == 1


def test_a_download_ahead_leaves_a_shard_another_process_is_downloading_and_takes_the_next(packed, tmp_path):
    """Every loader process asks for the same next shards: waiting in turn would fetch them one at a
    time, so a download ahead skips a locked shard (a read still waits for it)."""
    import fcntl
    import time

    memory, root, downloads = remote_copy(packed)
    split = build_index(memory, root, "shards", splits=("train",)).splits["train"]
    first, second, third = sorted({p.split("/")[0] for p in split.paths})[:3]
    reader = ShardReader(memory, root, tmp_path / "cache")
    reader.cache.mkdir(parents=True)
    with contextlib.ExitStack() as held:  # another process's downloads: as many as downloads ahead run
        for shard in (first, second):
            fcntl.flock(held.enter_context(open(reader.cache / f".{shard}.lock", "w")), fcntl.LOCK_EX)
        with pytest.raises(BlockingIOError):
            reader.fetch(first, wait=False)
        reader.download_ahead([first, second, third])
        deadline = time.monotonic() + 30
        while not (reader.cache / third).exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert [d.rsplit("/", 1)[-1] for d in downloads] == [third]
    assert reader.fetch(first).exists() and len(downloads) == 2  # the lock released: downloaded on read


def test_a_shard_downloaded_ahead_then_evicted_is_downloaded_ahead_again(packed, tmp_path):
    """A data set bigger than the cache (ImageNet, always) has its shards evicted before the next
    epoch asks for them ahead again: each time, a download in the background, not one on demand."""
    import time

    memory, root, downloads = remote_copy(packed)
    split = build_index(memory, root, "shards", splits=("train",)).splits["train"]
    shard = split.paths[0].split("/")[0]
    reader = ShardReader(memory, root, tmp_path / "cache")
    for epoch in (1, 2):
        deadline = time.monotonic() + 30
        while len(downloads) < epoch and time.monotonic() < deadline:
            reader.download_ahead([shard])  # every batch of the window before asks
            time.sleep(0.01)
        while not (reader.cache / shard).exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(downloads) == epoch, f"epoch {epoch}: not downloaded ahead once"
        (reader.cache / shard).unlink()  # evicted


def test_a_bad_member_is_a_bad_image_skipped_or_named(packed, tmp_path):
    damaged = tmp_path / "damaged"
    damaged.mkdir()
    for path in packed.iterdir():
        (damaged / path.name).write_bytes(path.read_bytes())
    fs = fsspec.filesystem("file")
    split = build_index(fs, str(damaged), "shards", splits=("train",)).splits["train"]
    shard, (offset, size) = split.paths[0].split("/")[0], split.members[0]
    data = bytearray((damaged / shard).read_bytes())
    data[offset:offset + size] = b"x" * size  # not an image any more; the tar is still whole
    (damaged / shard).write_bytes(bytes(data))
    skip = ImageDataset(fs, str(damaged), split, ValTransform(16, 16), "skip", 16)
    image, _, skipped, error = skip[0]
    assert skipped == f"{damaged}/{split.paths[0]}" and not error and image.shape == (16, 16, 3)
    stop = ImageDataset(fs, str(damaged), split, ValTransform(16, 16), "error", 16)
    _, _, _, error = stop[0]
    assert error.startswith(f"bad image {damaged}/{split.paths[0]}: not an image")
    assert torch.equal(stop[1][0], skip[1][0])  # the other images read as ever


def test_remote_shards_are_downloaded_ahead_and_on_into_the_next_epoch(packed, tmp_path):
    """Each training batch asks for the shards the sampler reads next, found here from the sampler's
    own order: the next window, but at least 4 shards (with windows of 2: the next two windows); near
    the epoch's end, on into the next epoch's (else every epoch began by waiting for its downloads)."""
    import numpy as np

    from ddp_cli.data.pipeline.sampler import shard_order

    memory, root, _ = remote_copy(packed)
    split = build_index(memory, root, "shards", splits=("train",)).splits["train"]
    dataset = ImageDataset(memory, root, split, ValTransform(8, 8), cache_dir=str(tmp_path), window=2)
    asked: list[set[str]] = []
    dataset.reader.download_ahead = lambda shards: asked.append(set(shards))
    starts = split.starts
    shard_of = {row: split.paths[row].split("/")[0] for row in range(len(split))}

    def windows(epoch: int) -> list[list[int]]:
        """The epoch's rows, window by window (2 shards' rows each), as the sampler reads them."""
        out, rows, shards = [], [], set()
        for row in shard_order(starts, 7, epoch, 2).tolist():
            rows.append(row)
            shards.add(int(np.searchsorted(starts, row, side="right") - 1))
            if len(shards) == 2 and len(rows) == sum(int(starts[j + 1] - starts[j]) for j in shards):
                out.append(rows)
                rows, shards = [], set()
        return out + [rows] if rows else out

    now, following = windows(0), windows(1)
    assert len(now) >= 3 and sum(map(len, now)) == len(split) and len(starts) % 2, "whole windows of 2"
    for w, rows in enumerate(now):
        asked.clear()
        dataset.read_ahead(rows[:3], seed=7, epoch=0)
        upcoming = (now + following)[w + 1] + (now + following)[w + 2]
        assert asked == [{shard_of[r] for r in upcoming}], f"window {w}"
