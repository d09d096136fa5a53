"""`ddp bench step`: training images/s of ddp's worker against a bare DDP loop and the tutorial's.

All run in the same gloo processes on the same synthetic images (random
pixels, random labels: throughput does not depend on what is learnt), model,
per-worker batch, world size and threads:

- ddp: the Trainer's own `train_step` on its DDP model (bucket and
  gradient-view settings, parameter groups, schedule), fed uint8 NHWC batches
  normalised in the worker (`to_model_input`, as on a GPU), with the fast
  settings where the CPU has them (bf16 autocast on AVX-512 BF16 / AMX or CUDA,
  channels_last);
- tutorial: `DistributedDataParallel(model)` with its defaults, SGD, a
  DataLoader of normalised float NCHW tensors, and
  `zero_grad(); loss_fn(ddp(x), y).backward(); step()` (the tutorial's loop);
- bare: the loop a careful user writes around the same things ddp's step uses
  and nothing else: `DistributedDataParallel(model)` with its defaults, ddp's
  optimizer (same class, groups and hyper-parameters) and loss, ddp's own uint8
  batches normalised inline, ddp's precision and memory format (GradScaler in
  fp16), and no schedule, EMA, loss accumulation or checks. `ratio_vs_bare` and
  `ratio_ema_vs_bare` are ddp's images/s (without and with the EMA) over its,
  from the median step of each (`paired_step_ms`), the three built side by side
  and stepped in turn, `rounds` x `steps` steps each: one step at a time, load
  from elsewhere falls on all three alike.

Each loop also runs at the other's precision and memory format, so the rows
show both the gain from the settings and that ddp is not slower at equal ones.
The `ddp` rows are ddp's defaults without the EMA (a default since issue 41):
a `ddp_ema` row has the weights' EMA on, updated every step
(`ratio_ema_vs_defaults`, its images/s over the `ddp` row's); `ema_ms` times the
EMA update alone, and `ema_share_of_step` is its fraction of the breakdown's step.
The variants alternate over `rounds` (fresh model each time) so background load
hits all alike. With `device = "cuda"` the workers are NCCL ranks, one GPU
each, and each row also gives the peak GPU memory its loop allocated. Each row's `mfu` is its images/s x
the model's FLOPs per image (forward and backward, torch's counter) over the peak of a device at the
row's precision x the world size; `mfu`, `peak_flops` and `peak_source` at the top are the `ddp` row's
at the fast precision (observe/mfu.py: a datasheet's figure for a GPU, a measured matmul on a CPU). A
breakdown times the Trainer's own step methods with the default settings (data
wait, the objective's `loss`, `backward`, `optimizer_step` with its scaler, clipping and
EMA), once with DDP's all-reduce and once under
`no_sync`: the difference in backward is the all-reduce time that backward did
not hide.
"""

from __future__ import annotations

import gc
import statistics
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset

from ddp_cli.bench.data import machine
from ddp_cli.config import ModelConfig, RunConfig, apply_override
from ddp_cli.config.resolve import Facts, resolve
from ddp_cli.data.pipeline.loaders import Loaders, collate
from ddp_cli.data.pipeline.transforms import MEAN, STD
from ddp_cli.distributed.setup import DistContext
from ddp_cli.models.check import tensors_on_meta
from ddp_cli.models.families import takes_any_size
from ddp_cli.models.zoo import build_model, count_parameters
from ddp_cli.observe.mfu import Utilisation, cpu_peak, measure
from ddp_cli.run.loopback import run_workers
from ddp_cli.train.checkpoint import Checkpointer
from ddp_cli.train.mixing import loss_function
from ddp_cli.train.objectives import on_device
from ddp_cli.train.optim import build_optimizer
from ddp_cli.train.precision import AUTOCAST, autocast, native_precision
from ddp_cli.train.trainer import Trainer

CPU = torch.device("cpu")
STORED_IMAGES = 64  # distinct synthetic images; items cycle through them
PHASES = ("data", "forward", "backward", "optimizer")
SYNC_WARNING = "synchronizing CUDA operation"  # what torch.cuda.set_sync_debug_mode("warn") says
EMA = ("train.ema_decay=0.9999",)  # the ddp_ema row: ddp's defaults with the EMA updated every step


@dataclass(frozen=True)
class StepSpec:
    model: str = "resnet_tiny"
    batch_size: int = 32
    image_size: int = 32
    classes: int = 10
    steps: int = 20
    warmup: int = 3
    rounds: int = 2
    loader_workers: int = 0
    device: str = "cpu"  # or "cuda": NCCL ranks, one GPU each


def bench_device(spec: StepSpec) -> torch.device:
    """This rank's device: the CPU, or the GPU `run_workers` set for the rank."""
    return torch.device("cuda", torch.cuda.current_device()) if spec.device == "cuda" else CPU


def settled(device: torch.device) -> float:
    """`perf_counter` once the device's queued work is done (a CUDA step returns before its kernels end)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


class Synthetic(Dataset):
    """`items` images cycling through STORED_IMAGES random ones, as ddp or the tutorial stores them."""

    def __init__(self, spec: StepSpec, items: int, as_float: bool) -> None:
        g = torch.Generator().manual_seed(0)
        side = spec.image_size
        self.images = torch.randint(0, 256, (STORED_IMAGES, side, side, 3), dtype=torch.uint8, generator=g)
        self.labels = torch.randint(0, spec.classes, (STORED_IMAGES,), generator=g).tolist()
        if as_float:  # ToTensor + Normalize, done once: the baseline's loader still collates floats
            mean, std = torch.tensor(MEAN).view(3, 1, 1), torch.tensor(STD).view(3, 1, 1)
            self.images = (self.images.permute(0, 3, 1, 2).float() / 255 - mean) / std
        self.items, self.as_float = items, as_float

    def __len__(self) -> int:
        return self.items

    def __getitem__(self, index: int):
        i = index % STORED_IMAGES
        if self.as_float:
            return self.images[i], self.labels[i]
        return self.images[i], self.labels[i], "", ""  # ImageDataset's (image, label, skipped, error)


def loader(spec: StepSpec, as_float: bool) -> DataLoader:
    steps = spec.warmup + spec.steps
    return DataLoader(Synthetic(spec, steps * spec.batch_size, as_float), batch_size=spec.batch_size,
                      collate_fn=None if as_float else collate,  # ddp's: a `Batch`, read by name
                      num_workers=spec.loader_workers, drop_last=True,
                      prefetch_factor=2 if spec.loader_workers else None,
                      persistent_workers=False)


def step_config(spec: StepSpec, precision: str, channels_last: bool,
                overrides: tuple[str, ...] = ()) -> RunConfig:
    """The run config of the timed step, resolved as a worker resolves it (every row times the same
    loss and optimizer); `overrides` as `--set` takes them."""
    raw = {
        "data": {"batch_size": spec.batch_size, "image_size": spec.image_size,
                 "workers": spec.loader_workers},
        "model": {"name": spec.model, "channels_last": channels_last},
        "train": {"precision": precision, "epochs": 1, "ema_decay": 0.0},  # the EMA: the ddp_ema row's
        "logging": {"every_steps": 10**6},
    }
    for item in overrides:
        apply_override(raw, item)
    device, world = bench_device(spec), dist.get_world_size() if dist.is_initialized() else 1
    facts = Facts(device.type, native_precision(device), world, len(loader(spec, as_float=False)),
                  takes_any_size(spec.model), loader_workers=spec.loader_workers)
    return resolve(RunConfig.model_validate(raw), facts)


def ddp_trainer(spec: StepSpec, precision: str, channels_last: bool,
                overrides: tuple[str, ...] = (), checkpointer: Checkpointer | None = None) -> Trainer:
    """ddp's Trainer as a worker builds it, over the synthetic loader; `overrides` as `--set` takes them."""
    cfg = step_config(spec, precision, channels_last, overrides)
    rank, world = dist.get_rank(), dist.get_world_size()
    device = bench_device(spec)
    ctx = DistContext(rank, world, rank, world, device, dist.get_backend())
    torch.manual_seed(0)
    model = build_model(cfg.model, spec.classes, spec.image_size)
    train = loader(spec, as_float=False)
    return Trainer(cfg, ctx, model, Loaders(train, None, None), len(train), checkpointer)


def ddp_step(spec: StepSpec, precision: str, channels_last: bool,
             overrides: tuple[str, ...] = ()) -> Callable[[], None]:
    """One call, one step of the Trainer's train_step over the next synthetic batch."""
    trainer = ddp_trainer(spec, precision, channels_last, overrides)
    trainer.model.train()
    batches = iter(trainer.loaders.train)
    return lambda: trainer.train_step([(next(batches),)])


def time_ddp(spec: StepSpec, precision: str, channels_last: bool, overrides: tuple[str, ...] = ()) -> float:
    """Seconds for `spec.steps` of the Trainer's train_step, after the warm-up."""
    return _timed(spec, ddp_step(spec, precision, channels_last, overrides))


def plain_ddp(spec: StepSpec, model_cfg: ModelConfig, channels_last: bool) -> DistributedDataParallel:
    """`DistributedDataParallel(model)` with its defaults, on the rank's device (seeded as ddp's)."""
    device = bench_device(spec)
    torch.manual_seed(0)
    model = build_model(model_cfg, spec.classes, spec.image_size)
    memory_format = torch.channels_last if channels_last else torch.contiguous_format
    model = model.to(device, memory_format=memory_format)
    return DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None)


def time_tutorial(spec: StepSpec, precision: str, channels_last: bool) -> float:
    """Seconds for `spec.steps` of the DDP tutorial's loop, after the warm-up."""
    device = bench_device(spec)
    ddp = plain_ddp(spec, ModelConfig(name=spec.model), channels_last)
    memory_format = torch.channels_last if channels_last else torch.contiguous_format
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    loss_fn = nn.CrossEntropyLoss()
    batches = iter(loader(spec, as_float=True))

    def step() -> None:
        x, y = next(batches)
        x = x.to(device).contiguous(memory_format=memory_format)
        optimizer.zero_grad()
        with autocast(device, precision):
            loss = loss_fn(ddp(x), y.to(device))
        loss.backward()
        optimizer.step()

    return _timed(spec, step)


def bare_step(spec: StepSpec, precision: str, channels_last: bool) -> Callable[[], None]:
    """One call, one step of a bare DDP loop over ddp's own batches, optimizer, loss and precision."""
    cfg = step_config(spec, precision, channels_last)
    device = bench_device(spec)
    ddp = plain_ddp(spec, cfg.model, channels_last)
    memory_format = torch.channels_last if channels_last else torch.contiguous_format
    optimizer = build_optimizer(cfg.optim, ddp.module, cfg.lr(dist.get_world_size()), cfg.model)
    loss_fn = loss_function(cfg)
    scaler = torch.amp.GradScaler(device.type, enabled=precision == "fp16")
    mean = torch.tensor(MEAN, device=device).view(1, 3, 1, 1) * 255
    std = torch.tensor(STD, device=device).view(1, 3, 1, 1) * 255
    batches = iter(loader(spec, as_float=False))

    def step() -> None:
        batch = next(batches)
        x = batch.images.to(device, non_blocking=True).permute(0, 3, 1, 2).float()
        x = x.sub_(mean).div_(std).contiguous(memory_format=memory_format)
        y = batch.labels.to(device, non_blocking=True)
        with torch.autocast(device.type, dtype=AUTOCAST.get(precision, torch.float32),
                            enabled=precision != "fp32"):
            loss = loss_fn(ddp(x), y)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)

    return step


def time_bare(spec: StepSpec, precision: str, channels_last: bool) -> float:
    """Seconds for `spec.steps` of the bare DDP loop, after the warm-up."""
    return _timed(spec, bare_step(spec, precision, channels_last))


def paired_step_seconds(spec: StepSpec, precision: str, channels_last: bool) -> dict[str, list[float]]:
    """Seconds of each of `rounds` x `steps` steps of ddp's step, ddp's with the EMA and the bare loop,
    built side by side and stepped in turn (the order rotating), so that load from elsewhere falls on all
    three alike: their medians compare the loops to a few per cent on a busy machine, where whole rounds
    of one loop at a time do not."""
    spec = replace(spec, steps=spec.rounds * spec.steps)
    steps = {"ddp": ddp_step(spec, precision, channels_last),
             "bare": bare_step(spec, precision, channels_last),
             "ddp_ema": ddp_step(spec, precision, channels_last, EMA)}
    names, device = list(steps), bench_device(spec)
    for _ in range(spec.warmup):
        for step in steps.values():
            step()
    seconds: dict[str, list[float]] = {name: [] for name in names}
    for i in range(spec.steps):
        for name in names[i % len(names):] + names[:i % len(names)]:
            started = settled(device)
            steps[name]()
            seconds[name].append(settled(device) - started)
    return seconds


def ema_ms(spec: StepSpec, precision: str, channels_last: bool) -> float:
    """Milliseconds of one EMA update of the Trainer's model, after the warm-up."""
    trainer = ddp_trainer(spec, precision, channels_last, EMA)
    module = trainer.model.module
    return _timed(spec, lambda: trainer.ema.update(module)) / spec.steps * 1e3


def host_syncs(spec: StepSpec, precision: str, channels_last: bool) -> dict:
    """The synchronising CUDA calls (torch's sync debug mode, "warn") in each timed train_step, after the
    warm-up, and the code lines that made them (the batch is fetched outside the count)."""
    trainer = ddp_trainer(spec, precision, channels_last)
    trainer.model.train()
    batches = iter(trainer.loaders.train)
    for _ in range(spec.warmup):
        trainer.train_step([(next(batches),)])
    counts = []
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for _ in range(spec.steps):
            micro, before = [(next(batches),)], len(seen)
            torch.cuda.set_sync_debug_mode("warn")
            try:
                trainer.train_step(micro)
            finally:
                torch.cuda.set_sync_debug_mode("default")
            counts.append(sum(SYNC_WARNING in str(w.message) for w in seen[before:]))
    lines = {f"{w.filename}:{w.lineno}" for w in seen if SYNC_WARNING in str(w.message)}
    return {"per_step": counts, "from": sorted(lines)}


def _timed(spec: StepSpec, step) -> float:
    device = bench_device(spec)
    for _ in range(spec.warmup):
        step()
    settled(device)
    dist.barrier()
    started = time.perf_counter()
    for _ in range(spec.steps):
        step()
    settled(device)
    dist.barrier()
    return time.perf_counter() - started


def phase_seconds(spec: StepSpec, precision: str, channels_last: bool, sync: bool) -> dict[str, float]:
    """Mean seconds per step in each phase of the Trainer's own step methods; `sync=False` runs
    forward and backward without DDP's all-reduce (as on all but the last micro-batch)."""
    trainer = ddp_trainer(spec, precision, channels_last)
    trainer.model.train()
    batches = iter(trainer.loaders.train)
    totals = dict.fromkeys(PHASES, 0.0)
    device = trainer.ctx.device
    for i in range(spec.warmup + spec.steps):
        marks = [settled(device)]
        batch = next(batches)
        marks.append(settled(device))
        with trainer.gradient_sync(sync):
            loss, _ = trainer.objective.loss(trainer.forward, on_device((batch,), device), trainer.state.step)
            marks.append(settled(device))
            trainer.backward(loss)
        marks.append(settled(device))
        trainer.optimizer_step()
        marks.append(settled(device))
        if i >= spec.warmup:
            for phase, start, end in zip(PHASES, marks[:-1], marks[1:], strict=True):
                totals[phase] += end - start
    return {phase: seconds / spec.steps for phase, seconds in totals.items()}


def breakdown(spec: StepSpec, precision: str, channels_last: bool) -> dict[str, float]:
    """Milliseconds per step: data, forward, backward compute, exposed all-reduce, optimizer, total."""
    synced = phase_seconds(spec, precision, channels_last, sync=True)
    local = phase_seconds(spec, precision, channels_last, sync=False)
    out = {
        "data_ms": synced["data"] * 1e3,
        "forward_ms": synced["forward"] * 1e3,
        "backward_ms": local["backward"] * 1e3,
        "exposed_allreduce_ms": max(0.0, synced["backward"] - local["backward"]) * 1e3,
        "optimizer_ms": synced["optimizer"] * 1e3,
    }
    out["step_ms"] = sum(synced.values()) * 1e3
    return out


def peak_and_seconds(spec: StepSpec, timer, *args) -> tuple[float, float | None]:
    """`timer(spec, *args)`'s seconds, and on CUDA the peak memory (MiB) it allocated."""
    cuda = spec.device == "cuda"
    if cuda:
        gc.collect()  # the previous variant's model and optimizer (DDP holds reference cycles)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    seconds = timer(spec, *args)
    return seconds, torch.cuda.max_memory_allocated() / 2**20 if cuda else None


def _step_worker(rank: int, world_size: int, spec: StepSpec, fast: str) -> dict | None:
    variants = [("ddp_ema", fast, True), ("bare", fast, True), ("ddp", fast, True), ("ddp", "fp32", False),
                ("tutorial", "fp32", False), ("tutorial", fast, True)]
    timers = {"ddp": time_ddp, "tutorial": time_tutorial, "bare": time_bare,
              "ddp_ema": lambda *args: time_ddp(*args, overrides=EMA)}
    seconds: dict[tuple, list[float]] = {v: [] for v in variants}
    peaks: dict[tuple, float] = {}
    for r in range(spec.rounds):
        for variant in variants[r % len(variants):] + variants[:r % len(variants)]:
            s, peak = peak_and_seconds(spec, timers[variant[0]], *variant[1:])
            seconds[variant].append(s)
            if peak is not None:
                peaks[variant] = max(peak, peaks.get(variant, 0.0))
    paired = paired_step_seconds(spec, fast, True)
    parts = breakdown(spec, fast, True)
    ema = ema_ms(spec, fast, True)
    syncs = host_syncs(spec, fast, True) if spec.device == "cuda" else None
    if rank:
        return None
    use = {precision: utilisation(spec, precision, world_size) for precision in {fast, "fp32"}}
    images = spec.rounds * spec.steps * spec.batch_size * world_size
    rows = [{"loop": loop, "precision": precision, "channels_last": channels_last, "images": images,
             "seconds": sum(s), "images_per_second": images / sum(s),
             **({"mfu": use[precision].of(images / sum(s), spec.image_size)} if use[precision] else {}),
             **({"peak_memory_mib": peaks[(loop, precision, channels_last)]} if peaks else {})}
            for (loop, precision, channels_last), s in seconds.items()]
    paired_ms = {name: statistics.median(s) * 1e3 for name, s in paired.items()}
    return {"rows": rows, "breakdown": parts, "ema_ms": ema, "host_syncs": syncs, "paired_ms": paired_ms,
            "utilisation": use[fast].about() if use[fast] else None}


def utilisation(spec: StepSpec, precision: str, world_size: int) -> Utilisation | None:
    """MFU's facts for the bench's model at `precision` on this rank's device (observe/mfu.py)."""
    with tensors_on_meta():
        model = build_model(ModelConfig(name=spec.model), spec.classes, spec.image_size)
    return measure(model.train(), [spec.image_size], bench_device(spec), precision, world_size)


def step_header(bench: str, spec: StepSpec, world_size: int, threads: int) -> dict:
    """The set-up keys every step-based bench reports: spec, model size, world, threads, machine."""
    params = count_parameters(build_model(ModelConfig(name=spec.model), spec.classes, spec.image_size))
    return {"bench": bench, **asdict(spec), "parameters": params, "world_size": world_size,
            "threads_per_worker": threads, "machine": machine()}


def bench_step(spec: StepSpec, world_size: int = 2, threads: int = 1) -> dict:
    """Run the variants in `world_size` workers of `threads` threads each (gloo; NCCL on CUDA, a GPU
    each); the shared bench dict."""
    fast = native_precision(torch.device(spec.device))
    backend = "nccl" if spec.device == "cuda" else "gloo"
    if spec.device == "cpu":  # MFU's peaks probed here, before any worker runs, and cached for rank 0
        for precision in {fast, "fp32"}:
            cpu_peak(precision, threads)
    out = run_workers(_step_worker, world_size, spec, fast, threads=threads, backend=backend)[0]
    rate = {(r["loop"], r["precision"], r["channels_last"]): r["images_per_second"] for r in out["rows"]}
    return {
        **step_header("step", spec, world_size, threads),
        "fast_precision": fast,
        "rows": out["rows"],
        "breakdown": out["breakdown"],
        "ratio_defaults_vs_baseline": rate[("ddp", fast, True)] / rate[("tutorial", "fp32", False)],
        "ratio_equal_fp32": rate[("ddp", "fp32", False)] / rate[("tutorial", "fp32", False)],
        "ratio_equal_fast": rate[("ddp", fast, True)] / rate[("tutorial", fast, True)],
        "ratio_ema_vs_defaults": rate[("ddp_ema", fast, True)] / rate[("ddp", fast, True)],
        "paired_step_ms": out["paired_ms"],
        "ratio_vs_bare": out["paired_ms"]["bare"] / out["paired_ms"]["ddp"],
        "ratio_ema_vs_bare": out["paired_ms"]["bare"] / out["paired_ms"]["ddp_ema"],
        **({"host_syncs_per_step": out["host_syncs"]["per_step"],
            "host_syncs_from": out["host_syncs"]["from"]} if out["host_syncs"] else {}),
        "ema_ms": out["ema_ms"],
        "ema_share_of_step": out["ema_ms"] / out["breakdown"]["step_ms"],
        **mfu_keys(out["rows"], out["utilisation"], fast),
    }


def mfu_keys(rows: list[dict], about: dict | None, fast: str) -> dict:
    """`mfu` of ddp's defaults (the `ddp` row at the fast precision) and the peak it is a share of; none
    where the model's FLOPs or the device's peak are not known (said once)."""
    if about is None:
        return {}
    row = next(r for r in rows if (r["loop"], r["precision"], r["channels_last"]) == ("ddp", fast, True))
    return {"mfu": row["mfu"], **about}
