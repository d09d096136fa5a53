"""CheckpointStore: keep_last prunes the oldest step files only; last.pt is the newest save, best.pt
the one saved as best (kept even after its step file is pruned)."""

from __future__ import annotations

import hashlib
import json
import os

import pytest
import torch

from ddp_cli.errors import DataError
from ddp_cli.train import checkpoint
from ddp_cli.train.checkpoint import (
    CheckpointStore,
    load_checkpoint,
    manifest_path,
    read_manifest,
    tensor_bytes,
    verify,
    write_manifest,
)

TOP1 = [0.5, 0.9, 0.7, 0.6, 0.8, 0.85]  # best at step 2, never beaten; last at step 6


def save_all(store: CheckpointStore, top1s=TOP1) -> None:
    best_so_far = -1.0
    for step, top1 in enumerate(top1s, start=1):
        best = top1 > best_so_far  # what the trainer decides: a strictly higher val top-1
        best_so_far = max(best_so_far, top1)
        state = {"model": {"w": torch.full((3,), float(step))}, "step": step, "top1": top1}
        store.save(state, {"epoch": step, "step": step, "step_in_epoch": 0, "top1": top1}, best)


def step_of(path) -> int:
    state = load_checkpoint(path)  # verifies the manifest's sha256 too
    assert torch.equal(state["model"]["w"], torch.full((3,), float(state["step"])))
    return state["step"]


@pytest.mark.parametrize("keep_last", [1, 2, 3])
def test_only_the_newest_step_files_remain_and_aliases_survive_pruning(tmp_path, keep_last):
    store = CheckpointStore(tmp_path, keep_last)
    save_all(store)
    steps = list(range(len(TOP1) - keep_last + 1, len(TOP1) + 1))
    assert [p.name for p in store.steps()] == [f"step-{s:09d}.pt" for s in steps]
    expected = {f"step-{s:09d}.pt" for s in steps} | {"last.pt", "best.pt"}
    assert {p.name for p in tmp_path.glob("*.pt")} == expected
    assert {p.name for p in tmp_path.glob("*.json")} == {f"{name}.json" for name in expected}
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")], "temp files left behind"
    for path in tmp_path.glob("*.pt"):
        assert verify(path) is None, path
    assert step_of(tmp_path / "last.pt") == len(TOP1)
    assert step_of(tmp_path / "best.pt") == 2  # the highest top-1, though its step file is long gone
    assert json.loads((tmp_path / "best.pt.json").read_text())["step"] == 2
    assert step_of(store.latest_valid()) == len(TOP1)


def test_best_moves_only_when_a_save_is_marked_best(tmp_path):
    store = CheckpointStore(tmp_path, 2)
    save_all(store, [0.3, 0.2, 0.4, 0.4, 0.1])  # an equal top-1 is not better: best stays at step 3
    assert step_of(tmp_path / "best.pt") == 3
    assert step_of(tmp_path / "last.pt") == 5
    assert [p.name for p in store.steps()] == ["step-000000004.pt", "step-000000005.pt"]


def flip_a_byte(path) -> None:
    """Alter the file in place, its size unchanged: what only the sha256 comparison can see."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_checkpoint_altered_in_place_is_refused_by_its_sha256(tmp_path):
    store = CheckpointStore(tmp_path, 1)
    path = store.save({"model": {"w": torch.zeros(4096)}}, {"epoch": 1, "step": 1}, best=False)
    size = path.stat().st_size
    flip_a_byte(path)
    assert path.stat().st_size == size == json.loads((tmp_path / f"{path.name}.json").read_text())["bytes"]
    assert verify(path) == "sha256 differs from its manifest (corrupt)"
    with pytest.raises(DataError, match=r"sha256 differs from its manifest .*--resume auto picks a valid"):
        load_checkpoint(path)


def test_latest_valid_skips_torn_altered_and_unmanifested_checkpoints_newest_first(tmp_path, caplog):
    """Each damage in turn hits the newest checkpoint left; the store falls back one step each time
    (last.pt is a hard link to the newest step file, so it is damaged with it)."""
    store = CheckpointStore(tmp_path, 4)
    save_all(store, [0.1, 0.2, 0.3, 0.4])
    newest = store.path_for(4)
    newest.write_bytes(newest.read_bytes()[:-100])  # torn: a write cut short
    assert step_of(store.latest_valid()) == 3
    assert f"skipping checkpoint {newest}: size differs from its manifest (truncated?)" in caplog.messages
    flip_a_byte(store.path_for(3))
    assert step_of(store.latest_valid()) == 2
    (tmp_path / "step-000000002.pt.json").unlink()  # killed between the file and its manifest
    assert verify(store.path_for(2)) == "no manifest (partial write?)"
    assert store.latest_valid() == store.path_for(1)
    flip_a_byte(store.path_for(1))
    assert store.latest_valid() is None


def test_latest_valid_takes_last_pt_when_the_newest_step_file_is_gone(tmp_path):
    """last.pt is a candidate of its own, ordered by its manifest's step: a run dir whose newest step
    file was deleted (or not copied) resumes from last.pt, not from the older step file left."""
    store = CheckpointStore(tmp_path, 3)
    save_all(store, [0.1, 0.2, 0.3])
    store.path_for(3).unlink()
    (tmp_path / "step-000000003.pt.json").unlink()
    assert store.latest_valid() == tmp_path / "last.pt"
    assert step_of(store.latest_valid()) == 3


def test_a_save_hashes_on_the_way_out_and_reads_no_file_back(tmp_path, monkeypatch):
    def read_back(path):
        raise AssertionError(f"{path} read back to hash it")

    monkeypatch.setattr(checkpoint, "sha256_of", read_back)
    save_all(CheckpointStore(tmp_path, 2), [0.1, 0.2])
    monkeypatch.undo()
    for path in tmp_path.glob("*.pt"):
        assert verify(path) is None, path


def test_a_manifest_written_without_the_writes_hash_reads_the_file(tmp_path):
    path = tmp_path / "model.pt"
    path.write_bytes(b"weights")
    write_manifest(path, {"epoch": 3, "step": 12})
    assert json.loads((tmp_path / "model.pt.json").read_text()) == {
        "file": "model.pt", "sha256": hashlib.sha256(b"weights").hexdigest(), "bytes": 7,
        "epoch": 3, "step": 12}


def test_where_hard_links_fail_last_and_best_are_copies(tmp_path, monkeypatch):
    def unsupported(source, target):
        raise OSError(95, "Operation not supported")

    monkeypatch.setattr(os, "link", unsupported)
    store = CheckpointStore(tmp_path, 1)
    save_all(store, [0.2, 0.1])
    assert step_of(tmp_path / "last.pt") == 2 and step_of(tmp_path / "best.pt") == 1
    assert not (tmp_path / "last.pt").samefile(store.path_for(2))


def test_pruning_passes_over_a_missing_manifest_and_a_file_another_writer_pruned(tmp_path):
    """A run killed between a step file and its manifest leaves the file alone; a node sharing the
    folder may prune a step file between this one's listing and its unlink."""
    store = CheckpointStore(tmp_path, 1)
    save_all(store, [0.1])
    (tmp_path / "step-000000001.pt.json").unlink()
    listed = store.steps
    store.steps = lambda: [store.path_for(0), *listed()]  # step 0: gone since it was listed
    store.save({"step": 2}, {"epoch": 2, "step": 2}, best=False)
    assert [p.name for p in listed()] == ["step-000000002.pt"]


def test_an_interrupt_while_linking_an_alias_stays_one_and_leaves_no_temp_file(tmp_path, monkeypatch):
    """Ctrl-C before the link exists: the cleanup must not turn it into "no such file" (exit 1)."""
    def interrupted(source, target):
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "link", interrupted)
    store = CheckpointStore(tmp_path, 1)
    with pytest.raises(KeyboardInterrupt):
        store.save({"step": 1}, {"epoch": 1, "step": 1}, best=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000000001.pt", "step-000000001.pt.json"]


GOOD = {"file": "x.pt", "sha256": "ab", "bytes": 7, "step": 3}


@pytest.mark.parametrize("manifest", [
    {**GOOD, "sha256": 1}, {**GOOD, "bytes": "7"}, {**GOOD, "bytes": 7.0}, {**GOOD, "step": "3"},
    {**GOOD, "step": True}, [GOOD], "x.pt"],
    ids=["sha256 a number", "bytes a string", "bytes a float", "step a string", "step a bool", "a list",
         "a string"])
def test_a_manifest_with_a_field_of_the_wrong_type_is_none(tmp_path, manifest):
    """Not a manifest, so its checkpoint is untrusted ("no manifest"), and --resume auto's ordering
    by step never meets a step that is no number."""
    path = tmp_path / "x.pt"
    manifest_path(path).write_text(json.dumps(manifest))
    assert read_manifest(path) is None


def test_a_manifest_without_a_step_is_one(tmp_path):
    path = tmp_path / "x.pt"
    manifest = {"file": "x.pt", "sha256": "ab", "bytes": 7}
    manifest_path(path).write_text(json.dumps(manifest))
    assert read_manifest(path) == manifest


def test_tensor_bytes_counts_every_tensor_in_nested_containers_and_nothing_else():
    state = {"model": {"w": torch.zeros(3), "b": torch.zeros(2, dtype=torch.float64)},
             "rng": [torch.zeros(5, dtype=torch.uint8), (torch.zeros(1, dtype=torch.int16), 7)],
             "step": 3, "classes": ["n01"], "top1": None}
    assert tensor_bytes(state) == 12 + 16 + 5 + 2
