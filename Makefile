# `make demo` and `make test` set up .venv on first use (python3 -m venv + requirements.txt).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# Test processes: the suite is dominated by XLA compiles, which one process runs on one core.
TEST_WORKERS ?= 2
STAMP := $(VENV)/.installed
# The demo's members at once: its tiny models leave a second core half idle (2026-12-03, 2-core
# Xeon: two training processes 1.19x the tokens/s of one).
DEMO_PARALLEL ?= 2

.PHONY: demo test fuzz bench results accelerator-check clean

$(STAMP): requirements.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements.txt
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m experiments.run --config=configs/lm_extrapolation.py:quick --workdir=runs/demo \
	    --parallel=$(DEMO_PARALLEL)

test: $(STAMP)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile tests

# Config fuzzing beyond the examples `make test` draws (tests/test_fuzz_configs.py); FUZZ_SEED=N
# repeats a run.
fuzz: $(STAMP)
	FUZZ_EXAMPLES=$${FUZZ_EXAMPLES:-300} $(PY) -m pytest -q -p no:cacheprovider tests/test_fuzz_configs.py

# Each suite rewrites its block of BENCHMARKS.md and its figure in docs/bench/ (peers needs
# requirements-peers.txt and runs on its own: BENCHMARKS.md gives the command).
BENCH_SUITES := mixers decode train state recurrent
bench: $(STAMP)
	set -e; for suite in $(BENCH_SUITES); do \
	  $(PY) -m experiments.bench --suite=$$suite --workdir=runs/bench --benchmarks=BENCHMARKS.md; \
	done

# Every result figure and table of README.md and docs/ from the current code, each quick preset
# in turn (hours on 2 CPU cores); RESULTS=demo,mad makes some (experiments/results.py).
results: $(STAMP)
	$(PY) -m experiments.results $(if $(RESULTS),--only=$(RESULTS))

# On a GPU machine, after `pip install -r requirements-gpu.txt` in .venv: under 10 minutes on one
# H200, appends a dated table to BENCHMARKS.md (experiments/accelerator_check.py).
accelerator-check: $(STAMP)
	$(PY) -m experiments.accelerator_check --workdir=runs/accelerator_check_$$(date +%Y%m%d_%H%M%S)

clean:
	rm -rf $(VENV) runs
