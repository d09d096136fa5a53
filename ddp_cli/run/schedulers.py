"""Which scheduler started this `ddp train`, and what its environment says about the launch.

One table, read top to bottom, the first row whose variables are there wins:

- torchrun: TORCHELASTIC_RUN_ID (torchrun's workers, which is how Kubeflow Trainer v2, TorchX and
  `srun torchrun` start ddp), or RANK and WORLD_SIZE without Kubeflow's PET_ variables (processes
  started by hand, env://). ddp trains in-process, as that agent's worker.
- kubeflow: PET_NNODES, PET_NPROC_PER_NODE (PET_N_PROC_PER_NODE before training operator 1.7),
  PET_NODE_RANK, PET_RDZV_ENDPOINT or PET_MASTER_ADDR: a PyTorchJob pod whose command is `ddp
  train`. ddp launches the pod's workers; the pod-level RANK/WORLD_SIZE count pods, not processes.
- slurm: SLURM_JOB_ID and SLURM_NNODES, one `ddp train` per node (`srun --ntasks-per-node=1`).
  ddp launches the node's workers.

The launch settings a row takes fill only what the command line left open (`with_environment`:
flags always win), and `ddp train --dry-run` shows the row and each variable it read.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from ddp_cli.errors import ConfigError

SLURM_RDZV_PORT = 29400  # SLURM names the hosts, not a port: torchrun's customary one, unless MASTER_PORT
KUBEFLOW_MARKS = ("PET_NNODES", "PET_NPROC_PER_NODE", "PET_N_PROC_PER_NODE", "PET_NODE_RANK",
                  "PET_RDZV_ENDPOINT", "PET_MASTER_ADDR")
AGENT_VARIABLES = ("TORCHELASTIC_RUN_ID", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
POD_NAME = re.compile(r"-(?:master|worker)-(\d+)$")  # a PyTorchJob pod's host name: <job>-worker-<index>


@dataclass(frozen=True)
class Scheduler:
    """The scheduler recognised (None: none), the launch settings it gives (LaunchOptions fields),
    the variables read (name -> value), and whether an agent already started this process."""

    name: str | None = None
    settings: dict[str, object] = field(default_factory=dict)
    took: dict[str, str] = field(default_factory=dict)
    in_process: bool = False

    def as_dict(self) -> dict[str, object]:
        return {"scheduler": self.name, "scheduler_variables": self.took}


def recognise(env: Mapping[str, str]) -> Scheduler:
    """The first row of the table whose variables `env` holds."""
    if under_agent(env):
        return Scheduler("torchrun", {}, read(env, AGENT_VARIABLES), in_process=True)
    if any(name in env for name in KUBEFLOW_MARKS):
        return kubeflow_job(env)
    if "SLURM_JOB_ID" in env and "SLURM_NNODES" in env:
        return slurm_job(env)
    return Scheduler()


def under_agent(env: Mapping[str, str]) -> bool:
    """Whether an agent (torchrun) started this process as one of its workers: the table's first row."""
    kubeflow = any(name in env for name in KUBEFLOW_MARKS)
    return "TORCHELASTIC_RUN_ID" in env or ("RANK" in env and "WORLD_SIZE" in env and not kubeflow)


def nodes(spec: str, source: str = "--nnodes") -> dict[str, int | None]:
    """`N` or `MIN:MAX` (torchrun's spelling, also PET_NNODES's) as nnodes and min_nodes."""
    parts = spec.split(":")
    if len(parts) > 2 or not all(p.isdigit() for p in parts) or not 1 <= int(parts[0]) <= int(parts[-1]):
        raise ConfigError(f"{source} {spec}: expected N or MIN:MAX with 1 <= MIN <= MAX, e.g. 2 or 1:2")
    return {"nnodes": int(parts[-1]), "min_nodes": int(parts[0]) if len(parts) == 2 else None}


def read(env: Mapping[str, str], names: tuple[str, ...]) -> dict[str, str]:
    return {name: env[name] for name in names if name in env}


def first(env: Mapping[str, str], *names: str) -> tuple[str, str] | None:
    """The first of `names` that `env` sets, and its value."""
    return next(((name, env[name]) for name in names if env.get(name, "") != ""), None)


def number(variable: str, value: str) -> int:
    if not value.isdigit():
        raise ConfigError(f"{variable}={value!r}: expected a whole number; fix the scheduler's "
                          "environment, or give the matching ddp train flag (flags win)")
    return int(value)


def kubeflow_job(env: Mapping[str, str]) -> Scheduler:
    """A PyTorchJob pod (training operator v1) whose command is `ddp train`: one node of pods x
    processes, meeting at the elastic rendezvous (PET_RDZV_ENDPOINT) or the master pod."""
    took: dict[str, str] = {}

    def take(*names: str) -> str | None:
        found = first(env, *names)
        if found:
            took[found[0]] = found[1]
        return found[1] if found else None

    settings: dict[str, object] = {}
    backend = take("PET_RDZV_BACKEND")
    if backend not in (None, "c10d"):
        raise ConfigError(f"PET_RDZV_BACKEND={backend}: ddp's nodes meet at torch's c10d rendezvous; set the "
                          "PyTorchJob's elasticPolicy.rdzvBackend to c10d")
    if (spec := take("PET_NNODES")) is not None:
        settings.update(nodes(spec, "PET_NNODES"))
    elif (pods := take("WORLD_SIZE")) is not None:  # the master pod's job: WORLD_SIZE counts pods
        settings["nnodes"] = number("WORLD_SIZE", pods)
    if rank := first(env, "PET_NODE_RANK", "RANK") or pod_index(env):
        took[rank[0]] = rank[1]
        settings["node_rank"] = number(*rank)
    elif settings.get("nnodes", 1) != 1:
        raise ConfigError("Kubeflow: cannot tell this pod's index (no PET_NODE_RANK, RANK or a HOSTNAME "
                          "ending in -worker-N); set PET_NODE_RANK in the pod, or pass --node-rank")
    if (endpoint := take("PET_RDZV_ENDPOINT")) is not None:
        settings["rdzv_endpoint"] = endpoint
    elif (host := take("PET_MASTER_ADDR", "MASTER_ADDR")) is not None:
        port = take("PET_MASTER_PORT", "MASTER_PORT")
        if port is None:
            raise ConfigError(f"Kubeflow: {host} is the master pod but no PET_MASTER_PORT or MASTER_PORT "
                              "says its port; set one, or pass --rdzv-endpoint HOST:PORT")
        settings["rdzv_endpoint"] = f"{host}:{number('MASTER_PORT', port)}"
    if (job := take("PET_RDZV_ID")) is not None:
        settings["rdzv_id"] = job
    if (nproc := take("PET_NPROC_PER_NODE", "PET_N_PROC_PER_NODE")) is not None and nproc.isdigit():
        settings["nproc_per_node"] = int(nproc)  # "auto", "gpu", "cpu": ddp's own nproc_per_node "auto"
    if (restarts := take("PET_MAX_RESTARTS")) is not None:
        settings["max_restarts"] = number("PET_MAX_RESTARTS", restarts)
    return Scheduler("kubeflow", settings, took)


def pod_index(env: Mapping[str, str]) -> tuple[str, str] | None:
    """An elastic PyTorchJob's worker pods have no RANK: their host name ends in their index."""
    match = POD_NAME.search(env.get("HOSTNAME", ""))
    return ("HOSTNAME", match.group(1)) if match else None


def slurm_job(env: Mapping[str, str]) -> Scheduler:
    """One `ddp train` per node (`srun --ntasks-per-node=1`): the nodes, this one's rank, and the
    first host of the job as the rendezvous, at MASTER_PORT where the batch script sets one."""
    names = ("SLURM_JOB_ID", "SLURM_NNODES", "SLURM_NODEID", "SLURM_JOB_NODELIST", "SLURM_NODELIST",
             "SLURM_GPUS_ON_NODE", "MASTER_PORT")
    took = read(env, names)
    settings: dict[str, object] = {
        "nnodes": number("SLURM_NNODES", env["SLURM_NNODES"]),
        "node_rank": number("SLURM_NODEID", env.get("SLURM_NODEID", "0")),
        "rdzv_id": f"slurm-{env['SLURM_JOB_ID']}",
    }
    hosts = expand_nodelist(env.get("SLURM_JOB_NODELIST", env.get("SLURM_NODELIST", "")))
    if hosts:
        port = number("MASTER_PORT", env["MASTER_PORT"]) if "MASTER_PORT" in env else SLURM_RDZV_PORT
        settings["rdzv_endpoint"] = f"{hosts[0]}:{port}"
    if env.get("SLURM_GPUS_ON_NODE", "").isdigit():
        settings["nproc_per_node"] = int(env["SLURM_GPUS_ON_NODE"])
    return Scheduler("slurm", settings, took)


def expand_nodelist(nodelist: str) -> list[str]:
    """`gpu[01-03,07],cpu1` -> gpu01 gpu02 gpu03 gpu07 cpu1 (SLURM's compressed host lists)."""
    hosts: list[str] = []
    for prefix, ranges, plain in re.findall(r"([^,\[]+)\[([^\]]+)\]|([^,\[\]]+)", nodelist):
        if plain:
            hosts.append(plain)
            continue
        for part in ranges.split(","):
            first_, _, last = part.partition("-")
            for n in range(int(first_), int(last or first_) + 1):
                hosts.append(f"{prefix}{n:0{len(first_)}d}")
    return hosts
