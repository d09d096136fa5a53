"""`ddp bench allreduce`: gloo all-reduce bandwidth for gradient-sized buffers vs a local copy.

Two processes on loopback all-reduce (sum) fp32 buffers of each size; the
same process times `dst.copy_(src)` of the same size, the most a single
machine's memory can move. Algorithmic bandwidth = buffer bytes / seconds per
all-reduce (what a gradient of that size sees); a ring all-reduce moves
2(N-1)/N of the buffer through each link, which is 1x for N = 2.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from ddp_cli.bench.data import machine
from ddp_cli.run.loopback import run_workers

MB = 2**20


def _timed(fn, repeats: int) -> float:
    fn()  # warm-up: connections, page faults
    started = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - started) / repeats


def repeats_for(size_mb: float, budget_mb: float) -> int:
    return max(3, int(budget_mb / size_mb))


def _allreduce_worker(rank: int, world_size: int, sizes_mb: list[float], budget_mb: float) -> list | None:
    rows = []
    for size in sizes_mb:
        n, repeats = int(size * MB) // 4, repeats_for(size, budget_mb)
        buf = torch.ones(n)
        dist.barrier()
        reduce_s = _timed(lambda b=buf: dist.all_reduce(b), repeats)
        src, dst = torch.ones(n), torch.empty(n)
        copy_s = _timed(lambda s=src, d=dst: d.copy_(s), repeats)
        rows.append({"size_mb": size, "repeats": repeats, "allreduce_ms": reduce_s * 1e3,
                     "allreduce_gb_s": n * 4 / reduce_s / 1e9, "copy_ms": copy_s * 1e3,
                     "copy_gb_s": n * 4 / copy_s / 1e9, "ratio": copy_s / reduce_s})
    return None if rank else rows


def bench_allreduce(sizes_mb: list[float], world_size: int = 2, threads: int = 1,
                    budget_mb: float = 512) -> dict:
    """All-reduce vs copy for each size; repeats per size = max(3, budget_mb / size)."""
    rows = run_workers(_allreduce_worker, world_size, sizes_mb, budget_mb, threads=threads)[0]
    return {
        "bench": "allreduce",
        "backend": "gloo",
        "world_size": world_size,
        "threads_per_worker": threads,
        "dtype": "float32",
        "machine": machine(),
        "rows": rows,
        "ratio_largest": rows[-1]["ratio"],
    }
