# make setup: .venv with the pinned dependencies and this project installed editable (idempotent).
# make demo / make test / make lint set up when needed.
# MXNET: the MXNet build to install; on a GPU machine e.g. make setup MXNET=mxnet-cu112==1.9.1 (README: GPUs).
PYTHON ?= python3
MXNET ?= mxnet==1.9.1
VENV := .venv
PY := $(VENV)/bin/python
MXNET_NAME := $(firstword $(subst ==, ,$(MXNET)))
STAMP := $(VENV)/.installed-$(MXNET_NAME)

.PHONY: setup demo test lint clean horovod

setup: $(STAMP)

$(STAMP): requirements.txt requirements-dev.txt constraints.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# Another MXNet build would share the mxnet/ package folder with this one: remove it first.
	$(PY) -m pip freeze | grep -iE '^mxnet(-cu[0-9]+)?==' | cut -d= -f1 | grep -vix '$(MXNET_NAME)' \
		| xargs -r $(PY) -m pip uninstall -q -y
	rm -f $(VENV)/.installed*
	$(PY) -m pip install -q -c constraints.txt '$(MXNET)' -r requirements.txt -r requirements-dev.txt
	$(PY) -m pip install -q -c constraints.txt -e .
	$(PY) -c 'from ssdsgd.compression import kernels; kernels.warm()'  # numba's cache: compiled once here, not in a job
	touch $(STAMP)

demo: setup
	OMP_NUM_THREADS=1 $(PY) scripts/demo.py

# Two test files at a time (pytest-xdist): a job test spends much of its time waiting (start-up
# barriers, timeouts it provokes), and each file's tests stay together in one process (module
# fixtures such as the virtual cluster are built once). The files start in tests/conftest.py's
# order, the slowest first (--no-loadscope-reorder keeps xdist from sorting them by test count).
test: setup
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder --durations=25 tests

# Horovod for bench/bench_horovod.py only (a benchmark dependency): compiled here, needs g++ and cmake.
horovod: setup
	bench/install_horovod.sh $(VENV)

lint: setup
	$(PY) -m ruff check .

clean:
	rm -rf runs .pytest_cache
