"""The end-to-end suite as it runs on other kinds of CPU, from whichever machine is at hand
(docs/development.md, "Other CPUs"). `make test-cpu-kinds`; KINDS picks among:

- avx2-*: `train.precision = "auto"` resolves as where bf16 is emulated (fp32: `DDP_CPU_BF16=emulated`)
  and torch's CPU kernels are held to AVX2 (oneDNN's `ONEDNN_MAX_CPU_ISA=AVX2`, ATen's
  `ATEN_CPU_CAPABILITY=avx2`);
- bf16-*: `auto` resolves to bf16 as where the CPU has AVX-512 BF16 or AMX (`DDP_CPU_BF16=native`;
  emulated, so slow, on a machine without them);
- *-slow: every process of the suite on one core with one thread (a slow machine: a test racing the
  clock is late); *-fast: all cores, as `make test` runs.

The default, "avx2-slow bf16-fast", covers both sides of each axis in two runs. Each run is the
end-to-end line of `make test`; exit 1 if any failed. Prints the CPU (lscpu's model, family and the
flags that matter) and each run's time.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PRECISION = {
    "avx2": {"DDP_CPU_BF16": "emulated", "ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"},
    "bf16": {"DDP_CPU_BF16": "native"},
}
SPEEDS = ("slow", "fast")
E2E = ["-m", "pytest", "-q", "-n", "2", "--dist", "loadfile", "--durations=5", "tests/e2e", "tests/cuda"]
FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")


def cpu() -> str:
    """lscpu's model name, family and model, and which of the flags that change ddp's precision it has."""
    fields = dict(line.split(":", 1) for line in subprocess.run(
        ["lscpu"], capture_output=True, text=True, check=False).stdout.splitlines() if ":" in line)
    flags = fields.get("Flags", "").split()
    have = " ".join(flag for flag in FLAGS if flag in flags) or "no AVX2"
    return (f"{fields.get('Model name', '?').strip()}, family {fields.get('CPU family', '?').strip()} "
            f"model {fields.get('Model', '?').strip()}, {os.cpu_count()} cores; {have}")


def run(kind: str, extra: list[str]) -> tuple[bool, float]:
    precision, _, speed = kind.partition("-")
    env = {**os.environ, **PRECISION[precision]}
    pin = None
    if speed == "slow":
        env["OMP_NUM_THREADS"] = "1"
        pin = lambda: os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})  # noqa: E731 (children inherit)
    start = time.monotonic()
    done = subprocess.run([sys.executable, *E2E, *extra], cwd=REPO, env=env, preexec_fn=pin, check=False)
    return done.returncode == 0, time.monotonic() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    kinds = [f"{p}-{s}" for p in PRECISION for s in SPEEDS]
    parser.add_argument("kinds", nargs="*", default=["avx2-slow", "bf16-fast"], choices=kinds, metavar="KIND",
                        help=f"one or more of {', '.join(kinds)}")
    parser.add_argument("--pytest", default="", help="more pytest arguments, e.g. '-k fault'")
    args = parser.parse_args()
    print(f"CPU: {cpu()}", flush=True)
    results = {}
    for kind in args.kinds:
        print(f"== {kind}", flush=True)
        results[kind] = run(kind, args.pytest.split())
    for kind, (passed, seconds) in results.items():
        print(f"{kind}: {'passed' if passed else 'FAILED'} in {seconds / 60:.1f} min")
    sys.exit(0 if all(passed for passed, _ in results.values()) else 1)


if __name__ == "__main__":
    main()
