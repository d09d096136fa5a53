"""Every write the storage can refuse (disk full, over quota, read-only, no permission, an I/O error)
ends in one line naming the path and the cause in words, exit 6, and nothing torn left in place of a
good file. The errno is injected at the write layer each writer uses, in this process."""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from ddp_cli import io
from ddp_cli.cli.exits import exits
from ddp_cli.data.pack.destination import Destination
from ddp_cli.data.pack.writer import ShardWriter
from ddp_cli.errors import WRITE, WriteError
from ddp_cli.io import size_words, write_error, write_text
from ddp_cli.observe import sinks
from ddp_cli.observe.report import plot
from ddp_cli.run.jobs import write_result
from ddp_cli.run.logs import keep_aside
from ddp_cli.train.checkpoint import Checkpointer, CheckpointStore, RunState, manifest_path, verify
from ddp_cli.train.eval_outputs import write_confusion, write_evaluation, write_predictions

# Each fault and the words its line must hold.
FAULTS = {errno.ENOSPC: "no space left on the device holding", errno.EDQUOT: "disk quota exceeded",
          errno.EROFS: "read-only file system", errno.EACCES: "permission denied (",
          errno.EIO: "I/O error from the device holding"}
faults = pytest.mark.parametrize("code", list(FAULTS), ids=[errno.errorcode[c] for c in FAULTS])


def refused(code: int, filename: str | None = None) -> OSError:
    return OSError(code, os.strerror(code), filename)


def fail_fsync(monkeypatch, code: int, when=lambda path: True) -> None:
    """`os.fsync` refuses with `code` on files whose path passes `when` (the data reaches the disk
    there: a full disk or a failing device says so at the latest then)."""
    real = os.fsync

    def fsync(fd: int) -> None:
        if when(Path(os.readlink(f"/proc/self/fd/{fd}"))):
            raise refused(code)
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)


def assert_one_line(error: pytest.ExceptionInfo, path: Path | str, code: int) -> str:
    message = str(error.value)
    assert error.value.exit_code == WRITE == 6
    assert message.startswith(f"could not write {path}: ") and FAULTS[code] in message, message
    assert "\n" not in message and "Errno" not in message
    return message


def checkpointer(folder: Path, background: bool = False) -> tuple[Checkpointer, RunState]:
    torch.manual_seed(0)
    model = nn.Linear(16, 4)
    ckpt = Checkpointer(CheckpointStore(folder, keep_last=3), background=background)
    progress = RunState(epoch=1, step=5, global_batch=8)
    ckpt.track(progress)
    ckpt.register(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    return ckpt, progress


@faults
@pytest.mark.parametrize("background", [False, True], ids=["foreground", "background"])
def test_a_refused_checkpoint_leaves_the_last_good_one_intact_and_named(tmp_path, monkeypatch, code,
                                                                          background):
    store = CheckpointStore(tmp_path / "run" / "checkpoints", keep_last=3)
    ckpt, progress = checkpointer(store.folder, background)
    good = ckpt.save()
    ckpt.wait()
    before = good.read_bytes()
    progress.step = 10
    fail_fsync(monkeypatch, code, when=lambda path: path.name.startswith(".step-000000010.pt."))
    with pytest.raises(WriteError) as failed:
        ckpt.save()
        ckpt.close()
    message = assert_one_line(failed, store.path_for(10), code)
    assert good.read_bytes() == before and verify(good) is None and verify(store.folder / "last.pt") is None
    assert sorted(p.name for p in store.folder.iterdir()) == [  # no temp file, no torn step file
        "last.pt", "last.pt.json", "step-000000005.pt", "step-000000005.pt.json"]
    said = str(store.refused(failed.value))  # what the training job says (run.training.train_job)
    assert said == (f"{message}; the last good checkpoint is {good}; make room and rerun with --run-dir "
                    f"{tmp_path / 'run'} --resume auto, or copy {tmp_path / 'run'} to a roomier disk "
                    "and resume there")


@faults
def test_a_refused_manifest_removes_its_checkpoint_and_keeps_the_previous(tmp_path, monkeypatch, code):
    ckpt, progress = checkpointer(tmp_path)
    good = ckpt.save()
    progress.step = 10
    fail_fsync(monkeypatch, code, when=lambda path: path.name.startswith(".step-000000010.pt.json."))
    with pytest.raises(WriteError) as failed:
        ckpt.save()
    assert_one_line(failed, manifest_path(ckpt.store.path_for(10)), code)
    assert not ckpt.store.path_for(10).exists() and verify(good) is None
    assert ckpt.store.latest_valid() == good


def test_a_refused_alias_names_it_and_the_room_needed_and_leaves_no_partial_copy(tmp_path, monkeypatch):
    """Where last.pt cannot be a hard link it is a copy, which a full disk can cut short."""
    def copy_cut_short(source, target):
        Path(target).write_bytes(b"part")
        raise refused(errno.ENOSPC, str(target))

    monkeypatch.setattr(os, "link", lambda source, target: (_ for _ in ()).throw(refused(errno.EXDEV)))
    monkeypatch.setattr(shutil, "copyfile", copy_cut_short)
    ckpt, _ = checkpointer(tmp_path)
    with pytest.raises(WriteError) as failed:
        ckpt.save()
    message = assert_one_line(failed, tmp_path / "last.pt", errno.ENOSPC)
    assert f"{size_words(ckpt.store.path_for(5).stat().st_size)} needed" in message
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000000005.pt", "step-000000005.pt.json"]


def test_a_refusal_before_any_checkpoint_says_there_is_none_to_resume_from(tmp_path):
    store = CheckpointStore(tmp_path / "run" / "checkpoints", keep_last=3)
    said = str(store.refused(WriteError("could not write x: no space left")))
    assert said == "could not write x: no space left; no checkpoint was written yet; make room and rerun"


@faults
def test_torch_saves_wrapped_error_is_read_for_the_errno_underneath(tmp_path, monkeypatch, code):
    """torch.save wraps its file's OSError in "PytorchStreamWriter failed ..." (a RuntimeError)."""
    real = io.HashingFile.write

    def write(self, data: bytes) -> int:
        if self.size > 1000:  # into the file: torch's writer has begun
            raise refused(code)
        return real(self, data)

    monkeypatch.setattr(io.HashingFile, "write", write)
    ckpt, _ = checkpointer(tmp_path)
    with pytest.raises(WriteError) as failed:
        ckpt.save()
    assert isinstance(failed.value.__cause__, RuntimeError)  # torch's, with the OSError as its context
    assert_one_line(failed, ckpt.store.path_for(5), code)


def totals() -> SimpleNamespace:
    return SimpleNamespace(confusion=torch.eye(2, dtype=torch.long), kept=[(0, 1, [1, 0], [0.9, 0.1])])


# Files written whole through io.atomic_write: (name, the call that writes `path`)
WHOLE_FILES = {
    "result.json": lambda path: write_result(path.parent, {"top1": 0.5}),
    "evaluation.json": lambda path: write_evaluation(path, {"top1": 0.5}),
    "confusion.csv": lambda path: write_confusion(path, totals(), ["a", "b"], ["A", "B"]),
    "predictions.csv": lambda path: write_predictions(path, totals(), "root", ["x.jpg", "y.jpg"], ["a", "b"]),
}


@faults
@pytest.mark.parametrize("name", list(WHOLE_FILES))
def test_a_refused_whole_file_keeps_the_old_one(tmp_path, monkeypatch, code, name):
    path = tmp_path / name
    path.write_text("old")
    fail_fsync(monkeypatch, code)
    with pytest.raises(WriteError) as failed:
        WHOLE_FILES[name](path)
    assert_one_line(failed, path, code)
    assert path.read_text() == "old" and os.listdir(tmp_path) == [name]


class RefusingFile:
    """An open file whose writes the storage refuses."""

    def __init__(self, code: int) -> None:
        self.code = code

    def write(self, data: str) -> int:
        raise refused(self.code)


@faults
@pytest.mark.parametrize("sink", [sinks.JsonlSink, sinks.CsvSink])
def test_a_refused_metrics_line_or_file_names_it(tmp_path, monkeypatch, code, sink):
    path = tmp_path / "metrics"
    written = sink(path)
    written.file = RefusingFile(code)
    if sink is sinks.CsvSink:
        written.writer = sinks.csv.DictWriter(written.file, sinks.CSV_COLUMNS)
    with pytest.raises(WriteError) as failed:
        written.write({"split": "train", "step": 1, "loss": 0.5})
    assert_one_line(failed, path, code)
    monkeypatch.setattr(sinks, "open", lambda *args, **kwargs: (_ for _ in ()).throw(refused(code)),
                        raising=False)
    with pytest.raises(WriteError) as failed:
        sink(path)
    assert_one_line(failed, path, code)


@faults
def test_a_refused_rank_log_names_it(tmp_path, monkeypatch, code):
    log = tmp_path / "rank0.stderr.log"
    log.write_text("earlier launch")
    monkeypatch.setattr(Path, "rename", lambda self, target: (_ for _ in ()).throw(refused(code, str(self))))
    with pytest.raises(WriteError) as failed:
        keep_aside(log)
    assert_one_line(failed, log, code)


@faults
def test_a_refused_shard_or_pack_file_names_it(tmp_path, monkeypatch, code):
    dest = Destination(str(tmp_path / "packed"))
    scratch = dest.temp_path("train-000000.tar")
    writer = ShardWriter(scratch, "train-000000.tar", 0)
    writer.add([("a.jpg", b"jpeg")], 0, "a.jpg")
    fail_fsync(monkeypatch, code)
    with pytest.raises(WriteError) as failed:
        writer.close()
    assert_one_line(failed, scratch, code)
    with pytest.raises(WriteError) as failed:
        dest.write("index.json", b"{}")
    assert_one_line(failed, f"{dest.url}/index.json", code)


class RefusingBucket:
    """An S3 filesystem that refuses every upload (s3fs: AccessDenied is a PermissionError, no errno)."""

    def put_file(self, local: str, key: str) -> None:
        raise PermissionError("Access Denied")

    pipe_file = put_file


def test_a_refused_s3_upload_names_the_object(tmp_path, monkeypatch):
    dest = Destination(str(tmp_path / "packed"))
    dest.remote, dest.url, dest.root, dest.fs = True, "s3://bucket/packed", "bucket/packed", RefusingBucket()
    monkeypatch.setattr("ddp_cli.data.pack.destination.with_retries", lambda call, where: call())
    with pytest.raises(WriteError) as failed:
        dest.write("index.json", b"{}")
    assert str(failed.value) == ("could not write s3://bucket/packed/index.json: permission denied "
                                 "(Access Denied)")


@faults
def test_a_refused_report_image_names_it(tmp_path, monkeypatch, code):
    from matplotlib.figure import Figure

    run = tmp_path / "run"
    run.mkdir()
    record = {"split": "train", "epoch": 1, "step": 1, "loss": 1.0, "lr": 0.1, "images_per_second": 9.0}
    (run / "metrics.jsonl").write_text(json.dumps(record) + "\n")
    monkeypatch.setattr(Figure, "savefig", lambda self, out, **kw: (_ for _ in ()).throw(refused(code)))
    with pytest.raises(WriteError) as failed:
        plot(run, run / "report.png")
    assert_one_line(failed, run / "report.png", code)


def test_each_cause_in_words(tmp_path, monkeypatch):
    """The exact lines (the report quotes them): the free space and the size needed, the owner and
    mode of the folder that refused."""
    monkeypatch.setattr(io.shutil, "disk_usage", lambda path: SimpleNamespace(free=1_234_567))
    folder = tmp_path / "runs" / "x"
    folder.mkdir(parents=True)
    folder.chmod(0o755)
    target = folder / "step-000000010.pt"
    said = {code: str(write_error(refused(code), target, needed=3_100_000)) for code in FAULTS}
    assert said == {
        errno.ENOSPC: f"could not write {target}: no space left on the device holding {folder}: 3.1 MB "
                      "needed, 1.2 MB free",
        errno.EDQUOT: f"could not write {target}: disk quota exceeded",
        errno.EROFS: f"could not write {target}: read-only file system",
        errno.EACCES: f"could not write {target}: permission denied ({folder}: owner root, mode 0755)"
        if os.geteuid() == 0 else said[errno.EACCES],
        errno.EIO: f"could not write {target}: I/O error from the device holding {folder}",
    }
    assert write_error(refused(errno.ENOENT), target) is None  # not a refusal: left to its caller
    assert write_error(RuntimeError("unexpected pos"), target) is None


def test_a_refused_write_no_wrapper_named_is_exit_6_not_a_bug(tmp_path, capsys):
    """The command's last resort: a full disk met anywhere names the file the error names."""
    import typer

    @exits
    def command(as_json: bool = False) -> None:
        write_text(tmp_path / "ok", "")  # the layer's own writes are named anyway
        raise RuntimeError("deep inside") from refused(errno.ENOSPC, str(tmp_path / "cache.bin"))

    with pytest.raises(typer.Exit) as ended:
        command(as_json=True)
    assert ended.value.exit_code == 6
    out = capsys.readouterr().out
    assert f'"error": "could not write {tmp_path / "cache.bin"}: no space left on the device holding' in out


@pytest.mark.parametrize("sets", [{"optim.name": "sgd", "optim.momentum": 0.9},
                                  {"optim.name": "sgd", "optim.momentum": 0.0},
                                  {"optim.name": "adamw", "train.ema_decay": 0.99}],
                         ids=["sgd-momentum", "sgd", "adamw-ema"])
def test_the_preflight_estimate_of_a_checkpoint_is_its_size_on_disk(tmp_path, sets):
    """What the disk-room warning multiplies: within 10% (and a few kB of pickle) of a real save."""
    from ddp_cli.config import RunConfig
    from ddp_cli.preflight import checkpoint_bytes
    from ddp_cli.train.ema import EmaModel
    from ddp_cli.train.optim import build_optimizer

    cfg = RunConfig().resolved(sets)
    model = nn.Sequential(nn.Conv2d(3, 64, 3), nn.BatchNorm2d(64), nn.Flatten(), nn.LazyLinear(10))
    model(torch.randn(2, 3, 8, 8)).sum().backward()
    optimizer = build_optimizer(cfg.optim, model, 0.1)
    optimizer.step()
    ckpt = Checkpointer(CheckpointStore(tmp_path, keep_last=1))
    ckpt.track(RunState(step=1))
    ckpt.register(model=model, optimizer=optimizer,
                  ema=EmaModel(model, cfg.train.ema_decay) if cfg.train.ema_decay else None)
    size = ckpt.save().stat().st_size
    assert abs(checkpoint_bytes(cfg, model.to("meta")) - size) < 0.1 * size + 16_000


def test_preflight_warns_when_the_run_dirs_disk_has_less_room_than_the_checkpoints_and_refuses_under_one(
        tmp_path, monkeypatch, caplog):
    """Less room than keep_last + 1 checkpoints: a warning; less than one: the first save would fail,
    so the run is refused now (exit 6) naming the flag that chose the run dir."""
    from ddp_cli import preflight
    from ddp_cli.config import RunConfig

    cfg = RunConfig().resolved({"checkpoint.keep_last": 3, "train.ema_decay": 0})
    model = nn.Linear(1000, 250, device="meta")  # 1 MB of weights, 1 MB momentum
    run_dir = preflight.RunDir(tmp_path / "run", "checkpoint.dir")
    for free, warned in ((7_900_000, True), (8_100_000, False), (2_100_000, True)):  # 4 checkpoints of 2.0 MB
        monkeypatch.setattr(preflight.shutil, "disk_usage",  # asked of the folder or its nearest parent
                            lambda path, n=free: SimpleNamespace(free=n) if path else 1 / 0)
        caplog.clear()
        preflight.check_disk_room(cfg, model, run_dir)
        assert bool(caplog.records) == warned, free
    assert (f"warning: {tmp_path / 'run'}: 2.1 MB free on its disk, but the run's checkpoints take about "
            "8.0 MB (4 of 2.0 MB: checkpoint.keep_last + 1); a full disk stops the run at a checkpoint "
            "(exit 6): make room, choose another checkpoint.dir or lower checkpoint.keep_last") in caplog.text
    monkeypatch.setattr(preflight.shutil, "disk_usage", lambda path: SimpleNamespace(free=1_000_000))
    with pytest.raises(WriteError) as refused_run:
        preflight.check_disk_room(cfg, model, run_dir)
    assert str(refused_run.value) == (f"checkpoint.dir {tmp_path / 'run'}: 1.0 MB free on its disk, but one "
                                      "checkpoint of the run takes about 2.0 MB: make room or give another "
                                      "checkpoint.dir")
    assert refused_run.value.exit_code == 6
    # at the edges, exactly enough room: for every checkpoint no warning, for one a warning, not a refusal
    each = preflight.checkpoint_bytes(cfg, model)
    for free, warned in ((4 * each, False), (each, True)):
        monkeypatch.setattr(preflight.shutil, "disk_usage", lambda path, n=free: SimpleNamespace(free=n))
        caplog.clear()
        preflight.check_disk_room(cfg, model, run_dir)
        assert bool(caplog.records) == warned, free
    # a resume replaces the step checkpoints already there: their bytes count as room
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    (tmp_path / "run" / "checkpoints" / "step-000000010.pt").write_bytes(bytes(6_000_000))
    monkeypatch.setattr(preflight.shutil, "disk_usage", lambda path: SimpleNamespace(free=2_100_000))
    caplog.clear()
    preflight.check_disk_room(cfg, model, run_dir)
    assert not caplog.records


@faults
def test_a_worker_whose_error_record_is_refused_too_still_says_it_and_keeps_its_code(tmp_path, monkeypatch,
                                                                                     capsys, code):
    """The disk that failed the run may refuse `errors/rank<N>.json` as well: the line goes to the
    rank's stderr (teed to the console) and the exit code is kept."""
    from ddp_cli.run.worker import fail

    fail_fsync(monkeypatch, code)
    assert fail(tmp_path, 0, WRITE, "could not write x: disk quota exceeded", original=True) == WRITE
    assert capsys.readouterr().err == "error: could not write x: disk quota exceeded\n"


@faults
def test_ddp_init_into_a_refusing_folder_is_exit_6(tmp_path, monkeypatch, code):
    from ddp_cli.cli.starter import write_starter

    monkeypatch.setattr(Path, "open", lambda self, mode: (_ for _ in ()).throw(refused(code, str(self))))
    with pytest.raises(WriteError) as failed:
        write_starter(tmp_path / "starter")
    assert_one_line(failed, tmp_path / "starter" / "demo.toml", code)


def test_a_stream_write_refused_names_no_folder_it_does_not_know():
    assert str(write_error(refused(errno.ENOSPC))) == "could not write a file: no space left on the device"


def mount(target: Path, flags: int = 0) -> int:
    """mount(2) of a 2 MB tmpfs at `target` (no process); 0, else the errno."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    return 0 if libc.mount(b"tmpfs", str(target).encode(), b"tmpfs", flags, b"size=2m") == 0 \
        else ctypes.get_errno()


@pytest.fixture
def tmpfs(tmp_path):
    """A real 2 MB tmpfs, skipped where mounting is not permitted (not root, no CAP_SYS_ADMIN), always
    unmounted."""
    import ctypes

    folder = tmp_path / "disk"
    folder.mkdir()
    refused_by = mount(folder)
    if refused_by:
        pytest.skip(f"cannot mount a tmpfs here: {os.strerror(refused_by)}")
    yield folder
    ctypes.CDLL(None).umount2(str(folder).encode(), 2)  # MNT_DETACH


def test_a_real_full_disk_and_a_real_read_only_one(tmpfs):
    """No injection: torch.save really meets ENOSPC on a 2 MB tmpfs, then the tmpfs turns read-only."""
    folder = tmpfs / "run" / "checkpoints"
    ckpt = Checkpointer(CheckpointStore(folder, keep_last=3))
    progress = RunState(step=5)
    ckpt.track(progress)
    ckpt.register(model=nn.Linear(600, 500))  # 1.2 MB: one fits, two do not
    good = ckpt.save()
    progress.step = 10
    with pytest.raises(WriteError) as failed:
        ckpt.save()
    message = str(failed.value)
    assert message.startswith(f"could not write {folder / 'step-000000010.pt'}: no space left on the device "
                              f"holding {folder}: 1.2 MB needed, ") and message.endswith(" free"), message
    assert verify(good) is None and not ckpt.store.path_for(10).exists()
    assert [p.name for p in folder.iterdir() if p.name.startswith(".")] == []  # no temp file left
    assert mount(tmpfs, 32 | 1) == 0  # MS_REMOUNT | MS_RDONLY: the same tmpfs, read-only now
    with pytest.raises(WriteError, match=f"could not write {folder / 'step-000000010.pt'}: read-only file "
                                         "system$"):
        ckpt.save()
    assert verify(good) is None


def test_a_device_that_fails_reading_back_too_still_gets_one_line(tmp_path, monkeypatch):
    store = CheckpointStore(tmp_path / "checkpoints", keep_last=1)
    monkeypatch.setattr(store, "latest_valid", lambda: (_ for _ in ()).throw(refused(errno.EIO)))
    monkeypatch.setattr(io.Path, "stat", lambda self, **kw: (_ for _ in ()).throw(refused(errno.EIO)))
    error = write_error(refused(errno.EACCES), tmp_path / "x")  # even the owner cannot be read
    assert str(store.refused(error)) == (f"could not write {tmp_path / 'x'}: permission denied; the "
                                         f"checkpoints in {store.folder} could not be read back")


class FullDiskStream:
    """A rank's stderr when it is a log file on the disk that filled: every write refused."""

    def write(self, text: str) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    def flush(self) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")


def test_a_rank_that_can_write_neither_its_record_nor_its_stderr_still_ends_with_exit_6(tmp_path,
                                                                                       monkeypatch):
    """Its record of the failure and its stderr on the full disk: the exit code alone tells the launcher
    (an OSError escaping here once left the rank hanging in multiprocessing's exit, its peer with it)."""
    from ddp_cli.run import worker

    def refused(*args):
        raise WriteError("could not write errors/rank0.json: no space left")

    monkeypatch.setattr(worker, "record_error", refused)
    monkeypatch.setattr(worker.sys, "stderr", FullDiskStream())
    assert worker.fail(tmp_path, 0, WRITE, "could not write last.pt: no space left", original=True) == WRITE
