"""`ddp train` and its `--dry-run`: the run config and its index (built in a forked child while this
process imports torch), the checks, the run dir prepared, and the workers launched (by ddp's elastic
agent, or by an external torchrun); after a lost node, the command that goes on.
"""

from __future__ import annotations

import logging
import os
import shlex
import sys
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ddp_cli.cli.commands.run_dirs import bucket_of, default_run_dir, local_checkpoint, owned, run_location
from ddp_cli.config import RunConfig, load_config
from ddp_cli.data.index_build import IndexBuild
from ddp_cli.errors import PEER_LOST, DdpError, PeerLost, WorkerFailed
from ddp_cli.models.user_model import with_located_model
from ddp_cli.observe.startup import StartupClock
from ddp_cli.run.bucket import RunBucket, staging_folder
from ddp_cli.run.jobs import Job, prepare_job, read_result

if TYPE_CHECKING:
    from ddp_cli.preflight import Preflight, RunDir
    from ddp_cli.run.launch import LaunchOptions

log = logging.getLogger("ddp")


@dataclass(frozen=True)
class LaunchFlags:
    """`ddp train`'s launch flags as given (torchrun's included), before the environment fills in."""

    nproc_per_node: int | None = None
    nnodes: str = "1"
    node_rank: int = 0
    rdzv_endpoint: str | None = None
    rdzv_id: str | None = None
    max_restarts: int | None = None
    standalone: bool = False
    master_addr: str | None = None
    master_port: int | None = None

    def options(self) -> LaunchOptions:
        """The launch options: --master-addr/--master-port as the endpoint; --standalone checked
        against the rest, else SLURM's or Kubeflow's settings fill in what the flags left open."""
        from ddp_cli.run.launch import LaunchOptions, master_endpoint, standalone_checked, with_environment

        endpoint = master_endpoint(self.master_addr, self.master_port, self.rdzv_endpoint)
        opts = LaunchOptions(self.nproc_per_node, node_rank=self.node_rank, rdzv_endpoint=endpoint,
                             rdzv_id=self.rdzv_id, max_restarts=self.max_restarts,
                             **LaunchOptions.nodes(self.nnodes))
        return standalone_checked(opts) if self.standalone else with_environment(opts)


@contextmanager
def indexed(config: Path, overrides: list[str],
            registry: str | None) -> Iterator[tuple[RunConfig, IndexBuild]]:
    """The run config and its index, building in a process of its own while this one imports torch
    (under an external torchrun only rank 0 needs it; a Kubeflow pod's RANK counts pods: each needs it)."""
    from ddp_cli.run.schedulers import under_agent

    cfg = with_located_model(load_config(config, overrides), config)
    fork = not under_agent(os.environ) or os.environ.get("RANK", "0") == "0"
    with IndexBuild.begin(cfg, registry, fork=fork) as build:
        yield cfg, build


def train(config: Path, overrides: list[str], registry: str | None, run_dir: Path | str | None,
          flags: LaunchFlags, resume: str, quiet: bool) -> dict[str, Any]:
    """`ddp train`: the result of the run (empty on the ranks but 0 of an external torchrun)."""
    resume = local_checkpoint(resume, "--resume") if resume.startswith("s3:/") else resume
    with indexed(config, overrides, registry) as (cfg, build):
        run_dir, flag = chosen_run_dir(cfg, run_dir)
        return launch_training(cfg, build, run_dir, flag, flags.options(), resume, quiet)


def dry_run(config: Path, overrides: list[str], registry: str | None, run_dir: Path | str | None,
            flags: LaunchFlags, resume: str) -> dict[str, Any]:
    """`ddp train --dry-run`: the plan, after every check training makes before starting workers (the
    run dir's among them), going on from the checkpoint a resume in that run dir would take."""
    resume = local_checkpoint(resume, "--resume") if resume.startswith("s3:/") else resume
    with indexed(config, overrides, registry) as (cfg, build):
        location, flag = chosen_run_dir(cfg, run_dir)
        return plan(cfg, build, checked_run_dir(location, flag), flags.options(), resume, location)


def chosen_run_dir(cfg: RunConfig, given: Path | str | None) -> tuple[Path | str, str]:
    """The run dir (`--run-dir`, else `checkpoint.dir`, else `runs/<name>-<time>`) and what chose it:
    the flag or key an error about it names."""
    if given is None and cfg.checkpoint.dir:
        configured = run_location(Path(cfg.checkpoint.dir), "checkpoint.dir")
        return configured or default_run_dir(cfg), "checkpoint.dir"
    return given or default_run_dir(cfg), "--run-dir"


def checked_run_dir(run_dir: Path | str, flag: str) -> RunDir:
    """What preflight checks of the run dir: the folder this node writes (a bucket's staging folder)."""
    from ddp_cli.preflight import RunDir

    bucket = bucket_of(run_dir)
    return RunDir(staging_folder(bucket) if bucket else Path(run_dir), flag)


def prepare_run(run: Preflight, run_dir: Path | str, quiet: bool) -> Path:
    """The run directory, holding everything the workers need (`jobs.prepare_job`); for a run dir in a
    bucket, its staging folder, emptied and filled from the bucket (`pull.stage`)."""
    bucket = bucket_of(run_dir)
    if bucket:
        from ddp_cli.run.pull import stage

        run_dir = staging_folder(bucket)
        stage(RunBucket(bucket), run_dir, run.resume)
    folder = Path(run_dir).resolve()
    prepare_job(folder, run.cfg, run.entry, run.index, Job("train", quiet, resume=run.resume, bucket=bucket))
    return folder


def published(result: dict[str, Any], run_dir: Path | str | None, folder: Path,
              node_rank: int = 0) -> dict[str, Any]:
    """`result` of a run dir in a bucket: its files uploaded a last time (rank logs, result.json: what
    the workers wrote after their last upload; from another node than rank 0's, its ranks' logs only),
    and its places named in the bucket."""
    bucket = bucket_of(run_dir)
    if not bucket:
        return result
    from ddp_cli.run.bucket import PER_RANK
    from ddp_cli.run.mirror import upload_files

    upload_files(RunBucket(bucket), folder, {}, PER_RANK if node_rank else ())
    return {**result, "run_dir": bucket, "checkpoint": f"{bucket}/checkpoints/last.pt"}


def upload_after_failure(run_dir: Path | str | None, folder: Path) -> None:
    """A failed run's logs and error records to its bucket, where they can be read; an upload that
    fails too is only warned of (the run's own error is the one to show)."""
    bucket = bucket_of(run_dir)
    if not bucket:
        return
    from ddp_cli.run.bucket import PER_RANK
    from ddp_cli.run.mirror import upload_files

    try:
        upload_files(RunBucket(bucket), folder, {}, PER_RANK)
    except DdpError as e:
        log.warning("warning: the run's logs are only in %s: %s", folder, e)


def launch_training(cfg: RunConfig, build: IndexBuild, run_dir: Path | str, flag: str, opts: LaunchOptions,
                    resume: str, quiet: bool) -> dict[str, Any]:
    """Check, hand off, launch; the result with where start-up time went (`StartupClock`). The index
    builds beside (`build`): meanwhile this process imports what building the model needs."""
    from ddp_cli.models.zoo import import_builders
    from ddp_cli.preflight import launch_workers, preflight
    from ddp_cli.run.launch import external_launcher, launch, single_threaded

    import_builders(cfg.model.name)
    startup = StartupClock()
    startup.mark("imports")
    if external_launcher():
        return train_under_torchrun(cfg, build, run_dir, flag, resume, quiet, startup)
    single_threaded()
    run = preflight(cfg, build, launch_workers(cfg, opts), resume, startup, checked_run_dir(run_dir, flag))
    with owned(run_dir, opts.node_rank == 0):
        folder = prepare_run(run, run_dir, quiet)
        startup.mark("hand_off")
        startup.hand_over()
        try:
            start = launch(folder, run.workers.nproc, opts, cfg.distributed)
        except WorkerFailed as e:
            upload_after_failure(run_dir, folder)
            if e.exit_code == PEER_LOST:
                raise PeerLost(f"{e}; {how_to_go_on(folder, bucket=bucket_of(run_dir))}") from None
            raise
        result = {**read_result(folder), "data_workers": run.loaders.as_dict(), "worker_start": start}
        return published(result, run_dir, folder, opts.node_rank)


def how_to_go_on(folder: Path, argv: list[str] | None = None, bucket: str | None = None) -> str:
    """What is safe after a lost node, and the command that resumes from it (from the `bucket`, for a
    run dir there: what this node staged may not all have reached it)."""
    from ddp_cli.train.checkpoint import CheckpointStore

    newest = None if bucket else CheckpointStore(folder / "checkpoints", 1).latest_valid()
    kept = f"{newest} is the newest valid checkpoint" if newest else "no checkpoint was written yet"
    kept = f"{bucket} holds every checkpoint uploaded whole" if bucket else kept
    return f"{kept}; to go on, run on every node (each with its own --node-rank): " + \
        resume_command(sys.argv[1:] if argv is None else argv, bucket or folder)


def resume_command(argv: list[str], folder: Path | str) -> str:
    """This `ddp` command line, pointed at its run dir with --resume auto (a rerun without --run-dir
    would start a new run dir, and fresh)."""
    kept, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in ("--run-dir", "--resume"):
            skip = True
        elif not arg.startswith(("--run-dir=", "--resume=")):
            kept.append(arg)
    return shlex.join(["ddp", *kept, "--run-dir", str(folder), "--resume", "auto"])


def train_under_torchrun(cfg: RunConfig, build: IndexBuild, run_dir: Path | str, flag: str,
                         resume: str, quiet: bool, startup: StartupClock) -> dict[str, Any]:
    """Started by an external torchrun: rank 0 checks and prepares the run dir, every rank trains."""
    import torch.distributed as dist

    from ddp_cli.distributed.setup import setup
    from ddp_cli.preflight import joined_workers, preflight
    from ddp_cli.run.worker import run_job

    ctx = setup(cfg.distributed.backend, cfg.distributed.timeout_s)
    startup.mark("process_group")
    folder, run = [None], None
    with ExitStack() as held:
        if ctx.is_main:
            workers = joined_workers(cfg, ctx)
            run = preflight(cfg, build, workers, resume, startup, checked_run_dir(run_dir, flag))
            held.enter_context(owned(run_dir, True))
            folder[0] = str(prepare_run(run, run_dir, quiet))
            startup.mark("hand_off")
        dist.broadcast_object_list(folder, src=0)
        code = run_job(Path(folder[0]), startup)
        if code:
            if run:
                upload_after_failure(run_dir, Path(folder[0]))
            raise WorkerFailed("", code)
        if not run:
            return {}
        result = {**read_result(Path(folder[0])), "data_workers": run.loaders.as_dict()}
        return published(result, run_dir, Path(folder[0]))


def plan(cfg: RunConfig, build: IndexBuild, run_dir: RunDir, opts: LaunchOptions, resume: str,
         location: Path | str) -> dict[str, Any]:
    """--dry-run: the checks `train` makes before starting workers, the plan they computed (going on
    from the checkpoint a resume in the run dir at `location` would take; one in a bucket is not read),
    and the scheduler whose variables filled the launch (`schedulers`: which, and each variable read)."""
    from ddp_cli.cli.plan import describe, resume_plan
    from ddp_cli.preflight import launch_workers, preflight
    from ddp_cli.run.schedulers import recognise

    run = preflight(cfg, build, launch_workers(cfg, opts), resume, run_dir=run_dir)
    folder = None if bucket_of(location) else Path(location).resolve()
    return {**describe(run, resume_plan(run, folder)), **recognise(os.environ).as_dict()}
