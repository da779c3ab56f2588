# make setup: .venv with pinned dependencies (idempotent). make demo / make test set up when needed.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup demo test clean

setup: $(STAMP)

$(STAMP): requirements.txt constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -r requirements.txt
	touch $(STAMP)

demo: setup
	OMP_NUM_THREADS=1 $(PY) scripts/demo.py

test: setup
	OMP_NUM_THREADS=1 $(PY) -m pytest -q tests

clean:
	rm -rf runs .pytest_cache
