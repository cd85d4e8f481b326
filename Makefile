# Two set-up-to-result targets for a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install demo test bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/ckptless-run --standalone --nproc-per-node 2 examples/train_demo.py

test: $(STAMP)
	$(PY) -m pytest -q -m "not slow" tests

clean:
	rm -rf $(VENV) build *.egg-info
