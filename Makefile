# Two commands: `make train` (the demo, end to end) and `make test`.
# Both share `make setup`: a .venv with the core, every extra and the test and docs groups, at the
# versions of constraints.txt (torch/torchvision pinned as a matched pair).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# the site: strict (a broken link, page or anchor fails), offline; without Material's notice
MKDOCS := NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

.PHONY: setup train test test-cuda lint docs clean constraints

setup: $(STAMP)

# pip >= 25.1 reads PEP 735 dependency groups (--group).
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

# The docs site (strict); the in-process unit tests on every core (pytest-xdist); then the end-to-end
# tests, whose runs spawn workers on every core themselves, one at a time.
test: setup
	$(BIN)/ruff check .
	$(MKDOCS) --quiet
	$(BIN)/python -m pytest -q -n auto tests/unit
	$(BIN)/python -m pytest -q tests/e2e tests/cuda

# The GPU paths (NCCL, bf16/fp16 autocast + GradScaler, pinned loaders); skipped without CUDA.
test-cuda: setup
	$(BIN)/python -m pytest -m cuda tests/cuda -rs

lint: setup
	$(BIN)/ruff check .

clean:
	rm -rf runs .data .pytest_cache site

# The documentation site from docs/ into site/ (the CLI and config references generated from the code).
docs: setup
	$(MKDOCS)
