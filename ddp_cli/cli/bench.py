"""`ddp bench ...`: the benchmarks' door, mounted on `ddp` by ddp_cli/cli/ddp.py.

One function per bench, as for the product's commands; the step benches (step, scaling,
options, checkpoint) share one set of options, `step_options`, which arrive as one
`StepSetup`. The bench modules import torch, so each command imports its own when it runs
(`ddp --help` must not wait for torch).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from ddp_cli.cli.clikit import JsonOpt, RegistryOpt, command, group
from ddp_cli.cli.exits import emit
from ddp_cli.cli.render import print_bench
from ddp_cli.errors import ConfigError, did_you_mean

if TYPE_CHECKING:
    from ddp_cli.bench.step import StepSpec

bench_app = group("Benchmarks (results and exact commands: BENCHMARKS.md).")

RoundsOpt = Annotated[int, typer.Option(
    min=1, metavar="N", help="Alternating rounds (noise hits every variant).")]
WorldOpt = Annotated[int, typer.Option(min=1, metavar="N", help="Worker processes (gloo on loopback).")]
STEP_OPTIONS: dict[str, Any] = {
    "model": Annotated[str, typer.Option(metavar="NAME", help="Model name (torchvision or resnet_tiny).")],
    "batch_size": Annotated[int, typer.Option(min=1, metavar="N", help="Images per worker per step.")],
    "image_size": Annotated[int, typer.Option(min=8, metavar="PX", help="Image side, pixels.")],
    "world_size": WorldOpt,
    "threads": Annotated[int, typer.Option(min=1, metavar="N", help="Intra-op threads per worker.")],
    "steps": Annotated[int, typer.Option(min=1, metavar="N", help="Timed steps per variant and round.")],
    "rounds": RoundsOpt,
}


@dataclass(frozen=True)
class StepSetup:
    """A step bench's flags: what one timed step is (`spec`), on how many workers and threads."""

    model: str
    batch_size: int
    image_size: int
    world_size: int
    threads: int
    rounds: int
    steps: int = 1

    def spec(self) -> StepSpec:
        """The step to time; a model no builder knows is a usage error (exit 2), before any worker."""
        from ddp_cli.bench.step import StepSpec  # imports torch
        from ddp_cli.models.zoo import known_models

        if self.model not in known_models():
            known = known_models()
            raise ConfigError(f"--model {self.model}: unknown model{did_you_mean(self.model, known)}")
        return StepSpec(model=self.model, batch_size=self.batch_size, image_size=self.image_size,
                        steps=self.steps, rounds=self.rounds)


def step_options(*, steps: int | None = 10, rounds: int = 3, model: str = "resnet_tiny", batch_size: int = 32,
                 image_size: int = 32, world_size: int = 2,
                 world: Any = WorldOpt) -> Callable[[Callable], Callable]:
    """Give a step bench the shared options (`STEP_OPTIONS`, with these defaults; `world`: its own
    --world-size; `steps=None`: one step, no --steps) and call it with them as `setup`, a `StepSetup`."""
    defaults = {"model": model, "batch_size": batch_size, "image_size": image_size, "world_size": world_size,
                "threads": 1, "steps": steps, "rounds": rounds}
    offered = {name: world if name == "world_size" else option for name, option in STEP_OPTIONS.items()
               if defaults[name] is not None}

    def decorate(function: Callable) -> Callable:
        @functools.wraps(function)
        def wrapper(*args: Any, **kwargs: Any) -> None:
            setup = StepSetup(**{name: kwargs.pop(name) for name in offered})
            function(*args, setup=setup, **kwargs)

        # Typer reads the options from the signature: the shared ones first, then the bench's own
        signature = inspect.signature(function, eval_str=True)
        shared = [inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=defaults[name],
                                    annotation=option) for name, option in offered.items()]
        own = [p for p in signature.parameters.values() if p.name != "setup"]
        wrapper.__signature__ = signature.replace(parameters=[*shared, *own])
        return wrapper

    return decorate


@command(bench_app, "step")
@step_options(rounds=4)
def step(setup: StepSetup, device: Annotated[str, typer.Option(
        metavar="cpu|cuda", help="cpu: gloo workers; cuda: NCCL workers, one GPU each (rows add peak "
        "GPU memory).")] = "cpu", as_json: JsonOpt = False) -> None:
    """Training images/s of ddp's train_step vs a bare DDP loop and the PyTorch DDP tutorial's, and where a
    step's time goes.

    Examples:

    * `ddp bench step`
    * `ddp bench step --model resnet18 --image-size 112 --steps 10 --json`
    * `ddp bench step --device cuda --model resnet50 --image-size 224 --batch-size 64 --world-size 1`
    """
    from ddp_cli.bench.step import bench_step

    spec = replace(setup.spec(), device=device)
    check_device(device, setup.world_size)
    result = bench_step(spec, setup.world_size, setup.threads)
    emit(result, as_json, lambda: print_bench(result))


def check_device(device: str, world_size: int) -> None:
    """`--device`: cpu, or cuda with a GPU per worker that torch can use (else exit 2, naming why)."""
    from ddp_cli.distributed.gpus import gpu_problem
    from ddp_cli.distributed.setup import cuda_devices

    if device not in ("cpu", "cuda"):
        raise ConfigError(f"--device {device}: use cpu or cuda")
    if device == "cpu":
        return
    problem, gpus = gpu_problem(), cuda_devices()
    if problem or gpus < world_size:
        why = problem or f"{gpus} CUDA GPUs here, --world-size {world_size} needs one per worker"
        raise ConfigError(f"--device cuda: {why}")


@command(bench_app, "scaling")
@step_options(steps=20, world=Annotated[int, typer.Option(min=2, metavar="N",
                                                         help="Workers to compare with one.")])
def scaling(setup: StepSetup, as_json: JsonOpt = False) -> None:
    """Images/s at world size 1 and N (same per-worker batch and threads), efficiency, exposed all-reduce.

    Examples:

    * `ddp bench scaling`
    * `ddp bench scaling --model resnet18 --image-size 112 --json`
    """
    from ddp_cli.bench.scaling import bench_scaling

    result = bench_scaling(setup.spec(), setup.world_size, setup.threads)
    emit(result, as_json, lambda: print_bench(result))


@command(bench_app, "options")
@step_options()
def options(
    setup: StepSetup,
    only: Annotated[str | None, typer.Option(
        metavar="NAME,...", help="Variants to run, comma-separated (default: all).")] = None,
    as_json: JsonOpt = False,
) -> None:
    """ddp's step with one DDP/compile setting changed at a time, against ddp's defaults.

    Examples:

    * `ddp bench options`
    * `ddp bench options --model resnet18 --image-size 112 --only defaults,static_graph=true`
    """
    from ddp_cli.bench.options import VARIANTS, bench_options

    names = only.split(",") if only else None
    unknown = sorted(set(names or []) - set(VARIANTS))
    if unknown:
        raise ConfigError(f"--only {only}: unknown variant {unknown[0]!r}; known: {', '.join(VARIANTS)}")
    result = bench_options(setup.spec(), setup.world_size, setup.threads, names)
    emit(result, as_json, lambda: print_bench(result))


@command(bench_app, "checkpoint")
@step_options(model="resnet50", batch_size=8, image_size=224, steps=None, rounds=2)
def checkpoint(setup: StepSetup, as_json: JsonOpt = False) -> None:
    """What a checkpoint costs the step it follows: none, written in the step, in the background, to S3.

    Examples:

    * `ddp bench checkpoint`
    * `ddp bench checkpoint --model resnet_tiny --image-size 32 --json`
    """
    from ddp_cli.bench.checkpoint import bench_checkpoint

    result = bench_checkpoint(setup.spec(), setup.world_size, setup.threads)
    emit(result, as_json, lambda: print_bench(result))


@command(bench_app, "data")
def data(
    names: Annotated[list[str], typer.Argument(
        metavar="NAME...", help="A data set in the registry; several: the same images on other storages, "
        "a row each against the first.")],
    latency_ms: Annotated[float, typer.Option(
        min=0, metavar="MS", help="Storage rows: added first-byte latency of every S3 request (a proxy in "
        "front of the endpoint).")] = 0,
    split: Annotated[str, typer.Option(metavar="train|val", help="Whose files to read.")] = "train",
    workers: Annotated[int, typer.Option(
        min=0, metavar="N", help="DataLoader processes, for both pipelines.")] = 4,
    seconds: Annotated[float, typer.Option(
        min=1, metavar="S", help="Timed seconds, split over all pipelines.")] = 20,
    batch_size: Annotated[int, typer.Option(min=1, metavar="N", help="Images per batch.")] = 32,
    image_size: Annotated[int, typer.Option(min=8, metavar="PX", help="Training crop side.")] = 224,
    policy: Annotated[str, typer.Option(
        metavar="POLICY[,...]|all",
        help="Augmentation policy both pipelines run after the flip: none | trivialaugment | randaugment | "
             "autoaugment, several comma-separated, or all (a row each, and each against none).")] = "none",
    full_decode: Annotated[bool, typer.Option(
        "--full-decode", help="Also time ddp's pipeline decoding every image whole (its DCT scaling off): "
        "a row per policy, and ratios_reduced_vs_full.")] = False,
    rounds: RoundsOpt = 3,
    registry: RegistryOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Images/s of the training input pipeline vs a plain torchvision loader, same files, workers and policy;
    with several data sets (or --latency-ms), of the pipeline over each one's storage.

    Storage rows: local files, local shards, S3 files (serial: one GET per image; batched:
    data.io_concurrency GETs at once), S3 shards; each with its ratio to the first row.

    Examples:

    * `ddp bench data demo --workers 2 --seconds 10`
    * `ddp bench data imagenet_local --workers 8 --json`
    * `ddp bench data imagenet_local --workers 2 --policy all --seconds 120`
    * `ddp bench data imagenet_local --workers 2 --image-size 112 --full-decode`
    * `ddp bench data jpegs jpegs_shards jpegs_s3 jpegs_s3_shards --latency-ms 50 --workers 2`
    """
    from ddp_cli.bench.data import POLICIES, bench_data
    from ddp_cli.bench.storage import bench_storage

    if len(names) > 1 or latency_ms:
        result = bench_storage(names, registry, latency_ms, workers, seconds, batch_size, image_size, rounds)
        emit(result, as_json, lambda: print_bench(result))
        return
    if split not in ("train", "val"):
        raise ConfigError(f"--split {split}: use train or val")
    policies = POLICIES if policy == "all" else tuple(dict.fromkeys(policy.split(",")))
    if unknown := [p for p in policies if p not in POLICIES]:
        raise ConfigError(f"--policy {unknown[0]}: use {', '.join(POLICIES)} or all")
    result = bench_data(names[0], registry, split, workers, seconds, batch_size, image_size, policies, rounds,
                        full_decode)
    emit(result, as_json, lambda: print_bench(result))


@command(bench_app, "allreduce")
def allreduce(
    sizes: Annotated[str, typer.Option(metavar="MIB,...", help="Buffer sizes, MiB, comma-separated.")]
    = "1,4,16,64",
    world_size: WorldOpt = 2,
    budget: Annotated[float, typer.Option(
        min=1, metavar="MIB", help="MiB reduced per size (repeats = budget/size).")] = 512,
    as_json: JsonOpt = False,
) -> None:
    """gloo all-reduce bandwidth for gradient-sized buffers vs a local memory copy of the same size.

    Examples:

    * `ddp bench allreduce`
    * `ddp bench allreduce --sizes 0.25,1,4 --json`
    """
    from ddp_cli.bench.allreduce import bench_allreduce

    try:
        sizes_mb = [float(s) for s in sizes.split(",")]
    except ValueError:
        raise ConfigError(f"--sizes {sizes}: expected MiB numbers separated by commas, e.g. 1,4,16") from None
    if not sizes_mb or min(sizes_mb) <= 0:
        raise ConfigError(f"--sizes {sizes}: sizes must be positive")
    result = bench_allreduce(sizes_mb, world_size, 1, budget)
    emit(result, as_json, lambda: print_bench(result))


@command(bench_app, "memory")
def memory(
    rows: Annotated[int, typer.Option(
        min=1000, metavar="N", help="Train rows of the index (ImageNet: 1,281,167).")] = 1_281_167,
    workers: Annotated[int, typer.Option(
        min=1, metavar="N", help="DataLoader processes walking the index.")] = 4,
    as_json: JsonOpt = False,
) -> None:
    """Private memory the index costs a rank and each loader process over one pass, vs Python lists.

    Examples:

    * `ddp bench memory`
    * `ddp bench memory --rows 100000 --workers 2 --json`
    """
    from ddp_cli.bench.memory import bench_memory

    result = bench_memory(rows, workers)
    emit(result, as_json, lambda: print_bench(result, table="forms"))


@command(bench_app, "e2e")
def e2e(
    config: Annotated[Path, typer.Argument(metavar="CONFIG", help="Run config with a local data set.")]
    = Path("configs/demo.toml"),
    target: Annotated[float, typer.Option(min=0, max=1, metavar="TOP1", help="Val top-1 to reach.")] = 0.95,
    rounds: Annotated[int, typer.Option(min=1, metavar="N", help="Alternating rounds of both runs.")] = 1,
    epochs: Annotated[int | None, typer.Option(
        min=1, metavar="N", help="Epochs of both runs (default: the config's).")] = None,
    baseline: Annotated[str, typer.Option(
        metavar="torchrun|reference",
        help="The torchrun script's recipe: torchrun, the config's own (the engines compared); reference, "
             "torchvision's reference recipe (SGD 0.1 per 256 images, weight decay 1e-4, constant LR, "
             "fp32: the engine and the recipe compared).")] = "torchrun",
    registry: RegistryOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Wall time to reach a val top-1 target: `ddp train` vs a hand-written torchrun script, with the
    config's recipe or torchvision's reference recipe.

    Examples:

    * `ddp bench e2e`
    * `ddp bench e2e configs/demo.toml --rounds 3 --json`
    * `ddp bench e2e configs/demo.toml --baseline reference --rounds 1 --json`
    """
    if baseline not in ("torchrun", "reference"):
        raise ConfigError(f"--baseline {baseline}: use torchrun or reference")
    from ddp_cli.bench.e2e import bench_e2e

    result = bench_e2e(config, registry, target, rounds, epochs, baseline)
    # the title names the baseline; the JSON keeps `bench: e2e` and says it in `baseline`
    emit(result, as_json, lambda: print_bench({**result, "bench": f"e2e against the {baseline} baseline"}))
