# Two commands on a fresh machine (Python 3.11 with venv):
#   make example   set up a light venv (numpy only) and run the estimator on the bundled launch script
#   make test      set up the pinned test venv (torch 2.13.0 CPU, megatron-core 0.16.1) and run the tests
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check -q

.PHONY: example test test-all refit bench fuzz accuracy reserved gpu-validation recompute-twins clean

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)

# The estimator needs numpy only; the package itself is installed editable so `get-training-info` exists too.
$(VENV)/.estimator-ready: $(VENV)/bin/python setup.py
	$(PIP) install -e .
	touch $@

$(VENV)/.test-ready: $(VENV)/.estimator-ready requirements-test.txt
	$(PIP) install -r requirements-test.txt
	touch $@

example: $(VENV)/.estimator-ready
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" bash examples/estimate_llama2_7b.sh

# Two workers (the CI machine has two cores): the suite is mostly single-threaded megatron-core runs; work
# stealing keeps the two busy to the end (a few tests take minutes).
test: $(VENV)/.test-ready
	$(PY) -m ruff check .
	$(PY) -m pytest -n 2 --dist worksteal -m "not slow" $(PYTEST_ARGS)

# Everything, the slow end-to-end runs included (CI runs `make test`).
test-all: $(VENV)/.test-ready
	$(PY) -m ruff check .
	$(PY) -m pytest -n 2 --dist worksteal $(PYTEST_ARGS)

bench: $(VENV)/.test-ready
	$(PY) benchmarks/estimator_speed.py
	$(PY) benchmarks/tracer_speed.py
	$(PY) benchmarks/parse_speed.py
	$(PY) benchmarks/search_speed.py

# Refit every shipped program set from its committed traces; fails if a result differs from the shipped file.
refit: $(VENV)/.test-ready
	$(PY) -m fit.programs --check fit/sets/cpu_compose.json
	$(PY) -m fit.programs --check fit/sets/gpu_h100.json

# Seeded fuzzing of every input (command lines, formula sets, HF configs, traces): 2,000 cases per kind, 200 traces.
fuzz: $(VENV)/.test-ready
	$(PY) benchmarks/fuzz.py $(FUZZ_ARGS)

# Held-out CPU configs: measured peak vs predicted with the fitted and the modelled set (about 10 min on 2 cores).
accuracy: $(VENV)/.test-ready
	$(PY) benchmarks/accuracy.py $(ACCURACY_ARGS)

# Reserved-memory model: the estimator's synthesized allocation streams vs the packed CPU runs' real ones (20 s).
reserved: $(VENV)/.test-ready
	$(PY) benchmarks/reserved_model.py $(RESERVED_ARGS)

# The committed H100 validation runs (fit/validation/h100) against the estimate and the allocator model (seconds).
gpu-validation: $(VENV)/.test-ready
	$(PY) benchmarks/gpu_validation.py

# Recompute composed from each packed recomputing run's plain twin's measured segments, no fit involved (seconds).
recompute-twins: $(VENV)/.test-ready
	$(PY) benchmarks/recompute_twins.py

clean:
	rm -rf $(VENV) build *.egg-info
