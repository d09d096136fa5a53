"""`ddp bench scaling`: images/s of ddp's step at world size 1 and N, same per-worker batch and threads.

Weak scaling, as data-parallel training is used: each worker keeps its batch,
so N workers process N times the images per step if nothing is lost.
Efficiency = ips_N / (N * ips_1). On one machine the N workers also share its
memory bandwidth and caches, so this measures gloo's all-reduce plus that
contention; the breakdown at world size N says how much of a step is
all-reduce that backward did not hide.
"""

from __future__ import annotations

from ddp_cli.bench.step import CPU, StepSpec, breakdown, step_header, time_ddp
from ddp_cli.run.loopback import run_workers
from ddp_cli.train.precision import native_precision


def _scaling_worker(rank: int, world_size: int, spec: StepSpec, precision: str,
                    with_breakdown: bool) -> dict | None:
    seconds = time_ddp(spec, precision, True)
    parts = breakdown(spec, precision, True) if with_breakdown else None
    return None if rank else {"seconds": seconds, "breakdown": parts}


def bench_scaling(spec: StepSpec, world_size: int = 2, threads: int = 1) -> dict:
    """ddp's default step at world size 1 and `world_size`, `threads` threads per worker.

    The two alternate over `spec.rounds` (fresh workers each time), so background
    load on the machine hits both alike; the breakdown is taken in the last round.
    """
    precision = native_precision(CPU)
    worlds = (1, world_size)
    seconds, parts = dict.fromkeys(worlds, 0.0), None
    for r in range(spec.rounds):
        for world in worlds:
            last = r == spec.rounds - 1 and world > 1
            out = run_workers(_scaling_worker, world, spec, precision, last, threads=threads)[0]
            seconds[world] += out["seconds"]
            parts = out["breakdown"] or parts
    rows = []
    for world in worlds:
        images = spec.rounds * spec.steps * spec.batch_size * world
        rows.append({"world_size": world, "images": images, "seconds": seconds[world],
                     "images_per_second": images / seconds[world],
                     "step_ms": seconds[world] / (spec.rounds * spec.steps) * 1e3})
    one, many = rows[0]["images_per_second"], rows[1]["images_per_second"]
    return {
        **step_header("scaling", spec, world_size, threads),
        "precision": precision,
        "channels_last": True,
        "rows": rows,
        "efficiency": many / (world_size * one),
        "breakdown": parts,
        "exposed_allreduce_share": parts["exposed_allreduce_ms"] / parts["step_ms"],
    }
