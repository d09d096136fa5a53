"""Gloo worker processes on loopback: the one harness benches and tests share.

`run_workers(fn, world_size, *args)` spawns `world_size` processes
(torch.multiprocessing, "spawn"), each joining a gloo group over 127.0.0.1
with `threads` intra-op threads, runs `fn(rank, world_size, *args)` and
returns every rank's result, in rank order. Results travel pickled by value
(tensors included), so nothing depends on a process that has exited. Every
process is joined within `timeout` seconds or killed; a failure in any rank is
raised as one line naming the rank (the whole traceback with `--verbose`).
"""

from __future__ import annotations

import logging
import os
import pickle
import queue
import socket
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ddp_cli.errors import DdpError

TIMEOUT_S = 900
log = logging.getLogger("ddp")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(fn: Callable, rank: int, world_size: int, threads: int, port: int,
               results: Any, timeout_s: float, backend: str, args: tuple) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      GLOO_SOCKET_IFNAME="lo")
    torch.set_num_threads(threads)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world_size, timeout=timedelta(seconds=timeout_s))
        results.put((rank, "ok", pickle.dumps(fn(rank, world_size, *args))))
    except BaseException as e:  # reported to the parent, which raises it as one line
        results.put((rank, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_workers(fn: Callable, world_size: int, *args: Any, threads: int = 1,
                timeout: float = TIMEOUT_S, backend: str = "gloo") -> list[Any]:
    """Every rank's return value of `fn(rank, world_size, *args)`, run in `world_size` gloo processes
    (`backend="nccl"`: NCCL ones, rank r on GPU r).

    `fn` must be a module-level function (spawned processes import it).
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, daemon=True,
                         args=(fn, r, world_size, threads, port, results, timeout, backend, args))
             for r in range(world_size)]
    for p in procs:
        p.start()
    deadline, outcome = time.monotonic() + timeout, {}
    try:
        while len(outcome) < world_size:
            try:
                rank, status, value = results.get(timeout=max(0.1, min(5.0, deadline - time.monotonic())))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if not p.is_alive() and r not in outcome]
                if dead or time.monotonic() > deadline:
                    why = (f"rank {dead[0]} exited without a result" if dead
                           else f"timed out after {timeout:.0f} s")
                    raise DdpError(f"loopback workers: {why}") from None
                continue
            if status == "error":
                log.debug("rank %d failed:\n%s", rank, value)
                raise DdpError(f"loopback worker rank {rank} failed: {value.splitlines()[0]}")
            outcome[rank] = pickle.loads(value)
        for p in procs:
            p.join(max(1.0, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    return [outcome[r] for r in range(world_size)]
