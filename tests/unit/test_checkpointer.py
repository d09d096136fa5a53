"""The Checkpointer: parts registered once, progress field by field, saves in the background that
never overlap, never hold a half-changed state and never outlive the process; a stop agreed by the
ranks ends a real Trainer's run only once the step it stops after is saved."""

from __future__ import annotations

import errno
import json
import signal
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from replicas import CLASSES, make_config
from torch import nn

from ddp_cli.data.pipeline.loaders import Batch, Loaders
from ddp_cli.data.pipeline.sampler import ShardSampler
from ddp_cli.distributed.setup import DistContext, seed_everything
from ddp_cli.distributed.signals import StopRequest
from ddp_cli.errors import ConfigError, DataError, DdpError, WriteError
from ddp_cli.io import writing
from ddp_cli.models import build_model
from ddp_cli.train import rng
from ddp_cli.train.checkpoint import (
    Checkpointer,
    CheckpointStore,
    RankRngs,
    RunState,
    cpu_copy,
    load_checkpoint,
    verify,
)
from ddp_cli.train.trainer import Trainer
from tests.resolved import resolved


def parts() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Linear(64, 32)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(4, 64)).sum().backward()
    optimizer.step()
    return model, optimizer


def checkpointer(folder: Path, background: bool, **kwargs) -> tuple[Checkpointer, nn.Module, RunState]:
    model, optimizer = parts()
    ckpt = Checkpointer(CheckpointStore(folder, keep_last=5), background=background, **kwargs)
    progress = RunState(epoch=1, step=7, global_batch=32)
    ckpt.track(progress)
    ckpt.register(model=model, optimizer=optimizer)
    return ckpt, model, progress


class GatedStore(CheckpointStore):
    """A store whose writes wait for `gate`, and which records when each write ran."""

    def __init__(self, folder: Path) -> None:
        super().__init__(folder, keep_last=5)
        self.gate, self.spans, self.fail, self.threads = threading.Event(), [], False, []

    def save(self, state, info, best):
        self.gate.wait(10)
        self.threads.append(threading.current_thread().name)
        if self.fail:
            with writing(self.path_for(info["step"])):  # as atomic_write meets a full disk
                raise OSError(errno.ENOSPC, "No space left on device")
        start = len(self.spans)
        self.spans.append(("start", start))
        path = super().save(state, info, best)
        self.spans.append(("end", start))
        return path


def test_background_and_foreground_write_the_same_checkpoint(tmp_path):
    files = {}
    for background in (False, True):
        ckpt, model, _ = checkpointer(tmp_path / str(background), background)
        files[background] = ckpt.save(top1=0.5)
        ckpt.close()
        assert verify(files[background]) is None  # the sha256 hashed while writing matches the file
    fore, back = load_checkpoint(files[False]), load_checkpoint(files[True])
    assert fore.keys() == back.keys() and back["step"] == 7 and back["global_batch"] == 32
    for key, value in fore["model"].items():
        assert torch.equal(value, back["model"][key])
    assert torch.equal(fore["optimizer"]["state"][0]["momentum_buffer"],
                       back["optimizer"]["state"][0]["momentum_buffer"])


def test_a_background_save_holds_the_state_of_its_step_not_what_training_did_next(tmp_path):
    ckpt, model, _ = checkpointer(tmp_path, background=True)
    ckpt.store = store = GatedStore(tmp_path)
    before = model.weight.detach().clone()
    path = ckpt.save()
    with torch.no_grad():
        model.weight.add_(1.0)  # the next step, while the write waits
    store.gate.set()
    ckpt.close()
    assert torch.equal(load_checkpoint(path)["model"]["weight"], before)


def test_saves_never_overlap_and_close_waits_for_the_last(tmp_path):
    ckpt, _, progress = checkpointer(tmp_path, background=True)
    ckpt.store = store = GatedStore(tmp_path)
    first = ckpt.save()
    progress.step = 8
    releaser = threading.Timer(0.2, store.gate.set)
    releaser.start()
    second = ckpt.save()  # waits for the first write before handing over the second
    assert ("end", 0) in store.spans  # one snapshot in memory at a time, one write at a time
    ckpt.close()
    assert store.spans == [("start", 0), ("end", 0), ("start", 2), ("end", 2)]
    assert verify(first) is None and verify(second) is None
    assert (tmp_path / "last.pt").samefile(second)


def test_a_failed_background_write_ends_the_run_at_the_next_step_and_not_silently(tmp_path):
    ckpt, _, progress = checkpointer(tmp_path, background=True)
    ckpt.store = store = GatedStore(tmp_path)
    store.fail = True
    ckpt.save()
    progress.step = 8
    assert not ckpt.due()  # the write is still under way: training goes on
    store.gate.set()
    ckpt.pending.exception(10)  # ... until it has failed
    progress.step = 9
    with pytest.raises(WriteError, match=f"could not write {store.path_for(7)}: no space left") as failed:
        ckpt.due()  # the first step after the failure, though no save is due
    assert failed.value.exit_code == 6
    ckpt.close()  # raised once: nothing left pending


class AgreedStop:
    def agreed(self) -> int:
        return signal.SIGTERM

    def after_step(self, step: int) -> None:
        pass


def test_a_stop_ends_the_run_only_once_its_checkpoint_is_on_disk(tmp_path):
    ckpt, _, _ = checkpointer(tmp_path, background=True, stop=AgreedStop())
    ckpt.store = store = GatedStore(tmp_path)
    threading.Timer(0.2, store.gate.set).start()
    assert ckpt.due()  # the stop makes a save due
    path = ckpt.save()
    with pytest.raises(DdpError, match="stopped by SIGTERM after step 7") as stopped:
        ckpt.end_if_stopping(path)
    assert stopped.value.exit_code == 143
    assert verify(store.path_for(7)) is None  # written and checked before the error was raised


class RecordingMirror:
    """A bucket's mirror as the store sees it (run.mirror.BucketMirror): what it was told, in order."""

    url = "s3://bucket/runs/a"

    def __init__(self) -> None:
        self.told: list[tuple] = []

    def saved(self, path: Path, aliases: list[Path]) -> None:
        self.told.append(("saved", path.name, [alias.name for alias in aliases]))

    def removed(self, path: Path) -> None:
        self.told.append(("removed", path.name))

    def raise_if_failed(self) -> None: ...

    def close(self) -> None:
        self.told.append(("closed",))


def test_a_mirror_is_told_of_each_checkpoint_and_each_pruned_one_and_a_stop_names_its_url(tmp_path):
    mirror = RecordingMirror()
    ckpt = Checkpointer(CheckpointStore(tmp_path, keep_last=1, mirror=mirror), stop=AgreedStop())
    ckpt.track(progress := RunState(epoch=1, step=7))
    ckpt.save(top1=0.5)
    progress.step = 8
    assert ckpt.due()
    path = ckpt.save()
    with pytest.raises(DdpError, match=r"the same command with --run-dir s3://bucket/runs/a resumes it$"):
        ckpt.end_if_stopping(path)
    ckpt.close()
    assert mirror.told == [("saved", "step-000000007.pt", ["last.pt", "best.pt"]),
                           ("saved", "step-000000008.pt", ["last.pt"]), ("removed", "step-000000007.pt"),
                           ("closed",)]


def test_a_background_write_that_fails_otherwise_than_refused_names_the_folder(tmp_path):
    """Not a refusal (those are WriteErrors, test_disk_faults): one DataError line, exit 3."""
    def stale(state, info, best):
        raise OSError(errno.ESTALE, "Stale file handle")

    ckpt, _, _ = checkpointer(tmp_path, background=True)
    ckpt.store.save = stale
    ckpt.save()
    with pytest.raises(DataError) as failed:
        ckpt.close()
    assert str(failed.value) == (f"{tmp_path}: writing a checkpoint failed ([Errno {errno.ESTALE}] Stale "
                                 "file handle); fix the folder, then resume from the last one written")


def test_progress_round_trips_field_by_field_and_missing_parts_are_named(tmp_path):
    ckpt, _, progress = checkpointer(tmp_path, background=False)
    progress.history.append({"epoch": 1, "top1": 0.5})
    progress.samples_in_epoch, progress.running = 96, [[3.5, 2.0]]
    path = ckpt.save(top1=0.5)
    other, _, restored = checkpointer(tmp_path / "other", background=False)
    restored.step = 0
    other.load(path)
    assert restored == RunState(**{**progress.state_dict()})
    bare = Checkpointer(None)
    bare.register(ema=nn.Linear(2, 2))
    with pytest.raises(DataError, match="has no ema state"):
        bare.load(path)
    bare.optional.add("ema")
    bare.load(path)  # an optional part may be absent


def load_error(path: Path, error: type[DdpError], **parts: nn.Module) -> str:
    """The message of `error`, raised by loading `path` into a checkpointer of `parts`."""
    other = Checkpointer(None)
    other.register(**parts)
    with pytest.raises(error) as raised:
        other.load(path)
    return str(raised.value)


def test_a_missing_or_unfitting_part_names_the_ways_on_and_parts_after_an_absent_optional_one_load(tmp_path):
    ckpt, model, _ = checkpointer(tmp_path, background=False)
    path = ckpt.save(top1=0.5)
    assert load_error(path, DataError, ema=nn.Linear(2, 2)) == (
        f"{path}: the checkpoint has no ema state; resume from another one (--resume PATH) or start afresh "
        "(--resume never)")
    assert load_error(path, ConfigError, model=nn.Linear(64, 10)) == (  # torch's first line only
        f"resume: {path}: its model does not fit this run (another model or class count? Error(s) in "
        "loading state_dict for Linear:); use --resume never or a new --run-dir")
    fresh = nn.Linear(64, 32)
    later = Checkpointer(None)
    later.register(optional=("ema",), ema=nn.Linear(2, 2))
    later.register(model=fresh)  # after the absent optional part: still restored
    later.load(path)
    assert torch.equal(fresh.weight, model.weight) and torch.equal(fresh.bias, model.bias)


def test_a_save_is_due_at_an_epochs_end_every_n_steps_and_on_a_stop(tmp_path):
    ckpt, _, progress = checkpointer(tmp_path, background=False, every_steps=4)
    assert ckpt.due(epoch_end=True) and not ckpt.due()  # step 7
    progress.step = 8
    assert ckpt.due()
    ckpt.end_if_stopping(None)  # no stop agreed: nothing ends
    ckpt.every, progress.step, ckpt.stop = 0, 9, AgreedStop()
    assert ckpt.due() and ckpt.stopping == signal.SIGTERM


def test_the_stop_names_the_checkpoint_and_the_run_dir_that_resumes_it(tmp_path):
    """The writing rank names its checkpoint; a rank without a store (or a save that wrote nothing)
    names the run's checkpoints folder, relative to the run dir."""
    ckpt, _, _ = checkpointer(tmp_path / "run" / "checkpoints", background=False, stop=AgreedStop())
    assert ckpt.due()
    path = ckpt.save()
    with pytest.raises(DdpError) as stopped:
        ckpt.end_if_stopping(path)
    assert str(stopped.value) == (f"stopped by SIGTERM after step 7, checkpoint {path}; the same command "
                                  f"with --run-dir {tmp_path / 'run'} resumes it")
    with pytest.raises(DdpError) as nothing_written:
        ckpt.end_if_stopping(None)
    assert f"checkpoint {tmp_path / 'run' / 'checkpoints'};" in str(nothing_written.value)
    other = Checkpointer(None, stop=AgreedStop())
    other.track(RunState(epoch=1, step=3, global_batch=32))
    assert other.due()
    with pytest.raises(DdpError) as elsewhere:
        other.end_if_stopping(None)
    assert str(elsewhere.value).endswith("after step 3, checkpoint checkpoints; the same command with "
                                         "--run-dir . resumes it")


def test_by_default_saves_come_only_at_an_epochs_end_and_are_written_by_the_caller(tmp_path):
    """The defaults: no step interval, no stop pending before the first `due()`, foreground writes;
    `background` hands them to one thread named for thread dumps."""
    store = GatedStore(tmp_path / "fore")
    store.gate.set()
    ckpt = Checkpointer(store)
    ckpt.track(RunState(epoch=1, step=7))
    ckpt.end_if_stopping(None)  # nothing agreed yet: nothing ends
    assert not ckpt.due() and ckpt.due(epoch_end=True)
    ckpt.save()
    assert store.threads == [threading.current_thread().name]
    store = GatedStore(tmp_path / "back")
    store.gate.set()
    ckpt = Checkpointer(store, background=True)
    ckpt.save()
    ckpt.close()
    assert store.threads == ["ddp-checkpoint_0"]


@pytest.mark.parametrize("background", [False, True])
def test_best_pt_moves_only_on_a_strictly_higher_top1_and_manifests_carry_it(tmp_path, background):
    ckpt, _, progress = checkpointer(tmp_path, background)
    bests = []
    for step, top1 in ((7, 0.5), (8, 0.5), (9, None), (10, 0.6)):  # a mid-epoch save (9) has no top-1
        progress.step = step
        ckpt.save(top1=top1)
        ckpt.wait()
        bests.append(json.loads((tmp_path / "best.pt.json").read_text())["step"])
    ckpt.close()
    assert bests == [7, 7, 7, 10] and progress.best_top1 == 0.6
    top1s = [json.loads((tmp_path / f"step-{s:09d}.pt.json").read_text())["top1"] for s in (7, 9)]
    assert top1s == [0.5, None]


def test_a_rank_that_does_not_write_still_takes_part_and_writes_nothing(tmp_path):
    ckpt, _, progress = checkpointer(tmp_path / "ckpt", background=False, writes=False)
    gathered = []
    ckpt.register(rng=type("Gathered", (), {"state_dict": lambda _: gathered.append(1)})())
    assert ckpt.save(top1=0.5) is None and gathered == [1]  # the collective ran on this rank too
    assert not (tmp_path / "ckpt").exists() and progress.best_top1 == 0.5


def test_cpu_copy_copies_every_tensor_in_nested_containers_and_keeps_the_rest():
    t = torch.ones(2)
    copy = cpu_copy({"a": [t, 1], "b": (t, "x"), "c": {"d": t}, "e": None})
    t.add_(1.0)  # training goes on changing the live tensor
    assert type(copy["a"]) is list and type(copy["b"]) is tuple and copy["e"] is None
    assert (copy["a"][1], copy["b"][1]) == (1, "x")
    for tensor in (copy["a"][0], copy["b"][0], copy["c"]["d"]):
        assert torch.equal(tensor, torch.ones(2))


def test_rank_rngs_gather_every_ranks_state_and_restore_their_own_at_the_same_world_size(monkeypatch):
    saved = rng.capture()
    torch.manual_seed(2)
    other = rng.capture()  # rank 0's

    def gather(states, state):  # a two-rank all_gather_object, seen from rank 1
        assert states == [None, None]
        states[0], states[1] = other, state

    monkeypatch.setattr(dist, "all_gather_object", gather)
    try:
        torch.manual_seed(1)
        own = torch.get_rng_state()
        states = RankRngs(rank=1, world_size=2).state_dict()
        assert states[0] is other and torch.equal(states[1]["torch"], own)
        torch.manual_seed(3)
        RankRngs(rank=1, world_size=2).load_state_dict(states)
        assert torch.equal(torch.get_rng_state(), own)
        RankRngs(rank=0, world_size=3).load_state_dict(states)  # another world size: left alone
        assert torch.equal(torch.get_rng_state(), own)
    finally:
        rng.restore(saved)


def stopped_run(tmp_path: Path, monkeypatch, after_step: int) -> tuple[pytest.ExceptionInfo, CheckpointStore]:
    """A real Trainer fitting 2 epochs of 2 steps, every step's stop agreed (distributed.stop_check_steps
    = 1), sent a real SIGTERM after `after_step` (`DDP_FAULTS`, caught by StopRequest's own handler);
    the run's end and its checkpoints."""
    class Val(list):
        sampler = range(2)  # `evaluate_each` reads the items' positions off it

    def batch(seed: int) -> Batch:
        g = torch.Generator().manual_seed(seed)
        return Batch(torch.randint(0, 256, (2, 16, 16, 3), dtype=torch.uint8, generator=g),
                     torch.randint(0, CLASSES, (2,), generator=g), [""] * 2, [""] * 2)

    monkeypatch.setenv("DDP_FAULTS", f"sigterm@{after_step}")
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)  # no launcher: the rank signals itself
    cfg = make_config({"data": {"batch_size": 2}, "train": {"epochs": 2}})
    seed_everything(cfg.seed)
    store = CheckpointStore(tmp_path, keep_last=5)
    loaders = Loaders([batch(10), batch(11)], Val([batch(20)]),
                      ShardSampler(4, 0, 1, shuffle=True, batch_size=2, with_epoch=True))
    trainer = Trainer(resolved(cfg, 2), DistContext(0, 1, 0, 1, torch.device("cpu"), "gloo"),
                      build_model(cfg.model, CLASSES), loaders, 2,
                      Checkpointer(store, stop=StopRequest(None), stop_every=1))
    try:
        with pytest.raises(DdpError) as stopped:
            trainer.fit()
    finally:
        trainer.close()
    return stopped, store


@pytest.mark.parametrize("after_step", [1, 3])  # in the first epoch (none saved before it), and the second
def test_an_agreed_stop_saves_the_step_it_stops_after_before_the_run_ends(one_process_group, tmp_path,
                                                                          monkeypatch, after_step):
    stopped, store = stopped_run(tmp_path, monkeypatch, after_step)
    assert stopped.value.exit_code == 143
    assert f"stopped by SIGTERM after step {after_step}, checkpoint {store.path_for(after_step)};" in \
        str(stopped.value)
    assert verify(store.path_for(after_step)) is None and verify(tmp_path / "last.pt") is None
    saved = load_checkpoint(tmp_path / "last.pt")
    assert (saved["step"], saved["epoch"], saved["step_in_epoch"]) == (after_step, after_step // 2,
                                                                       after_step % 2)
    assert store.latest_valid() == store.path_for(after_step)
