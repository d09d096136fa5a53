"""`ddp env`: this machine, and what "auto" picks on it."""

from __future__ import annotations

from typing import Any

from ddp_cli.config import RunConfig, TrainConfig
from ddp_cli.errors import ConfigError


def env() -> dict[str, Any]:
    """`ddp env`: this machine (`envinfo.machine`) and what "auto" picks on it."""
    from ddp_cli.cli.envinfo import machine

    return {**machine(), **auto_choices()}


def auto_choices() -> dict[str, Any]:
    """What `ddp train` with `precision`, `backend` and `nproc_per_node` "auto" (and no flags) starts
    here, through the function it calls (`launch_workers`), so the two agree by construction."""
    from ddp_cli.preflight import launch_workers
    from ddp_cli.run.launch import LaunchOptions, with_environment

    cfg = RunConfig(train=TrainConfig(precision="auto"))  # distributed.* are "auto" by default
    try:
        workers = launch_workers(cfg, with_environment(LaunchOptions()))
    except ConfigError as e:  # e.g. SLURM promising more GPUs than this node shows
        return {"precision_auto": None, "backend_auto": None, "nproc_per_node_auto": None,
                "auto_refused": str(e)}
    return {"precision_auto": workers.native_precision, "backend_auto": workers.backend,
            "nproc_per_node_auto": workers.nproc}
