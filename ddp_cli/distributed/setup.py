"""One worker's place in the world: backend, device, process group, threads, seeds."""

from __future__ import annotations

import os
import random
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from ddp_cli.distributed.gpus import gpu_problem, torch_sees_gpus
from ddp_cli.errors import ConfigError


@dataclass(frozen=True)
class DistContext:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device
    backend: str

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def cuda_devices() -> int:
    """CUDA devices this process sees (0 without CUDA), counted without initialising CUDA (torch counts
    through NVML before its first CUDA call); torch's warning of a driver too old is left to
    `gpus.gpu_problem`, which names the fix."""
    return torch.cuda.device_count() if torch_sees_gpus() else 0


def choose_backend(requested: str, gpus: int, local_world_size: int) -> str:
    """gloo, or nccl with one CUDA device per local worker; auto = nccl where GPUs are, else gloo.

    The one rule for workers and GPUs, met by preflight and again by each worker:
    auto on a node with fewer GPUs than workers is refused, not quietly run on CPU.
    """
    if requested == "gloo" or (requested == "auto" and not gpus):
        return "gloo"
    if local_world_size <= gpus:
        return "nccl"
    fewer = f"--nproc-per-node {gpus} or " if gpus else ""
    raise ConfigError(
        f"distributed.backend = {requested!r}: nccl needs one CUDA device per worker and this node has "
        f"{gpus} for {local_world_size} workers; use {fewer}distributed.backend = \"gloo\" "
        "to train on CPU"
    )


def check_gpus_usable(requested: str) -> None:
    """Refuse a backend that may pick GPUs on a node whose GPUs torch cannot use: "auto" would
    otherwise train on the CPU without a word (a driver older than torch's CUDA, a CPU wheel)."""
    problem = gpu_problem() if requested != "gloo" else None
    if problem:
        raise ConfigError(f"distributed.backend = {requested!r}: {problem}; or set distributed.backend = "
                          '"gloo" to train on the CPU regardless')


def choose_device(backend: str, local_rank: int) -> torch.device:
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def queued_copy(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A tensor the host made (a mask, restored state) on `device` without the host waiting: a GPU copies
    asynchronously only from pinned memory (from pageable memory `non_blocking` is a blocking copy)."""
    if device.type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


def threads_per_worker(local_world_size: int) -> int:
    """OMP_NUM_THREADS if set (by the user, or an external torchrun), else this machine's
    cores split evenly among its workers (at least one each)."""
    if os.environ.get("OMP_NUM_THREADS", "").isdigit() and int(os.environ["OMP_NUM_THREADS"]) > 0:
        return int(os.environ["OMP_NUM_THREADS"])
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, (cores or 1) // max(1, local_world_size))


def env_int(name: str, default: int) -> int:
    return int(os.environ.get(name, default))


def setup(backend: str = "auto", timeout_s: int = 600) -> DistContext:
    """Join the process group described by torchrun's environment variables."""
    rank, world_size = env_int("RANK", 0), env_int("WORLD_SIZE", 1)
    local_rank, local_world = env_int("LOCAL_RANK", 0), env_int("LOCAL_WORLD_SIZE", 1)
    backend = choose_backend(backend, cuda_devices(), local_world)
    device = choose_device(backend, local_rank)
    if device.type == "cpu":
        torch.set_num_threads(threads_per_worker(local_world))
    if not dist.is_initialized():
        timeout = timedelta(seconds=timeout_s)
        dist.init_process_group(
            backend=backend,
            store=agent_store(world_size, timeout),
            rank=rank,
            world_size=world_size,
            timeout=timeout,
            device_id=device if device.type == "cuda" else None,
        )
    return DistContext(rank, world_size, local_rank, local_world, device, backend)


WORKER_GROUP = "DDP_WORKER_GROUP"  # the name ddp's launcher gives each group it starts (`run.rendezvous`)
ROUNDS = "DDP_RENDEZVOUS_ROUNDS"  # the rendezvous this node's launcher has completed: over 1, a restart


def agent_store(world_size: int, timeout: timedelta) -> dist.Store | None:
    """A client of the elastic agent's store, under a prefix of its own for each group of workers.

    The agent keeps one TCPStore for the whole job and torch's env:// join adds
    no per-group prefix, so the workers of a restarted group could read the
    dead group's addresses (gloo then connects to a closed port: "Connection
    refused", or hangs). `group_prefix` names the group. None outside an
    elastic agent: env:// as usual.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != str(True):
        return None
    store = dist.TCPStore(os.environ["MASTER_ADDR"], env_int("MASTER_PORT", 0), world_size,
                          is_master=False, timeout=timeout)
    return dist.PrefixStore(group_prefix(world_size, os.environ), store)


def group_prefix(world_size: int, env: Mapping[str, str]) -> str:
    """The keys of this group of workers: the name ddp's launcher gave the group (the same on every
    node of it), else (under another agent: torchrun) its restart count and world size, which can
    differ between nodes after a node is lost (`run.rendezvous`)."""
    if env.get(WORKER_GROUP):
        return f"ddp/group-{env[WORKER_GROUP]}"
    return f"ddp/attempt-{env.get('TORCHELASTIC_RESTART_COUNT', 0)}-{world_size}"


def seed_everything(seed: int, deterministic: bool = False) -> None:
    """The same seed on every rank: identical initial weights before DDP's broadcast."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False
    elif torch.cuda.is_available():
        torch.backends.cudnn.benchmark = True


def teardown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
