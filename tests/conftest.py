"""Shared test helpers: tiny data sets made on the spot, the CLI as a subprocess or in this process (the
gloo process harness is ddp_cli.run.loopback, shared with the benches)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from filelock import FileLock
from synthetic import image, make_imagefolder, write_hf_parquet, write_registry

REPO = Path(__file__).resolve().parent.parent
TIMEOUT = 240
# S3 on loopback (moto's server mode): fake credentials, set per test only; never to reach a run's files
KEY, SECRET = "AKIADDPTESTFAKE00000", "ddp-fake-secret-never-in-a-run-dir"
CLEAN_ENV = {"AWS_EC2_METADATA_DISABLED": "true", "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent/ddp",
             "AWS_CONFIG_FILE": "/nonexistent/ddp", "AWS_DEFAULT_REGION": "us-east-1"}
ENV = {**CLEAN_ENV, "AWS_ACCESS_KEY_ID": KEY, "AWS_SECRET_ACCESS_KEY": SECRET}


def run_ddp(*args: str, cwd: Path | None = None, env: dict | None = None,
            timeout: float = TIMEOUT) -> subprocess.CompletedProcess:
    """`ddp ARGS...` as a subprocess, killed (with its workers) after `timeout`."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID"):
        full_env.pop(name, None)
    proc = subprocess.Popen([sys.executable, "-m", "ddp_cli", *args], cwd=cwd or REPO,
                            env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        stdout, stderr = proc.communicate()
        pytest.fail(f"ddp {' '.join(args)} timed out\n{stderr[-3000:]}")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, 9)  # no orphan workers, whatever happened
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


# The CLI sets these defaults in its environment; CliRunner restores the caller's after each run.
CLI_ENV = {"LOGLEVEL": "CRITICAL", "TORCH_CPP_LOG_LEVEL": "FATAL", "DDP_LOG_LEVEL": "INFO"}


def ddp_in_process(*args: str) -> subprocess.CompletedProcess:
    """`ddp ARGS...` in this process, returned as `run_ddp` returns it: for commands that start no worker,
    without an interpreter's and torch's start-up (~3 s) each."""
    from typer.testing import CliRunner

    from ddp_cli.cli import app

    result = CliRunner().invoke(app, list(args), env=CLI_ENV)
    return subprocess.CompletedProcess(["ddp", *args], result.exit_code, result.stdout, result.stderr)


def every_command(group=None, path: tuple[str, ...] = ()):
    """(path, click command) for the root, every group and every command under them."""
    if group is None:
        import typer

        from ddp_cli.cli import app

        group = typer.main.get_command(app)
    yield path, group
    for name, command in getattr(group, "commands", {}).items():
        yield from every_command(command, (*path, name))


def last_json(result: subprocess.CompletedProcess):
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def val_split_of(registry: Path, crop: int, resize: int, name: str = "demo"):
    """A data set's val split as `ddp validate` feeds it (ddp's own decode, crop and normalisation):
    (images, labels, classes), for scoring an exported model as validate does."""
    import torch
    from torch.utils.data import DataLoader

    from ddp_cli.data.pipeline.loaders import ImageDataset
    from ddp_cli.data.pipeline.transforms import ValTransform, to_model_input
    from ddp_cli.data.registry import load_registry
    from ddp_cli.data.sources.layouts import build_index

    entry = load_registry(str(registry)).get(name)
    fs, root = entry.open()
    index = build_index(fs, root, entry.layout, splits=("val",))
    dataset = ImageDataset(fs, root, index.splits["val"], ValTransform(crop, resize))
    images, labels = [], []
    for pixels, label, _, error in DataLoader(dataset, batch_size=128):
        assert not any(error)
        images.append(to_model_input(pixels, torch.device("cpu"), channels_last=False))
        labels.append(label)
    return torch.cat(images), torch.cat(labels), index.classes


@pytest.fixture(scope="session", autouse=True)
def own_compile_cache(tmp_path_factory):
    """torch.compile's kernels cached in this session's own folder, which every process it starts
    inherits: the machine's shared cache (/tmp/torchinductor_<user>) once served a compiled bf16 step a
    kernel that crashed it (SIGSEGV), after `make test-cpu-kinds` had run the suite under other CPU
    settings; with a fresh folder the same test passed. A test run neither reads nor leaves one."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "inductor"))
        yield


@pytest.fixture(scope="session")
def demo_root(tmp_path_factory) -> Path:
    from ddp_cli.data.sources.demo import ensure_demo

    return ensure_demo(tmp_path_factory.mktemp("demo") / "demo")


@pytest.fixture(scope="session")
def demo_registry(demo_root: Path, tmp_path_factory) -> Path:
    """A registry whose `demo` points at the session's demo copy (built once)."""
    folder = tmp_path_factory.mktemp("registry")
    return write_registry(folder, [{"name": "demo", "layout": "imagenet-loc",
                                    "generator": "sklearn-digits",
                                    "storage": {"driver": "FileSystem", "path": str(demo_root)}}])


class LiveRun:
    """A `ddp` subprocess whose stderr is read as it runs (to act mid-run: signals, kills)."""

    def __init__(self, *args: str, env: dict | None = None) -> None:
        import threading

        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID"):
            full_env.pop(name, None)
        self.proc = subprocess.Popen([sys.executable, "-m", "ddp_cli", *args], cwd=REPO, env=full_env,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     start_new_session=True)
        self.lines: list[str] = []
        self.stdout = ""
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.lines.append(line)

    def wait_for(self, text: str, timeout: float = 120) -> None:
        import time

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(text in line for line in self.lines):
                return
            if self.proc.poll() is not None:
                break
            time.sleep(0.1)
        self.kill()
        pytest.fail(f"never saw {text!r}:\n{''.join(self.lines)[-3000:]}")

    def workers(self) -> list[int]:
        """PIDs of this run's worker processes: the launcher's children (forked or spawned)."""
        pids = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            if ppid == self.proc.pid:
                pids.append(int(entry.name))
        return sorted(pids)

    def wait(self, timeout: float = TIMEOUT) -> int:
        try:
            self.proc.wait(timeout=timeout)  # not communicate(): the reader thread owns stderr
            self.stdout = self.proc.stdout.read()
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"ddp did not exit in {timeout}s:\n{''.join(self.lines)[-3000:]}")
        self.reader.join(5)
        self.kill()
        return self.proc.returncode

    @property
    def stderr(self) -> str:
        return "".join(self.lines)

    @classmethod
    def demo_at_step_2(cls, registry: Path, run_dir: Path) -> LiveRun:
        """The demo with in-process loading, logging every step, once its second step is done."""
        run = cls("train", "configs/demo.toml", "--registry", str(registry), "--run-dir", str(run_dir),
                  "--set", "data.workers=0", "--set", "logging.every_steps=1")
        run.wait_for("step 2/")
        return run

    def kill(self) -> None:
        """Kill the launcher's process group and its workers (the agent gives them sessions of their own)."""
        workers = self.workers()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, 9)
        for pid in workers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, 9)


@pytest.fixture(scope="session")
def trained_demo(demo_registry: Path, tmp_path_factory, worker_id: str) -> Path:
    """A demo run trained once per session (3 epochs at the digits' native 8 px, EMA on, 2 ranks,
    ~15 s): its run directory. What `validate`, `predict`, `export` and `report` are tested on, and what
    training from packed shards is compared with;
    accurate enough (top-1 ~0.93, EMA ~0.88) that agreements between them are not agreements on noise.
    Under xdist (`make test`'s end-to-end line) the first worker to need it trains it for all: their
    session folders share a parent, where a lock makes the others wait for it.
    """
    if worker_id == "master":
        return train_the_demo(demo_registry, tmp_path_factory.mktemp("trained") / "demo")
    shared = tmp_path_factory.getbasetemp().parent
    with FileLock(shared / "trained_demo.lock"):
        run_dir, done = shared / "trained_demo", shared / "trained_demo.done"
        if not done.is_file():
            train_the_demo(demo_registry, run_dir)
            done.touch()
        return run_dir


# `trained_demo`'s settings: a test training the same run another way compares with it
# (best.pt judged by the trained weights, so `--weights auto` is them: the tests compare the model's numbers
# and the EMA's each by name; the default, judged by the EMA, in tests/unit/test_inference.py)
TRAINED_DEMO_SETS = [a for s in ("train.epochs=3", "train.ema_decay=0.9", "checkpoint.best_metric=top1",
                                 "data.image_size=8", "data.val_resize=8", "data.workers=0",
                                 "train.precision=fp32")
                     for a in ("--set", s)]


def train_the_demo(demo_registry: Path, run_dir: Path) -> Path:
    result = run_ddp("train", "configs/demo.toml", "--registry", str(demo_registry), "--run-dir",
                     str(run_dir), "--quiet", "--json", *TRAINED_DEMO_SETS)
    last_json(result)
    return run_dir


@pytest.fixture(scope="session")
def s3_endpoint() -> str:
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture
def aws(monkeypatch):
    """Fake credentials in this test's environment only; a fresh s3fs per test (no cached sessions)."""
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(name, raising=False)
    for name, value in ENV.items():
        monkeypatch.setenv(name, value)
    clear_instance_caches()
    yield monkeypatch
    clear_instance_caches()


def clear_instance_caches() -> None:
    """s3fs keeps one filesystem (and its credentials) per set of options, per class."""
    import s3fs

    from ddp_cli.data.fetch.s3fs_once import S3FileSystemOnce

    s3fs.S3FileSystem.clear_instance_cache()
    S3FileSystemOnce.clear_instance_cache()


@pytest.fixture(scope="session")
def demo_page(trained_demo: Path, tmp_path_factory) -> tuple[Path, Path, dict]:
    """(the page `ddp report --html` makes of a copy of `trained_demo` after `ddp validate --per-class
    --predictions RUN_DIR/predictions.csv`, that copy, the report's JSON): what the page's tests read."""
    run_dir = tmp_path_factory.mktemp("page") / "demo"
    shutil.copytree(trained_demo, run_dir)
    last_json(run_ddp("validate", "--checkpoint", str(run_dir / "checkpoints" / "best.pt"), "--per-class",
                      "--predictions", str(run_dir / "predictions.csv"), "--json"))
    page = run_dir.parent / "demo.html"
    return page, run_dir, last_json(ddp_in_process("report", str(run_dir), "--html", str(page), "--json"))


@pytest.fixture
def one_process_group():
    """A one-process gloo group for a Trainer built in-process; the signal handlers a StopRequest
    installs put back afterwards."""
    import signal

    import torch.distributed as dist

    from ddp_cli.distributed.signals import CODES

    handlers = {sig: signal.getsignal(sig) for sig in CODES}
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()
    for sig, handler in handlers.items():
        signal.signal(sig, handler)


@pytest.fixture
def with_unlabeled(tmp_path):
    """An imagefolder data set (3 classes, 6 train images each) whose registry entry names an unlabeled
    folder of 20 images, some in a subfolder."""
    root = tmp_path / "data"
    make_imagefolder(root, per_class=6, size=12)
    (root / "unlabeled/more").mkdir(parents=True)
    for i in range(20):
        image(i, i % 3, 12).save(root / "unlabeled" / ("more" if i % 2 else "") / f"u{i}.png")
    return write_registry(tmp_path, [{"name": "semi", "layout": "imagefolder", "unlabeled": "unlabeled",
                                      "storage": {"driver": "FileSystem", "path": str(root)}}])


UNLABELLED_IMAGES = 12  # per layout below: 3 steps of 2 ranks x batch 2 x mu 1, a pass with none dropped


@pytest.fixture(scope="session")
def unlabeled_elsewhere(tmp_path_factory) -> Path:
    """A registry of two entries whose unlabeled split is no folder: `packed` (shards written by `pack`
    from an imagefolder with an unlabeled/ split, its labels ignored) and `hub` (Parquet, files
    `unlabeled-*`, one with a label column, the other without)."""
    import fsspec
    import pyarrow.parquet as pq

    from ddp_cli.data.pack.writer import PackOptions, Source, pack, pack_index

    folder = tmp_path_factory.mktemp("unlabeled-elsewhere")
    source = folder / "source"
    make_imagefolder(source, classes=2, per_class=2, size=8)
    for i in range(UNLABELLED_IMAGES):
        (source / f"unlabeled/class_{i % 2}").mkdir(parents=True, exist_ok=True)
        image(i, i % 2, 8).save(source / f"unlabeled/class_{i % 2}/u{i}.png")
    fs, splits = fsspec.filesystem("file"), ("train", "val", "unlabeled")
    pack(Source(fs, str(source), "src", "imagefolder", str(source)),
         pack_index(fs, str(source), "imagefolder", splits, "error"), str(folder / "packed"),
         PackOptions(splits=splits, shard_mib=0.001), 1)
    write_hf_parquet(folder / "hub", {"train": 4, "validation": 2, "unlabeled": UNLABELLED_IMAGES},
                     classes=2, row_group=2, size=8)
    unlabelled_file = folder / "hub/data/unlabeled-00001-of-00002.parquet"
    pq.write_table(pq.read_table(unlabelled_file).drop_columns(["label"]), unlabelled_file, row_group_size=2)
    return write_registry(folder, [{"name": name, "layout": layout, "unlabeled": "unlabeled",
                                    "storage": {"driver": "FileSystem", "path": str(folder / name)}}
                                   for name, layout in (("packed", "shards"), ("hub", "parquet"))])
