# Two commands: `make train` (the demo, end to end) and `make test`.
# Both share `make setup`: a .venv with the core, every extra and the test and docs groups, at the
# versions of constraints.txt (torch/torchvision pinned as a matched pair).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# the site: strict (a broken link, page or anchor fails), offline; without Material's notice
MKDOCS := NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

.PHONY: setup train test test-fast test-scale test-chaos test-cpu-kinds test-cuda test-browser gpu-check lint docs clean constraints \
	mutate fuzz bench-sweep

setup: $(STAMP)

# pip >= 25.1 reads PEP 735 dependency groups (--group). pip byte-compiles what it installs: keep it so. With
# --no-compile the install took 192 s instead of 375 s here, but where PYTHONDONTWRITEBYTECODE=1 (CI's
# containers set it) no .pyc is ever written afterwards, and every interpreter the tests start compiles
# torch afresh (~55 s of CPU each): the end-to-end tests ran past 20 minutes.
$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade 'pip>=25.1'
	$(BIN)/python -m pip install -q -c constraints.txt -e '.[all]' --group test --group docs
	touch $(STAMP)

# After a passing `make test` with newer packages: pin what passed.
constraints: setup
	$(BIN)/python tools/constraints.py

train: setup
	$(BIN)/ddp train configs/demo.toml

# The docs site (strict); the in-process unit tests and the fake-GPU layer (tests/gpu_rules: the GPU
# paths as rank 3 of 8 on cuda:3, on the CPU) on every core (pytest-xdist); then the end-to-end tests,
# two files at a time (a file's tests on one xdist worker, so its module fixtures are made once): their
# runs spawn workers on every core themselves, but spend much of their time waiting (interpreters
# starting, rendezvous, timeouts of the fault tests), which the other file's run fills. The slowest
# are named at the end (--durations), for whoever trims the suite next.
test: setup
	$(BIN)/ruff check .
	$(MKDOCS) --quiet
	$(BIN)/python -m pytest -q -n auto tests/unit tests/gpu_rules tests/fuzz
	$(BIN)/python -m pytest -q -n 2 --dist loadfile --durations=15 tests/e2e tests/cuda

# Between edits (under 3 minutes on 2 cores): ruff, then the unit, fake-GPU and fuzz tests on every core,
# in-process: no e2e test, none marked `processes` (the few unit tests that start an interpreter or
# forked/spawned workers; `make test` runs them), and no docs build.
test-fast: setup
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q -n auto -m "not processes" tests/unit tests/gpu_rules tests/fuzz

# 32 ranks on this machine (tests/scale): 8 `ddp train` launchers x 4 workers on loopback (gloo, the demo's tiny
# model at 8 px): an epoch, its validation equal to world 1's, a resume at world 24, and `--nnodes 6:8` losing two
# launchers. Prints the rendezvous time, memory per rank and open files per process (runs/test-scale.json;
# BENCHMARKS.md, "32 ranks on one machine"). Not in `make test`: 6-11 minutes on 2 shared cores, every core busy.
test-scale: setup
	$(BIN)/python -m pytest -q -s -p no:cacheprovider tests/scale

# The demo trained under faults drawn from SEED (tests/chaos; docs/multi-node.md, "Chaos"): workers killed
# twice, object storage failing 5% of requests with 50 ms latency (data and run dir in the loopback bucket), a
# SIGTERM and a full disk, each followed by a resume; the final weights must equal the unbroken run's, bit for bit.
# Prints the schedule, so a failure replays with the same SEED. Needs root (a small tmpfs for the full disk).
# About 6-7 minutes per seed on 2 shared cores (BENCHMARKS.md, "Chaos").
SEED ?= 0
test-chaos: setup
	DDP_CHAOS_SEED=$(SEED) $(BIN)/python -m pytest -q -s -p no:cacheprovider tests/chaos

# The end-to-end suite as other CPUs run it, from this one (tools/cpu_kinds.py; docs/development.md, "Other
# CPUs"): `auto` precision and torch's kernels as on an AVX2-only CPU, every process on one core; then bf16 as
# where it is native, on all cores. Run it after changing an e2e test that times or compares accuracy.
KINDS ?= avx2-slow bf16-fast
test-cpu-kinds: setup
	$(BIN)/python tools/cpu_kinds.py $(KINDS)

# `ddp report --html`'s page rendered by a real browser (tests/browser): headless chromium, no console error,
# the inline script sorting; fails where chromium is missing (`apt-get install chromium`), so `make test` needs none.
test-browser: setup
	DDP_REQUIRE_BROWSER=1 $(BIN)/python -m pytest -q -m browser tests/browser -rs

# The GPU paths (NCCL, bf16/fp16 autocast + GradScaler, pinned loaders); skipped without CUDA.
test-cuda: setup
	$(BIN)/python -m pytest -m cuda tests/cuda -rs

# On a machine with a CUDA GPU, at most ten minutes: the driver and build, tests/cuda, ResNet-50 on generated
# JPEGs through `ddp` (train, resume, validate, predict, export; fp16, bf16, PowerSGD, SyncBatchNorm), ddp's
# step against a bare DDP loop, and the input stage: ResNet-50 batch 256 fed from ImageNet-like JPEGs decoded
# "cpu", "gpu" and "auto", on every core and on 4, against synthetic tensors (tools/gpu_check.py; docs/gpus.md). Writes
# runs/gpu-check-*/report.json; exit 0 only if every stage held, 2 on a machine without a GPU.
gpu-check: setup
	$(BIN)/python tools/gpu_check.py

# Mutation testing of the core (mutmut 3; [tool.mutmut] in pyproject.toml lists the modules): small
# plausible changes ("mutants") are made to the code, one at a time, and each must make a unit test fail.
# Not part of `make test` (time): run it after changing a core module or its tests, scoped to that module:
#   make mutate MODULE=ddp_cli/data/fetch/retry.py
# The first run traces the core's own unit test files once (pytest_add_cli_args_test_selection; ~2 min)
# to learn which tests cover which function; then each mutant runs only those tests, in-process,
# MUTATE_JOBS at a time. Measured on 2 cores (AVX2): the whole core, 2032 mutants, 18 min 37 s.
# With MODULE every mutant of it is retested; without, only those not yet tested or whose function changed
# (results are kept in mutants/, git-ignored; `rm -rf mutants` starts afresh). It ends with the score per
# module (tools/mutation_score.py), which fails if a survivor has no row in tests/mutation-survivors.md.
MODULE ?=
MUTATE_JOBS ?= 2
mutate: setup
	$(BIN)/mutmut run --max-children $(MUTATE_JOBS) $(if $(MODULE),'$(subst /,.,$(basename $(MODULE))).*')
	$(BIN)/python tools/mutation_score.py $(MODULE)

# The fuzz suite's longer search (tests/fuzz; docs/development.md, "Fuzzing"): 25 times the examples of
# `make test`, drawn afresh each run (make test's are fixed), minutes. Run it after touching a parser
# or reader of users' files; a failure it finds goes into tests/fuzz/corpus/<target>/ as a named case.
fuzz: setup
	DDP_FUZZ=long $(BIN)/python -m pytest -q -n auto tests/fuzz

# BENCHMARKS.md, "Sweeps" (not part of `make test`: ~10 minutes on 2 cores): a 12-trial sweep of the demo
# with pruning, then its best config and the shipped demo config trained once each (runs/bench-sweep/).
bench-sweep: setup
	PATH=$(CURDIR)/$(BIN):$$PATH benchmarks/sweep_demo.sh runs/bench-sweep

lint: setup
	$(BIN)/ruff check .

clean:
	rm -rf runs .data .pytest_cache .hypothesis site

# The documentation site from docs/ into site/ (the CLI and config references generated from the code).
docs: setup
	$(MKDOCS)
