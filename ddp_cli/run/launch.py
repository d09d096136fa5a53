"""Starting workers through torch's elastic agent (the engine behind torchrun).

The agent runs `python -m ddp_cli.run.worker JOB_DIR` once per local
worker, sets RANK/WORLD_SIZE/MASTER_* for each, rendezvouses with the other
nodes (c10d), and when one worker fails it stops the rest at once, so nobody
waits on a dead peer. We then name the original failure and its exit code.
Each worker's output also goes to JOB_DIR/logs (`run.logs`).
"""

from __future__ import annotations

import contextlib
import os
import resource
import signal
import sys
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError, RendezvousError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from ddp_cli.config import DistributedConfig
from ddp_cli.distributed.setup import cuda_devices
from ddp_cli.distributed.signals import CODES
from ddp_cli.errors import INTERNAL, PEER_LOST, ConfigError, DataError, WorkerFailed, summary
from ddp_cli.run import rendezvous
from ddp_cli.run.interrupts import AGENT_SIGNALS, handled
from ddp_cli.run.jobs import clear_errors, first_error
from ddp_cli.run.logenv import quiet_torch_logs
from ddp_cli.run.logs import RankLogs
from ddp_cli.run.nccl_abort import read_abort
from ddp_cli.run.network import gloo_environment
from ddp_cli.run.schedulers import nodes, recognise
from ddp_cli.run.worker import LAUNCHED, forked


@dataclass
class LaunchOptions:
    """The command-line side of a launch; None means "take it from the config"."""

    nproc_per_node: int | None = None
    nnodes: int = 1  # the most nodes; with min_nodes below it, membership is elastic
    node_rank: int = 0
    rdzv_endpoint: str | None = None
    rdzv_id: str | None = None
    max_restarts: int | None = None
    min_nodes: int | None = None  # None: exactly nnodes

    @staticmethod
    def nodes(spec: str) -> dict[str, int | None]:
        """`--nnodes N` or `--nnodes MIN:MAX` as nnodes and min_nodes (`schedulers.nodes`)."""
        return nodes(spec)


def master_endpoint(addr: str | None, port: int | None, rdzv_endpoint: str | None) -> str | None:
    """The rendezvous endpoint from torchrun's --master-addr/--master-port, else --rdzv-endpoint (the
    job id every node derives alike from it when --rdzv-id is not given: `run.launch.run_id`)."""
    if addr is None and port is None:
        return rdzv_endpoint
    if addr is None or port is None:
        given, missing = ("--master-addr", "--master-port") if port is None else \
            ("--master-port", "--master-addr")
        raise ConfigError(f"{given} needs {missing} too (the two together are --rdzv-endpoint HOST:PORT); "
                          "give both, or --rdzv-endpoint HOST:PORT alone")
    if rdzv_endpoint:
        raise ConfigError(f"--master-addr/--master-port and --rdzv-endpoint {rdzv_endpoint} both name the "
                          "rendezvous; give only one of them")
    host = f"[{addr}]" if ":" in addr and not addr.startswith("[") else addr  # IPv6
    return f"{host}:{port}"


def standalone_checked(opts: LaunchOptions) -> LaunchOptions:
    """--standalone (torchrun's flag): this node alone with a local rendezvous, which is what ddp
    does without --nnodes; refused with the flags of a multi-node job."""
    if opts.nnodes > 1 or opts.rdzv_endpoint:
        given = f"--nnodes {opts.nnodes}" if opts.nnodes > 1 else f"--rdzv-endpoint {opts.rdzv_endpoint}"
        raise ConfigError(f"--standalone means this node alone, meeting at a local rendezvous; {given} "
                          "contradicts it: drop one of the two")
    return opts


def external_launcher() -> bool:
    """True inside torchrun/another elastic agent (`schedulers`): run in-process, never launch twice."""
    return recognise(os.environ).in_process


def with_environment(opts: LaunchOptions, env: Mapping[str, str] | None = None) -> LaunchOptions:
    """Fill what the command line left open from the scheduler's variables (flags always win)."""
    defaults = recognise(os.environ if env is None else env).settings
    given = {k: v for k, v in vars(opts).items() if v != getattr(LaunchOptions(), k)}
    return LaunchOptions(**{**vars(LaunchOptions()), **defaults, **given})


def resolve_nproc(opts: LaunchOptions, cfg: DistributedConfig) -> int:
    """--nproc-per-node, else the config; "auto" = one per visible GPU, else cpu_workers.

    Whether this node can hold that many is `choose_backend`'s rule (preflight).
    """
    requested = opts.nproc_per_node or cfg.nproc_per_node
    if requested == "auto":
        return cuda_devices() or cfg.cpu_workers
    return requested


def check_rendezvous(opts: LaunchOptions, cfg: DistributedConfig) -> None:
    """Nodes can only meet at an endpoint they all know; an elastic job goes on only by restarting."""
    if opts.nnodes > 1 and not opts.rdzv_endpoint:
        raise ConfigError("--nnodes > 1 needs --rdzv-endpoint HOST:PORT (the same on every node)")
    restarts = cfg.max_restarts if opts.max_restarts is None else opts.max_restarts
    if opts.min_nodes is not None and opts.min_nodes < opts.nnodes and not restarts:
        raise ConfigError(f"--nnodes {opts.min_nodes}:{opts.nnodes}: the survivors of a lost node go on by "
                          "restarting; add --max-restarts K (e.g. 3) or set distributed.max_restarts")


def run_id(opts: LaunchOptions) -> str:
    """--rdzv-id, else one every node derives alike from the endpoint they share (a random id per
    node would keep them from ever meeting), else a fresh one for a single node."""
    if opts.rdzv_id:
        return opts.rdzv_id
    return f"ddp-{opts.rdzv_endpoint}" if opts.rdzv_endpoint else uuid.uuid4().hex


WORKER_START = "DDP_WORKER_START"


def single_threaded() -> None:
    """The launcher computes nothing heavy: one thread keeps its OpenMP pool unstarted, which is
    what makes forking workers from it safe (`worker_start`). Called before its first torch op."""
    torch.set_num_threads(1)


def worker_start() -> str:
    """Fork the workers from this launcher where that is safe, else spawn them afresh.

    A forked worker starts with torch, torchvision and ddp imported, so it
    skips the seconds of imports a spawned one pays. Forking is
    unsafe after CUDA was initialised (the driver is not fork-safe; counting GPUs
    initialises it) and after a parallel OpenMP region ran (the child's first
    parallel region then hangs; `single_threaded` prevents that). So: fork where
    this node has no GPU and the launcher is single-threaded, spawn elsewhere or
    when $DDP_WORKER_START = spawn.
    """
    if os.environ.get(WORKER_START) == "spawn" or cuda_devices() or torch.get_num_threads() != 1:
        return "spawn"
    return "fork"


def launch(job_dir: Path, nproc: int, opts: LaunchOptions, cfg: DistributedConfig) -> str:
    """Run the job on `nproc` local workers; how they were started (`worker_start`). Raises
    `WorkerFailed` with the original exit code.

    The options were checked by preflight (`check_rendezvous`, `choose_backend`).
    """
    hosts = opts.node_rank == 0  # node 0 hosts the rendezvous store; the others connect to it
    logs = RankLogs(job_dir / "logs", sys.stderr.isatty())  # `validate`: a temporary folder
    config = LaunchConfig(
        min_nodes=opts.min_nodes or opts.nnodes,
        max_nodes=opts.nnodes,
        nproc_per_node=nproc,
        run_id=run_id(opts),
        rdzv_backend=rendezvous.BACKEND,  # torch's c10d, naming each group alike on every node
        rdzv_endpoint=opts.rdzv_endpoint or "127.0.0.1:0",
        rdzv_configs={"is_host": hosts, "read_timeout": cfg.rdzv_timeout_s,
                      "join_timeout": cfg.rdzv_timeout_s, "last_call_timeout": cfg.rdzv_last_call_s},
        max_restarts=cfg.max_restarts if opts.max_restarts is None else opts.max_restarts,
        monitor_interval=0.1,
        shutdown_timeout=cfg.stop_grace_s,
        start_method=worker_start(),
        logs_specs=logs,
        signals_to_handle=AGENT_SIGNALS,  # SIGINT and SIGTERM are ours (`run.interrupts`)
        # torch starts each teed line with the template, rendered per worker; with an empty role it
        # renders empty, so the console reads as it would without the files
        role="",
        log_line_prefix_template="${role_name}",
    )
    quiet_torch_logs()
    rendezvous.register()
    more_open_files()
    clear_errors(job_dir)
    os.environ[LAUNCHED] = "1"  # workers leave the printing of errors to us
    os.environ.update(gloo_environment(opts.nnodes, opts.rdzv_endpoint, os.environ))  # the workers inherit it
    try:
        with handled(cfg.stop_grace_s) as interrupts:
            if config.start_method == "fork":
                elastic_launch(config, forked)(str(job_dir))
            else:
                elastic_launch(config, sys.executable)("-m", "ddp_cli.run.worker", str(job_dir))
        return config.start_method
    except ChildFailedError as e:
        raise failure(job_dir, e, logs.stderr_files) from None
    except SignalException as e:  # the agent has already passed the signal on to the workers
        raise stopped(job_dir, e.sigval, interrupts.aborted) from None
    except RendezvousError as e:
        raise rendezvous_failure(e, opts.rdzv_endpoint, hosts, cfg.rdzv_timeout_s) from None


def stopped(job_dir: Path, signum: int, aborted: int) -> WorkerFailed:
    """A run ended by a signal (exit 130/143): the workers' own account of their stop (the checkpoint
    that resumes it), or the abort that killed them before it (`run.interrupts`)."""
    if aborted:
        return WorkerFailed(f"aborted by a third {signal.Signals(aborted).name}: the workers were killed "
                            "before their stop checkpoint; the same command resumes from the last checkpoint "
                            "written before, if any", CODES[aborted])
    code = CODES[signum]
    recorded = first_error(job_dir)
    message = recorded["message"] if recorded and recorded["exit_code"] == code else \
        f"interrupted by {signal.Signals(signum).name}"
    return WorkerFailed(message, code)


def more_open_files() -> None:
    """The soft limit on open files raised to the hard one, for this launcher and the workers it starts.

    A gloo worker keeps a socket per peer on top of ~60 fds of its own (`make test-scale`: up to 102 at
    world 32); at 512 ranks that is ~570, and more with a second group (the control group on GPUs),
    near the common default soft limit (1024), while the hard limit is usually far above (524288
    under systemd). Where it cannot be raised, it stays: the run goes on as before.
    """
    with contextlib.suppress(ValueError, OSError):
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or soft < hard):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def rendezvous_failure(err: RendezvousError, endpoint: str | None, hosts: bool,
                       timeout_s: float) -> ConfigError | DataError:
    """Node 0 that could not open its store is told why (the port, usually); any other node is asked
    whether node 0 is up, since a rendezvous that never completes looks the same from every node."""
    if endpoint and hosts and isinstance(err, RendezvousConnectionError):
        cause = str(err.__cause__ or err)
        why = "port in use" if "EADDRINUSE" in cause else cause.splitlines()[0]
        return ConfigError(f"--rdzv-endpoint {endpoint}: cannot host the rendezvous there ({why}); "
                           "pick a free port")
    inner = err.__cause__
    why = f"{type(err).__name__}: {summary(inner)}" if inner else type(err).__name__
    return DataError(f"--rdzv-endpoint {endpoint or '127.0.0.1'}: rendezvous failed within {timeout_s}s "
                     f"({why}); is every node up and the address reachable from here?")


# What a death by each signal most likely means; a worker's own log (logs/rank<N>.stderr.log) says more.
CRASHED = "a crash in native code: see its log"
SIGNAL_HINTS = {signal.SIGKILL: "the out-of-memory killer? see dmesg",
                signal.SIGABRT: "an abort in native code (torch, a CUDA library): see its log",
                signal.SIGBUS: "a bus error: most often /dev/shm full (df -h /dev/shm; docs/gpus.md, "
                               "\"Shared memory in containers\")"}


def failure(job_dir: Path, err: ChildFailedError, stderr_files: dict[int, Path]) -> WorkerFailed:
    """The original failure: an error a worker recorded, else a worker killed by a signal.

    Ranks that merely lost a peer record that too, but a death by signal (OOM
    killer, kill -9, segfault, NCCL's watchdog) explains their failure, so it
    comes first. SIGTERM is the agent's own way of closing the survivors and
    explains nothing. A SIGABRT is told apart by the rank's log (`stderr_files`
    by global rank): NCCL's watchdog says there why it took the rank down.
    """
    recorded = first_error(job_dir)
    if recorded and recorded["original"]:
        return WorkerFailed(recorded["message"], recorded["exit_code"])
    died = [(rank, proc) for rank, proc in err.failures.items()
            if proc.exitcode < 0 and proc.exitcode != -signal.SIGTERM]
    if died:
        rank, proc = min(died, key=lambda kv: kv[1].timestamp)
        log = stderr_files.get(rank)
        nccl = read_abort(log) if log and proc.exitcode == -signal.SIGABRT else None
        if nccl:
            return WorkerFailed(nccl.message(rank, log), nccl.exit_code)
        return WorkerFailed(f"worker rank {rank} was killed by {proc.signal_name()} "
                            f"({SIGNAL_HINTS.get(-proc.exitcode, CRASHED)})", PEER_LOST)
    if recorded:
        return WorkerFailed(recorded["message"], recorded["exit_code"])
    rank, proc = min(err.failures.items(), key=lambda kv: kv[1].timestamp)
    return WorkerFailed(f"worker rank {rank} exited with code {proc.exitcode}", proc.exitcode or INTERNAL)
