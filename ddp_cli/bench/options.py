"""`ddp bench options`: ddp's step with one setting changed at a time, against ddp's defaults.

The settings the performance issue asks to keep only if measured: DDP's
bucket size, `gradient_as_bucket_view`, `static_graph`, and `torch.compile`.
Same workers, synthetic images, model, batch and fast precision as `bench
step`; every variant builds a fresh Trainer with its `--set` override, the
variants alternate over `rounds` in a rotating order, and each rate is all
images over all timed seconds (the warm-up, which includes compilation, is
not timed). Ratio > 1: the setting helps.
"""

from __future__ import annotations

from ddp_cli.bench.step import CPU, StepSpec, step_header, time_ddp
from ddp_cli.run.loopback import run_workers
from ddp_cli.train.precision import native_precision

VARIANTS: dict[str, tuple[str, ...]] = {
    "defaults": (),
    "bucket_cap_mb=1": ("distributed.bucket_cap_mb=1",),
    "bucket_cap_mb=100": ("distributed.bucket_cap_mb=100",),
    "gradient_as_bucket_view=false": ("distributed.gradient_as_bucket_view=false",),
    "static_graph=true": ("distributed.static_graph=true",),
    "compile=true": ("train.compile=true",),
}


def _options_worker(rank: int, world_size: int, spec: StepSpec, precision: str,
                    names: list[str]) -> dict[str, float]:
    seconds = dict.fromkeys(names, 0.0)
    for r in range(spec.rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            seconds[name] += time_ddp(spec, precision, True, VARIANTS[name])
    return seconds


def bench_options(spec: StepSpec, world_size: int = 2, threads: int = 1,
                  names: list[str] | None = None) -> dict:
    names = names or list(VARIANTS)
    precision = native_precision(CPU)
    seconds = run_workers(_options_worker, world_size, spec, precision, names, threads=threads)[0]
    images = spec.rounds * spec.steps * spec.batch_size * world_size
    rate = {name: images / s for name, s in seconds.items()}
    base = rate.get("defaults")
    rows = [{"variant": name, "set": " ".join(VARIANTS[name]) or "(ddp's defaults)", "images": images,
             "seconds": seconds[name], "images_per_second": rate[name],
             "vs_defaults": rate[name] / base if base else None} for name in names]
    return {
        **step_header("options", spec, world_size, threads),
        "precision": precision,
        "channels_last": True,
        "rows": rows,
    }
