# Every target creates (or reuses) its own virtualenv in .venv. torch 2.13.0 is installed first
# from the local CPU wheel so that pip never resolves a newer CUDA build of torch.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# what ruff checks (configured in pyproject.toml); mypy's files are in pyproject.toml too
LINT_PATHS := lightning_gsched tests examples benchmarks

.PHONY: setup demo lint test bench bench-repeat clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[dev]"
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(PY) examples/demo.py

# ruff (pyflakes, import order, bugbear) and strict mypy on the whole package (the modules
# pyproject.toml's [tool.mypy] overrides exempt are named there, with why). mypy's worker
# processes (`-n 2`, 37 s instead of 44 s alone) are not used: beside the suite, starved of
# CPU, its workers failed to start ("Failed to establish connection with worker", 2026-11-28)
lint: $(STAMP)
	$(PY) -m ruff check $(LINT_PATHS)
	$(PY) -m mypy

# ruff first (a second), then the launched tests (marker `distributed`) one after another at
# normal priority, on worker processes the whole session shares, one set per world size
# (tests/dist_harness.py), and beside them, at the lowest CPU priority (nice 19), the
# single-process tests on two xdist workers (one torch thread each) and mypy: the launched part
# leaves about a core idle (its ranks wait on each other and on start-up), which the niced parts
# take (fresh clone: 868 s one after the other, 726 s side by side; docs/ARCHITECTURE.md,
# "Checks"). Their output is printed at the end; make fails if ruff, either part or mypy fails
test: $(STAMP)
	$(PY) -m ruff check $(LINT_PATHS)
	nice -n 19 $(PY) -m mypy > $(VENV)/mypy.log 2>&1 & mypy=$$!; \
	OMP_NUM_THREADS=1 nice -n 19 $(PY) -m pytest -q -m "not distributed" -n 2 --durations=10 \
		> $(VENV)/single.log 2>&1 & single=$$!; \
	$(PY) -m pytest -q -m distributed --durations=25; launched=$$?; \
	wait $$single; alone=$$?; echo "single-process tests (run beside):"; cat $(VENV)/single.log; \
	wait $$mypy; typed=$$?; echo "mypy (run beside the tests):"; cat $(VENV)/mypy.log; \
	test $$launched -eq 0 && test $$alone -eq 0 && test $$typed -eq 0

bench: $(STAMP)
	$(PY) benchmarks/run.py --quick

# the reproducibility check: the quick suite three times, each row's ratios and their largest
# deviation from the median (docs/benchmarks.md, "How to read the spread"); ~3x `make bench`
bench-repeat: $(STAMP)
	$(PY) benchmarks/run.py --quick --repeat 3

# Third-party models (transformers 5.x, litgpt) split by partition() with default options:
# tests/test_zoo.py, skipped by `make test` when they are missing. Every package is installed
# with --no-deps so pip never touches torch; their pure-Python requirements are listed by hand
# (huggingface-hub 1.x satisfies what both packages import, though their pins disagree).
ZOO_STAMP := $(VENV)/.zoo-installed
ZOO_PACKAGES := "transformers==5.*" litgpt "huggingface-hub>=1.31,<2" tokenizers safetensors \
	regex httpx httpcore anyio h11 certifi idna sniffio click psutil jsonargparse \
	docstring-parser typeshed-client pyyaml tqdm packaging numpy filelock fsspec typing-extensions

.PHONY: test-zoo

$(ZOO_STAMP): $(STAMP)
	$(PY) -m pip install -q --no-deps $(ZOO_PACKAGES)
	$(PY) -c "import torch, transformers, litgpt.model; print('torch', torch.__version__, \
		'transformers', transformers.__version__)"
	touch $(ZOO_STAMP)

test-zoo: $(ZOO_STAMP)
	$(PY) -m pytest -q -rs tests/test_zoo.py

clean:
	rm -rf $(VENV) build *.egg-info .mypy_cache .ruff_cache
