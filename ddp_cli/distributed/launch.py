"""Starting workers through torch's elastic agent (the engine behind torchrun).

The agent runs `python -m ddp_cli.distributed.worker JOB_DIR` once per local
worker, sets RANK/WORLD_SIZE/MASTER_* for each, rendezvouses with the other
nodes (c10d), and when one worker fails it stops the rest at once, so nobody
waits on a dead peer. We then name the original failure and its exit code.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from ddp_cli.config import DistributedConfig
from ddp_cli.distributed.worker import LAUNCHED
from ddp_cli.errors import INTERNAL, SIGINT, SIGTERM, ConfigError, WorkerFailed
from ddp_cli.jobs import clear_errors, first_error


@dataclass
class LaunchOptions:
    """The command-line side of a launch; None means "take it from the config"."""

    nproc_per_node: int | None = None
    nnodes: int = 1
    node_rank: int = 0
    rdzv_endpoint: str | None = None
    rdzv_id: str | None = None
    max_restarts: int | None = None
    verbose: bool = False


def external_launcher() -> bool:
    """True inside torchrun/another elastic agent: run in-process, never launch twice."""
    return "TORCHELASTIC_RUN_ID" in os.environ or (
        "RANK" in os.environ and "WORLD_SIZE" in os.environ
    )


def resolve_nproc(opts: LaunchOptions, cfg: DistributedConfig) -> int:
    """--nproc-per-node, else the config; "auto" = one per visible GPU, else cpu_workers."""
    requested = opts.nproc_per_node or cfg.nproc_per_node
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if requested == "auto":
        return gpus or cfg.cpu_workers
    if cfg.backend == "nccl" and requested > gpus:
        raise ConfigError(f"--nproc-per-node {requested}: only {gpus} CUDA devices for backend nccl")
    return requested


def launch(job_dir: Path, nproc: int, opts: LaunchOptions, cfg: DistributedConfig) -> None:
    """Run the job on `nproc` local workers; raise `WorkerFailed` with the original exit code."""
    multi_node = opts.nnodes > 1
    if multi_node and not opts.rdzv_endpoint:
        raise ConfigError("--nnodes > 1 needs --rdzv-endpoint HOST:PORT (the same on every node)")
    config = LaunchConfig(
        min_nodes=opts.nnodes,
        max_nodes=opts.nnodes,
        nproc_per_node=nproc,
        run_id=opts.rdzv_id or uuid.uuid4().hex,
        rdzv_backend="c10d",
        rdzv_endpoint=opts.rdzv_endpoint or "127.0.0.1:0",
        rdzv_configs={"is_host": opts.node_rank == 0} if multi_node else {},
        max_restarts=cfg.max_restarts if opts.max_restarts is None else opts.max_restarts,
        monitor_interval=0.1,
    )
    logging.getLogger("torch.distributed").setLevel(logging.INFO if opts.verbose else logging.CRITICAL)
    clear_errors(job_dir)
    os.environ[LAUNCHED] = "1"  # workers leave the printing of errors to us
    try:
        elastic_launch(config, sys.executable)("-m", "ddp_cli.distributed.worker", str(job_dir))
    except ChildFailedError as e:
        raise failure(job_dir, e) from None
    except SignalException as e:  # the agent has already passed the signal on to the workers
        code = SIGINT if e.sigval == signal.SIGINT else SIGTERM
        raise WorkerFailed(f"interrupted by {signal.Signals(e.sigval).name}", code) from None


def failure(job_dir: Path, err: ChildFailedError) -> WorkerFailed:
    """The original failure: the earliest error a worker recorded, else the first that died."""
    recorded = first_error(job_dir)
    if recorded:
        return WorkerFailed(recorded["message"], recorded["exit_code"])
    rank, proc = min(err.failures.items(), key=lambda kv: kv[1].timestamp)
    if proc.exitcode < 0:
        return WorkerFailed(f"worker rank {rank} was killed by {proc.signal_name()}", INTERNAL)
    return WorkerFailed(f"worker rank {rank} exited with code {proc.exitcode}", proc.exitcode)
