"""Shared test helpers: tiny data sets made on the spot, a gloo process harness, the CLI."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import traceback
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from synthetic import write_registry

REPO = Path(__file__).resolve().parent.parent
TIMEOUT = 240


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(fn, rank: int, world_size: int, port: int, out: str, args: tuple) -> None:
    import torch.distributed as dist

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        result = fn(rank, world_size, *args)
        torch.save({"ok": result}, f"{out}/rank{rank}.pt")
    except BaseException:
        torch.save({"error": traceback.format_exc()}, f"{out}/rank{rank}.pt")
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(fn, world_size: int, tmp_path: Path, *args, timeout: float = 120) -> list:
    """Run `fn(rank, world_size, *args)` in `world_size` gloo processes; return each result.

    `fn` must be a module-level function (spawned processes import it). Every
    process is joined within `timeout` seconds or killed, so a hang fails the test.
    """
    out = tmp_path / f"dist-{world_size}"
    out.mkdir(parents=True, exist_ok=True)
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(fn, r, world_size, port, str(out), args))
             for r in range(world_size)]
    for p in procs:
        p.start()
    try:
        for p in procs:
            p.join(timeout)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    results = []
    for r in range(world_size):
        path = out / f"rank{r}.pt"
        assert path.exists(), f"rank {r} produced no result (timeout or crash)"
        record = torch.load(path, weights_only=False)
        assert "error" not in record, record.get("error")
        results.append(record["ok"])
    return results


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


def last_json(result: subprocess.CompletedProcess):
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="session")
def demo_root(tmp_path_factory) -> Path:
    from ddp_cli.data.demo import ensure_demo

    return ensure_demo(tmp_path_factory.mktemp("demo") / "demo")


@pytest.fixture(scope="session")
def demo_registry(demo_root: Path, tmp_path_factory) -> Path:
    """A registry whose `demo` points at the session's demo copy (built once)."""
    folder = tmp_path_factory.mktemp("registry")
    return write_registry(folder, [{"name": "demo", "layout": "imagenet-loc",
                                    "generator": "sklearn-digits",
                                    "storage": {"driver": "FileSystem", "path": str(demo_root)}}])
