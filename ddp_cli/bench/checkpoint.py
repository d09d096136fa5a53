"""`ddp bench checkpoint`: what writing a checkpoint costs the step it follows.

Rank 0 writes (as each node's first worker does), and the next all-reduce
makes every rank wait for it, so a checkpoint written in the foreground
stalls the whole job for the write (serialise, sha256, fsync, three names).
Four ways are timed in the same gloo workers, on the Trainer's own step
and Checkpointer: no checkpoint (the baseline), `checkpoint.background =
false` (the write inside the step), `true` (a copy to CPU memory inside
the step, the write on a thread while the next steps run), and `s3`: as
`true` in a run dir in a bucket (`--run-dir s3://...`: rank 0's mirror
uploads each checkpoint on a thread of its own, to moto's S3 server on
loopback, run by the bench's own process; the row is left out where moto is
not installed). Each round times
`normal` steps, then one step followed by a save (the "checkpointing step",
until the loop may go on), then the step after it (which shares the CPU with
the writer). Ratios are against the mean normal step of the same mode.
"""

from __future__ import annotations

import logging
import os
import statistics
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch.distributed as dist

from ddp_cli.bench.step import CPU, StepSpec, ddp_trainer, step_header
from ddp_cli.run.bucket import RunBucket
from ddp_cli.run.loopback import run_workers
from ddp_cli.run.mirror import BucketMirror
from ddp_cli.train.checkpoint import Checkpointer, CheckpointStore
from ddp_cli.train.precision import native_precision

MODES = ("none", "foreground", "background", "s3")
BUCKET = "ddp-bench-checkpoints"
NORMAL = 3  # plain steps per round before the checkpointing one


def _timed_step(trainer, batches, save: bool) -> float:
    dist.barrier()
    started = time.perf_counter()
    trainer.train_step([(next(batches),)])
    trainer.state.step += 1
    if save:
        trainer.save()
    return time.perf_counter() - started


def time_mode(spec: StepSpec, precision: str, mode: str, folder: Path) -> dict[str, list[float]]:
    mirror = BucketMirror(RunBucket(f"s3://{BUCKET}/run"), folder / mode) \
        if mode == "s3" and dist.get_rank() == 0 else None
    store = None if mode == "none" else CheckpointStore(folder / mode / "checkpoints", 1, mirror=mirror)
    checkpointer = Checkpointer(store, writes=dist.get_rank() == 0, background=mode in ("background", "s3"))
    trainer = ddp_trainer(spec, precision, True, checkpointer=checkpointer)
    trainer.model.train()
    batches = iter(trainer.loaders.train)
    for _ in range(spec.warmup):
        trainer.train_step([(next(batches),)])
    times: dict[str, list[float]] = {"normal": [], "checkpointing": [], "after": []}
    for _ in range(spec.rounds):
        times["normal"] += [_timed_step(trainer, batches, False) for _ in range(NORMAL)]
        times["checkpointing"].append(_timed_step(trainer, batches, mode != "none"))
        times["after"].append(_timed_step(trainer, batches, False))
    checkpointer.close()
    return times


def _checkpoint_worker(rank: int, world_size: int, spec: StepSpec, precision: str,
                       modes: tuple[str, ...]) -> dict:
    with tempfile.TemporaryDirectory(prefix="ddp-bench-ckpt-") as tmp:
        measured = {mode: time_mode(spec, precision, mode, Path(tmp)) for mode in modes}
        sizes = [p.stat().st_size for p in Path(tmp).glob("*/*/step-*.pt")] if rank == 0 else []
    return {"times": measured, "checkpoint_mb": max(sizes, default=0) / 2**20}


def bench_checkpoint(spec: StepSpec, world_size: int = 2, threads: int = 1) -> dict:
    """Seconds per normal step, per checkpointing step and per step after it, for each mode."""
    precision = native_precision(CPU)
    spec = StepSpec(**{**spec.__dict__, "steps": spec.rounds * (NORMAL + 2)})  # the loader's length
    with loopback_s3() as s3:
        modes = MODES if s3 else MODES[:-1]
        out = run_workers(_checkpoint_worker, world_size, spec, precision, modes, threads=threads)[0]
    rows = []
    for mode, times in out["times"].items():
        normal = statistics.mean(times["normal"])
        checkpointing, after = statistics.mean(times["checkpointing"]), statistics.mean(times["after"])
        rows.append({"mode": mode, "normal_step_s": normal, "checkpointing_step_s": checkpointing,
                     "next_step_s": after, "checkpointing_vs_normal": checkpointing / normal,
                     "next_vs_normal": after / normal})
    ratio = {row["mode"]: row["checkpointing_vs_normal"] for row in rows}
    return {
        **step_header("checkpoint", spec, world_size, threads),
        "precision": precision,
        "checkpoint_mb": out["checkpoint_mb"],
        "rows": rows,
        "ratio_foreground": ratio["foreground"],
        "ratio_background": ratio["background"],
        "ratio_s3": ratio.get("s3"),
    }


@contextmanager
def loopback_s3() -> Iterator[bool]:
    """moto's S3 server on loopback with a bucket for the `s3` mode, its endpoint and fake credentials
    in this process's environment (the workers inherit it) while it runs; False where moto is missing."""
    try:
        import s3fs
        from moto.server import ThreadedMotoServer
    except ImportError:
        yield False
        return
    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # not a line per request on stderr
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    fake = {"AWS_ENDPOINT_URL": f"http://{host}:{port}", "AWS_ACCESS_KEY_ID": "bench",
            "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1"}
    saved = {name: os.environ.get(name) for name in fake}
    os.environ.update(fake)
    try:
        s3fs.S3FileSystem(client_kwargs={"endpoint_url": fake["AWS_ENDPOINT_URL"]},
                          skip_instance_cache=True).mkdir(BUCKET)
        yield True
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        server.stop()
