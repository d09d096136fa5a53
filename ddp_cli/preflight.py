"""Preflight: every rule a run must pass that its config and this machine decide.

`preflight` meets them all before any worker starts, for `ddp train` and
`ddp train --dry-run` alike (and on rank 0 under an external torchrun), so a
config the dry run accepts is one the workers accept, and one it refuses is
refused by `train` with the same line. Each rule stays a function beside its
subject (`choose_backend`, `check_precision`, `check_optimizer`,
`count_steps`, `check_model`, ...); a worker that meets a rule again calls the
same function. On the way it gathers the facts the config's resolve pass needs
(`node_facts`: the device, its native precision, the world, the model family, a
timm model's cached weights; then the steps per epoch and the measured loader
processes) and resolves the config once (`config.resolve`). `Preflight` keeps
what the checks computed, the resolved config among it, frozen: `plan.describe`
prints it, `commands.train` hands it to the workers, and nothing edits it after.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from torch import nn

from ddp_cli.config import ModelConfig, RunConfig
from ddp_cli.config.model_names import is_timm_model
from ddp_cli.config.resolve import Facts, Pretrained, autos, for_inference, method_recipe, resolve
from ddp_cli.data.index_build import IndexBuild
from ddp_cli.data.pipeline.autotune import LoaderChoice, measure_loaders
from ddp_cli.data.pipeline.device_decode import decodes_on
from ddp_cli.data.pipeline.semi import check_unlabelled, run_splits
from ddp_cli.data.pipeline.sharedmem import check_shared_memory
from ddp_cli.data.registry import DatasetEntry
from ddp_cli.data.sources.table import IndexTable
from ddp_cli.distributed.faults import VARIABLE as FAULTS
from ddp_cli.distributed.faults import parse_faults
from ddp_cli.distributed.setup import DistContext, check_gpus_usable, choose_backend, cuda_devices
from ddp_cli.errors import ConfigError, WriteError
from ddp_cli.io import REFUSALS, cause, existing_ancestor, size_words
from ddp_cli.models.check import check_model
from ddp_cli.models.families import takes_any_size
from ddp_cli.models.timm_model import PRETRAINED, cached_weights, data_config, with_tag
from ddp_cli.models.weights import is_weight_name
from ddp_cli.observe.sinks import check_sinks
from ddp_cli.observe.startup import StartupClock
from ddp_cli.run.launch import LaunchOptions, check_rendezvous, resolve_nproc
from ddp_cli.run.network import warn_loopback_host
from ddp_cli.train.optim import check_optimizer, state_copies
from ddp_cli.train.precision import check_precision, native_precision
from ddp_cli.train.trainer import count_steps

log = logging.getLogger("ddp")

@dataclass(frozen=True)
class Workers:
    """The workers of a run: how many per node, on how many nodes, and what they compute on."""

    nproc: int
    nnodes: int
    backend: str  # nccl | gloo
    device: str  # cuda | cpu
    native_precision: str  # bf16 where this node's devices compute it natively, else fp32

    @property
    def world_size(self) -> int:
        return self.nproc * self.nnodes


@dataclass(frozen=True)
class RunDir:
    """Where a run's files are written on this node: the run dir, or a bucket's staging folder (the
    bucket itself is checked by its own code: `run.bucket`); `flag` is what chose it, for the fix."""

    folder: Path
    flag: str = "--run-dir"  # or checkpoint.dir


@dataclass
class Preflight:
    """A run that passed every check, and what the checks computed on the way."""

    cfg: RunConfig  # resolved: what the workers run
    entry: DatasetEntry
    index: IndexTable
    model: nn.Module  # on the meta device: real shapes, no memory
    workers: Workers
    loaders: LoaderChoice  # data.workers and prefetch_factor, "auto" made concrete
    resume: str  # auto | never | an absolute checkpoint path
    steps_per_epoch: int
    global_batch: int
    lr: float
    semi_images: tuple[int, int | None] = (0, None)  # (the train loader's images, unlabelled or None)
    fitted: dict[str, str] = field(default_factory=dict)  # keys resolve set for the semi method: why


def launch_workers(cfg: RunConfig, opts: LaunchOptions) -> Workers:
    """The workers our own launch would start on this node."""
    check_rendezvous(opts, cfg.distributed)
    warn_loopback_host(opts.nnodes, opts.rdzv_endpoint, os.environ)
    return place_workers(cfg, resolve_nproc(opts, cfg.distributed), opts.nnodes)


def joined_workers(cfg: RunConfig, ctx: DistContext) -> Workers:
    """The workers an external torchrun already started, this process among them."""
    return place_workers(cfg, ctx.local_world_size, ctx.world_size // ctx.local_world_size)


def place_workers(cfg: RunConfig, nproc: int, nnodes: int) -> Workers:
    """Backend, device and precision of `nproc` workers on this node, as each worker will choose them
    (the launcher's CUDA left uninitialised: counts and bf16 support come from the driver, `gpus`)."""
    check_gpus_usable(cfg.distributed.backend)
    backend = choose_backend(cfg.distributed.backend, cuda_devices(), nproc)
    device = "cuda" if backend == "nccl" else "cpu"
    check_precision(cfg.train.precision, torch.device(device))
    return Workers(nproc, nnodes, backend, device, native_precision(torch.device(device)))


def node_facts(cfg: RunConfig, workers: Workers) -> Facts:
    """What this node decides of the run's config before the data is counted: the device and its
    precision, the model family, `model.weights` as an absolute path (workers and resumes may start
    elsewhere), and a timm model's pretrained weights from the local cache (exit 3 where they are not)."""
    weights, pretrained, weights_file = cfg.model.weights, None, None
    if is_timm_model(cfg.model.name) and weights == PRETRAINED:
        found = cached_weights(cfg.model.name)
        pretrained = Pretrained(with_tag(cfg.model.name), found.revision, data_config(found))
    elif weights and not is_weight_name(weights):
        weights_file = str(Path(weights).expanduser().resolve())
    return Facts(workers.device, workers.native_precision, workers.world_size,
                 takes_any_size=takes_any_size(cfg.model.name), gpu_decode=decodes_on(workers.device),
                 pretrained=pretrained, weights_file=weights_file)


def preflight(cfg: RunConfig, build: IndexBuild, workers: Workers, resume: str = "never",
              startup: StartupClock | None = None, run_dir: RunDir | None = None) -> Preflight:
    """Every check of a training run, cheapest first: the first failure is a ConfigError (exit 2),
    a DataError (exit 3) or a WriteError (exit 6, the run dir), the same line whichever command met
    it. `build` is the run's index (begun before torch was imported where it could be); `startup`
    times the phases; `run_dir` is where the run will write (None: not checked)."""
    startup = startup or StartupClock()
    resume = checked_resume(resume)
    if run_dir:
        check_run_dir(run_dir)
    parse_faults(os.environ.get(FAULTS, ""))  # the workers read it: a bad one fails here, not in each
    check_optimizer(cfg.optim)
    check_sync_batchnorm(cfg.model, workers.device)
    check_sinks(cfg.logging)
    entry, index = build.result()
    startup.mark("index")
    facts = node_facts(cfg, workers)
    labelled, unlabelled = run_splits(index, cfg)
    batches = len(labelled) // workers.world_size // cfg.data.batch_size  # as a rank's loader
    facts = replace(facts, steps_per_epoch=count_steps(batches, cfg.train))
    fitted = {key: f"{value} ({why})" for key, (value, why) in method_recipe(cfg, facts).items()}
    planned = resolve(cfg, facts)  # all but the loader processes: the sizes the model must take
    model = check_model(planned, len(index.classes))
    if run_dir:
        check_disk_room(planned, model, run_dir)
    startup.mark("model_check")
    measured = measure_node_loaders(planned, workers, entry, index, model, "train") \
        if "data.workers" in autos(cfg) else None
    cfg = resolve(cfg, replace(facts, loader_workers=measured.workers if measured else 0))
    loaders = LoaderChoice.of(cfg.data, measured)
    check_shared_memory(cfg.data, loaders.workers, loaders.prefetch_factor, workers.nproc)
    startup.mark("data_workers")
    if unlabelled is not None:
        check_unlabelled(len(unlabelled), workers.world_size, cfg)
    return Preflight(cfg, entry, index, model, workers, loaders, resume, facts.steps_per_epoch,
                     cfg.global_batch(workers.world_size), cfg.lr(workers.world_size),
                     (len(labelled), None if unlabelled is None else len(unlabelled)), fitted)


def checkpoint_bytes(cfg: RunConfig, model: nn.Module) -> int:
    """About what one checkpoint of this run takes: the model's state, the optimiser's per-parameter
    tensors and the EMA's copy of the model (the meta-device model has the real shapes)."""
    params = sum(p.nelement() * p.element_size() for p in model.parameters())
    state = params + sum(b.nelement() * b.element_size() for b in model.buffers())
    return state * (1 + bool(cfg.train.ema_decay)) + params * state_copies(cfg.optim)


def check_run_dir(run_dir: RunDir) -> None:
    """The run dir is a folder or can be made one (no file on its path), and this user can write in
    it: met here, not by the first worker's write seconds later (and the same for `--dry-run`)."""
    folder = next((p for p in (run_dir.folder, *run_dir.folder.parents) if p.exists()), None)  # as given
    if folder is None:
        return
    named = f"{run_dir.flag} {run_dir.folder}"
    if not folder.is_dir():
        raise ConfigError(f"{named}: {folder} is a file, not a folder; give a folder for {run_dir.flag} "
                          "(made if missing)")
    if not os.access(folder, os.W_OK | os.X_OK):
        code = errno.EROFS if os.statvfs(folder).f_flag & os.ST_RDONLY else errno.EACCES
        words = cause(code, str(folder), OSError(code, REFUSALS[code], str(folder)), None)
        raise WriteError(f"{named}: cannot write in {folder}: {words}; give a {run_dir.flag} you can write")


def check_disk_room(cfg: RunConfig, model: nn.Module, run_dir: RunDir) -> None:
    """Room on the run dir's disk: less than one checkpoint ends the run at its first save, so it is
    refused now (exit 6); less than `keep_last` of them and the one being written (less those
    already there: a resume replaces them) is one warning line, so it can be fixed before hours are
    spent."""
    each = checkpoint_bytes(cfg, model)
    count = cfg.checkpoint.keep_last + 1
    folder = run_dir.folder
    there = sum(p.stat().st_size for p in (folder / "checkpoints").glob("step-*.pt"))
    disk = existing_ancestor(folder)
    free = shutil.disk_usage(disk).free if disk else None
    if free is None or free >= count * each - there:
        return
    short = f"{folder}: {size_words(free)} free on its disk, but"
    if free < each:  # a save writes its whole file before any old one goes
        raise WriteError(f"{run_dir.flag} {short} one checkpoint of the run takes about {size_words(each)}: "
                         f"make room or give another {run_dir.flag}")
    log.warning(f"warning: {short} the run's checkpoints take about {size_words(count * each)} ({count} "
                f"of {size_words(each)}: checkpoint.keep_last + 1); a full disk stops the run at a "
                f"checkpoint (exit 6): make room, choose another {run_dir.flag} or lower "
                "checkpoint.keep_last")


def validation_workers(cfg: RunConfig, num_classes: int, opts: LaunchOptions) -> tuple[Workers, nn.Module]:
    """What of preflight `ddp validate` meets: its workers, and a model that takes the val images."""
    return launch_workers(cfg, opts), check_model(cfg, num_classes)


def measure_node_loaders(cfg: RunConfig, workers: Workers, entry: DatasetEntry, index: IndexTable,
                         model: nn.Module, split: str) -> LoaderChoice:
    """`measure_loaders` for this node's workers: the loader processes the rule gives a rank of them."""
    fs, root = entry.open()
    return measure_loaders(cfg.data, workers.device, workers.nproc, fs, root, index.splits[split],
                           model, train=split == "train", augment=cfg.augment)


def resolved_for_inference(cfg: RunConfig, workers: Workers, entry: DatasetEntry, index: IndexTable,
                           model: nn.Module, split: str) -> RunConfig:
    """A checkpoint's config made concrete for `ddp validate` and `predict` over `split` on this node
    (`config.resolve.for_inference`); their batches must fit in its /dev/shm."""
    measured = measure_node_loaders(cfg, workers, entry, index, model, split) \
        if "data.workers" in autos(cfg) else None
    cfg = for_inference(cfg, workers.native_precision, measured.workers if measured else 0,
                        decodes_on(workers.device))
    check_shared_memory(cfg.data, cfg.data.workers, cfg.data.prefetch_factor, workers.nproc)
    return cfg


def checked_resume(resume: str) -> str:
    """auto | never | an existing checkpoint (made absolute); the workers resolve `auto`."""
    if resume in ("auto", "never"):
        return resume
    if not Path(resume).is_file():
        raise ConfigError(f"--resume {resume}: no such checkpoint; use auto, never or a .pt path")
    return str(Path(resume).resolve())


def check_sync_batchnorm(cfg: ModelConfig, device: str) -> None:
    """torch syncs BatchNorm on GPUs only: on CPU, DDP refuses SyncBatchNorm at any world size, even 1."""
    if cfg.sync_batchnorm and device != "cuda":
        raise ConfigError("model.sync_batchnorm: torch's SyncBatchNorm runs on CUDA only and these workers "
                          "train on CPU (gloo); set model.sync_batchnorm = false (each worker then "
                          "normalises with its own batch)")
