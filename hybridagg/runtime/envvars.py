"""Every environment variable hybridagg reads, in one place.

No other module calls ``os.environ`` with a literal name: each variable is
declared here once with its default and meaning, read through the typed
getters below, and listed by ``hybridagg env`` (and in the README).

Variables owned by hybridagg start with ``HYBRIDAGG_``. Variables set by
launchers (Slurm, Open MPI, MPICH/PMI) or by other libraries are declared too,
marked ``owner`` accordingly, because hybridagg reads them.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = [
    "ENV_VARS",
    "EnvVar",
    "check_all",
    "describe",
    "export",
    "get_bool",
    "get_float",
    "get_int",
    "get_str",
    "indexed",
]


@dataclass(frozen=True)
class EnvVar:
    """One environment variable hybridagg reads.

    Attributes:
        name: The variable's name.
        default: Value used when it is unset (``None``: no default).
        doc: What it means.
        owner: Who sets it: ``"hybridagg"`` (the user), or the launcher or
            library that defines it.
        kind: How it is read: ``"str"``, ``"int"``, ``"float"`` (finite) or
            ``"bool"``; :func:`check_all` reads every variable so.
        positive: A number that must be above zero.
    """

    name: str
    default: str | None
    doc: str
    owner: str = "hybridagg"
    kind: str = "str"
    positive: bool = False


_DECLARED = [
    # --- hybridagg's own knobs -------------------------------------------
    EnvVar(
        "HYBRIDAGG_TIMEOUT",
        "600",
        "Seconds any single wait on MPI may take before it raises a "
        "CommTimeoutError naming the operation and peer (the job then aborts, "
        "exit 5). Time during which some rank is in a declared solo phase "
        "(see HYBRIDAGG_SOLO_WORK_TIMEOUT) does not count, and a dead or "
        "stuck rank is found sooner by the heartbeat "
        "(HYBRIDAGG_FAILURE_TIMEOUT): this bounds how long a live peer may "
        "leave a wait unanswered outside solo phases (a hang, a deadlock, a "
        "peer far slower than expected).",
        kind="float",
        positive=True,
    ),
    EnvVar(
        "HYBRIDAGG_FAILURE_TIMEOUT",
        "30",
        "Seconds within which a dead or stuck rank is detected, even when the "
        "launcher keeps the job alive after a rank dies (mpirun --with-ft "
        "ulfm or --enable-recovery, some srun settings): every rank sends a "
        "tiny heartbeat to the next one in a ring from a background thread; "
        "one silent for about this long is declared, the message names it "
        "and its role, and every rank exits 5. Finite and positive.",
    ),
    EnvVar(
        "HYBRIDAGG_SOLO_WORK_TIMEOUT",
        "3600",
        "Seconds one rank may spend on work the others wait for: rank 0's "
        "validation, checkpoint writes and commits (rank 0, the servers), the "
        "final metrics merge and summary. Meanwhile the other ranks' waits "
        "do not run into HYBRIDAGG_TIMEOUT; past this, the rank aborts the "
        "job (exit 5) naming the phase. Finite and positive.",
        kind="float",
        positive=True,
    ),
    EnvVar(
        "HYBRIDAGG_SURVIVOR_WAIT",
        "86400",
        "With --on-group-failure continue: seconds the surviving ranks of a "
        "dropped group wait for the rest of the job to end (they exit with the "
        "others: a rank that leaves early with a non-zero code makes Open MPI's "
        "launcher end the job).",
        kind="float",
        positive=True,
    ),
    EnvVar(
        "HYBRIDAGG_LOG_LEVEL",
        "warning",
        "Level of hybridagg's log messages (debug, info, warning, error) for a "
        "script that uses the library: hybridagg.init() shows them on stderr, "
        "tagged '[rank R]'. hybridagg train takes --log-level instead.",
    ),
    EnvVar(
        "HYBRIDAGG_LOG_RANKS",
        "0",
        "Which ranks show hybridagg's log messages: 0 (rank 0 only) or all "
        "(every rank, each line tagged with its rank).",
    ),
    EnvVar(
        "HYBRIDAGG_HOST_STAGING",
        "auto",
        "How GPU tensors reach MPI: auto (through pinned host memory, unless "
        "the MPI library is CUDA-aware, as Open MPI's MPIX_Query_cuda_support "
        "tells; the PyPI Open MPI is not), always (every tensor through a host "
        "buffer, CPU ones too: how CI exercises the GPU path without a GPU) "
        "or never (device memory straight to MPI; refused where MPI is not "
        "CUDA-aware).",
    ),
    EnvVar(
        "HYBRIDAGG_EXIT_CODES",
        "0",
        "With --on-group-failure continue: 1 makes each rank's process exit with "
        "its status code (4 finished with losses, 5 aborted, 6 group lost); by "
        "default it exits 0 and its final status line says the code, because "
        "Open MPI 5's launcher under --with-ft ulfm can hang when a rank exits "
        "non-zero.",
        kind="bool",
    ),
    EnvVar(
        "HYBRIDAGG_POLL_SPIN_US",
        "100",
        "Microseconds a wait spins on MPI_Test before it starts sleeping.",
        kind="float",
    ),
    EnvVar(
        "HYBRIDAGG_POLL_MAX_SLEEP_US",
        "2000",
        "Longest sleep between two polls of a pending MPI request (back-off cap).",
        kind="float",
    ),
    EnvVar(
        "HYBRIDAGG_SERVER_THREADS",
        None,
        "Compute threads of a parameter-server rank (torch.set_num_threads): "
        "its optimizer update, torch's fused kernel, runs on this many cores. "
        "Give servers on hosts of their own the cores their host has spare. "
        "Default: the workers' setting (HYBRIDAGG_NUM_THREADS, else "
        "OMP_NUM_THREADS, else 1).",
        kind="int",
        positive=True,
    ),
    EnvVar(
        "HYBRIDAGG_SERVER_MAX_SLEEP_US",
        "500",
        "Back-off cap of a parameter server waiting for the next message "
        "(lower than HYBRIDAGG_POLL_MAX_SLEEP_US, which still bounds it): the "
        "server's reaction time adds to every push's round trip, while an "
        "idle server wakes up more often (its cost: bench/RESULTS.md). After "
        "a long silence the general cap applies again.",
        kind="float",
        positive=True,
    ),
    EnvVar(
        "HYBRIDAGG_RING_MIN_BYTES",
        "1048576",
        "Sum all-reduces of CPU buffers at least this large use hybridagg's "
        "pipelined ring of non-blocking point-to-point messages instead of "
        "MPI_Iallreduce (0: always the ring; a huge value: never). "
        "Must be the same on every rank (DistributedOptimizer checks).",
        kind="int",
    ),
    EnvVar(
        "HYBRIDAGG_RING_CHUNK_BYTES",
        "4194304",
        "Pipelining chunk of the ring all-reduce: each segment is cut into "
        "chunks of about this size that advance independently. "
        "Must be the same on every rank (DistributedOptimizer checks).",
        kind="int",
        positive=True,
    ),
    EnvVar(
        "HYBRIDAGG_SETTLED_MAX_BYTES",
        "33554432",
        "A sum all-reduce that every rank is known to have reached "
        "(settled) and that is below this size takes a ring of blocking "
        "MPI_Sendrecv calls (0: never). The gradient bucket that completes "
        "last in backward (nothing is left to overlap) is reduced in "
        "synchronize(): in flat mode from HYBRIDAGG_RING_MIN_BYTES up to "
        "below this size together with the control vector (in shared memory, "
        "see HYBRIDAGG_SHM_REDUCE, or by hybridagg.collectives.mean_allreduce), "
        "above it after the control all-reduce as a settled all-reduce. "
        "Must be the same on every rank (DistributedOptimizer checks).",
        kind="int",
    ),
    EnvVar(
        "HYBRIDAGG_SHM_REDUCE",
        "1",
        "1: when every rank of a flat reduction shares a node, the last "
        "gradient bucket (below HYBRIDAGG_SETTLED_MAX_BYTES) lives in an MPI "
        "shared-memory window and is reduced with loads and stores "
        "(hybridagg.collectives.shm), without messages, and a small one (at "
        "most 128 KiB) "
        "is staged there with the step's control vector and reduced by every "
        "rank after one flag wait; 0: always through MPI messages. "
        "Used only when every rank of the group says 1 and /dev/shm has room "
        "for twice the window.",
        kind="bool",
    ),
    EnvVar(
        "HYBRIDAGG_DATA_DIRECT_READ",
        "1",
        "1: the data loader reads unfiltered whole-row chunks of the samples "
        "dataset with os.preadv at the addresses in HDF5's chunk index (no "
        "GIL held, so reads overlap batch assembly); 0: always h5py's "
        "read_direct. Other layouts always use h5py.",
        kind="bool",
    ),
    EnvVar(
        "HYBRIDAGG_PS_PART_BYTES",
        "4194304",
        "Parameter-server messages are cut into parts of about this size; a "
        "server updates and returns each part as soon as it arrives, so "
        "transfer and update overlap. Must be the same on every rank.",
        kind="int",
        positive=True,
    ),
    EnvVar(
        "HYBRIDAGG_NUM_THREADS",
        None,
        "Compute threads per rank (torch.set_num_threads). Default: "
        "OMP_NUM_THREADS if set, else 1, since ranks share a node's cores.",
        kind="int",
        positive=True,
    ),
    EnvVar(
        "HYBRIDAGG_ABORT_ON_ERROR",
        "1",
        "1: an unhandled exception on any rank prints the rank and reason and "
        "calls MPI_Abort so the job ends instead of hanging. 0: leave "
        "sys.excepthook alone.",
        kind="bool",
    ),
    EnvVar(
        "HYBRIDAGG_SIMGRID",
        None,
        "Path of SimGrid's Python extension (simgrid.cpython-*.so) that "
        "hybridagg simulate loads. Default: the one Debian's python3-simgrid "
        "installs under /usr/lib/python3/dist-packages (make simgrid).",
    ),
    EnvVar(
        "HYBRIDAGG_MPIEXEC",
        None,
        "Path of the mpiexec to use for child jobs (tests, benchmarks, "
        "hybridagg-run). Default: the one beside the Python interpreter "
        "(hybridagg-run: beside python3 on PATH), then PATH.",
    ),
    EnvVar(
        "HYBRIDAGG_LAUNCHER",
        "auto",
        "hybridagg-run's launcher: auto (srun inside a Slurm allocation, "
        "else mpiexec), srun, or mpiexec (e.g. an MPI without Slurm's PMI "
        "support, which reads the allocation itself).",
    ),
    EnvVar(
        "HYBRIDAGG_CLUSTER_DIR",
        "/tmp/hybridagg-cluster",
        "Folder of the state of emulated clusters (hybridagg cluster up): one "
        "subfolder per cluster name with its description, launch agent and "
        "hostfile; hybridagg-run --cluster reads it.",
    ),
    EnvVar(
        "HYBRIDAGG_SRUN_MPI",
        None,
        "srun's --mpi plugin for hybridagg-run (pmix, pmi2, none). "
        "Default: pmix when 'srun --mpi=list' offers it (Open MPI 5 needs it "
        "to form one job), else the site's MpiDefault.",
    ),
    EnvVar(
        "HYBRIDAGG_CHAIN_LINK",
        None,
        "slurm/chain.sbatch: number of this job in its resume chain (1 for the "
        "one you submit; each link submits the next with this + 1).",
        "slurm/chain.sbatch",
    ),
    EnvVar(
        "HYBRIDAGG_MODE",
        None,
        "hybridagg.torch.init() (a Horovod script run with import "
        "hybridagg.torch as hvd): sync (the default: every worker's gradients averaged "
        "before each update, as Horovod), hybrid (groups all-reduce inside and "
        "meet parameter servers asynchronously) or async (every worker alone "
        "with the servers).",
    ),
    EnvVar(
        "HYBRIDAGG_GROUPS",
        None,
        "hybridagg.torch.init(): the groups of workers, as hybridagg train "
        "--groups (e.g. 0-1,2-3; node; device; speed; slurm). Default by "
        "HYBRIDAGG_MODE: world (sync), node (hybrid), each (async).",
    ),
    EnvVar(
        "HYBRIDAGG_SERVERS",
        None,
        "hybridagg.torch.init(): parameter-server ranks, the last K of the job; "
        "they serve inside init() and exit when training ends. Default 0 in "
        "sync, 1 in hybrid and async.",
        kind="int",
    ),
    EnvVar(
        "HYBRIDAGG_SLOWDOWN",
        None,
        "Emulated heterogeneity, e.g. '0-1:1,2-3:4' (world rank: factor); "
        "seen by the speed probe of groups='speed' and by training.",
    ),
    EnvVar(
        "HYBRIDAGG_RUN_TOKEN",
        None,
        "Set by hybridagg.runtime.runner in every process of a job it starts, so that "
        "leftover ranks can be found and killed after a timeout.",
    ),
    EnvVar(
        "HYBRIDAGG_FAULT",
        None,
        "Fault injection for tests, one of: 'checkpoint:N:R' makes "
        "rank R exit in the middle of writing its part of checkpoint N; "
        "'kill:N:R' makes rank R kill itself (SIGKILL) at its step N (a "
        "worker) or its update N (a server); "
        "'stop:N:R' makes worker R stop (SIGSTOP: alive but stuck) at step N; "
        "'slow-validation:S' makes each of rank 0's validations last S "
        "seconds longer.",
        "tests",
    ),
    EnvVar(
        "HYBRIDAGG_SAMPLE_LOG",
        None,
        "A folder: each worker of hybridagg train appends the ids of the samples "
        "its loop receives to rank-RRRRR.log there (one line per batch: epoch, "
        "ids), and a '# checkpoint N' line when it writes its part of "
        "checkpoint N; for checking that a resumed run reads each sample once.",
        "tests",
    ),
    EnvVar(
        "HYBRIDAGG_TEST_RESULTS",
        None,
        "Test harness only: folder where each rank of a multi-rank test writes "
        "its outcome (its presence means 'this pytest is one rank of a test').",
        "tests",
    ),
    EnvVar(
        "HYBRIDAGG_TEST_SHARED_TMP",
        None,
        "Test harness only: a temporary folder shared by all ranks of a test.",
        "tests",
    ),
    # --- set by launchers; read to find rank and node ---------------------
    EnvVar("SLURM_PROCID", None, "Global task rank under srun.", "slurm"),
    EnvVar("SLURM_LOCALID", None, "Node-local task rank under srun.", "slurm"),
    EnvVar("SLURM_NTASKS", None, "Number of tasks in the step.", "slurm"),
    EnvVar("SLURM_JOB_ID", None, "Job id; present inside an allocation.", "slurm"),
    EnvVar(
        "SLURM_HET_JOB_ID",
        None,
        "Heterogeneous job id (the same in every component).",
        "slurm",
    ),
    EnvVar(
        "SLURM_HET_SIZE",
        None,
        "Number of components of a heterogeneous job.",
        "slurm",
    ),
    EnvVar(
        "SLURM_STEP_ID", None, "Step id; present in tasks of an srun step.", "slurm"
    ),
    EnvVar("SLURM_NODEID", None, "Index of this task's node in the step.", "slurm"),
    EnvVar(
        "SLURM_STEP_TASKS_PER_NODE",
        None,
        "Tasks per node of the step, e.g. '4(x2),3'.",
        "slurm",
    ),
    EnvVar(
        "SLURM_NTASKS_HET_GROUP_<k>",
        None,
        "Tasks of component k of a heterogeneous job (inherited by tasks "
        "started inside sbatch/salloc); with SLURM_PROCID it gives a task's "
        "component, which no Slurm variable states directly.",
        "slurm",
    ),
    EnvVar(
        "HYBRIDAGG_HET_COMPONENT",
        None,
        "This task's heterogeneous-job component, stated by hybridagg-run "
        "(srun MPMD ':' syntax, one --export per component); wins over the "
        "SLURM_NTASKS_HET_GROUP_<k> rule.",
    ),
    EnvVar(
        "OMPI_COMM_WORLD_RANK", None, "Global rank under Open MPI's mpiexec.", "openmpi"
    ),
    EnvVar("OMPI_COMM_WORLD_SIZE", None, "World size under Open MPI.", "openmpi"),
    EnvVar(
        "OMPI_COMM_WORLD_LOCAL_SIZE",
        None,
        "Ranks on this node under Open MPI.",
        "openmpi",
    ),
    EnvVar("PMI_SIZE", None, "World size under MPICH/Hydra.", "mpich"),
    EnvVar("MPI_LOCALRANKID", None, "Node-local rank under MPICH/Hydra.", "mpich"),
    EnvVar("MPI_LOCALNRANKS", None, "Ranks on this node under MPICH/Hydra.", "mpich"),
    EnvVar(
        "OMPI_COMM_WORLD_LOCAL_RANK",
        None,
        "Node-local rank under Open MPI's mpiexec.",
        "openmpi",
    ),
    EnvVar("PMI_RANK", None, "Global rank under MPICH/Hydra (PMI).", "mpich"),
    EnvVar(
        "OMP_NUM_THREADS",
        None,
        "OpenMP threads; respected as the compute-thread default.",
        "openmp",
        kind="int",
    ),
    EnvVar(
        "OMPI_ALLOW_RUN_AS_ROOT",
        None,
        "Open MPI refuses to start as root unless this and "
        "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM are 1; hybridagg.runtime.runner sets both for "
        "the jobs it starts, hybridagg-run for the Open MPI jobs it starts.",
        "openmpi",
    ),
    EnvVar(
        "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM",
        None,
        "See OMPI_ALLOW_RUN_AS_ROOT.",
        "openmpi",
    ),
    EnvVar(
        "PRTE_MCA_rmaps_default_mapping_policy",
        None,
        "Open MPI 5 (PRRTE) mapping policy; ':oversubscribe' allows more ranks "
        "than cores. Set by hybridagg.runtime.runner when oversubscribing, and "
        "by hybridagg-run for Open MPI 5 unless already set.",
        "openmpi",
    ),
    EnvVar(
        "HDF5_USE_FILE_LOCKING",
        None,
        "HDF5 file locking (FALSE on NFS/Lustre where locks fail).",
        "hdf5",
    ),
    EnvVar(
        "HYBRIDAGG_TEST_SLURM",
        None,
        "Tests only: 1 makes pytest collect tests/slurm (boots a Slurm cluster "
        "on this machine; needs root). Set by make test-slurm.",
        "tests",
    ),
    EnvVar(
        "HYBRIDAGG_TEST_CLUSTER",
        None,
        "Tests only: 1 makes pytest collect tests/cluster (brings emulated "
        "clusters up on this machine; needs root). Set by make test-cluster.",
        "tests",
    ),
    EnvVar(
        "HYBRIDAGG_EXPECT_MPIO",
        None,
        "Tests only: 1 makes the data loader's tests fail unless h5py has MPI "
        "and the loader reads through driver='mpio' (set by make test-mpio).",
        "tests",
    ),
]

ENV_VARS: dict[str, EnvVar] = {v.name: v for v in _DECLARED}


def _lookup(name: str, environ: Mapping[str, str] | None) -> str | None:
    try:
        var = ENV_VARS[name] if name in ENV_VARS else ENV_VARS[_template_of(name)]
    except KeyError:
        raise KeyError(
            f"environment variable {name!r} is not declared in hybridagg.runtime.envvars"
        ) from None
    value = (os.environ if environ is None else environ).get(name)
    if value is None or value == "":
        return var.default
    return value


def _template_of(name: str) -> str:
    head, _, tail = name.rpartition("_")
    return f"{head}_<k>" if tail.isdigit() else name


def indexed(template: str, index: int) -> str:
    """The name of an indexed variable, e.g. ``indexed("X_<k>", 2) == "X_2"``.

    Raises:
        KeyError: ``template`` is not declared.
    """
    if template not in ENV_VARS:
        raise KeyError(
            f"environment variable {template!r} is not declared in hybridagg.runtime.envvars"
        )
    return template.replace("<k>", str(int(index)))


def get_str(name: str, environ: Mapping[str, str] | None = None) -> str | None:
    """Return a declared variable's value, or its default.

    Args:
        name: A declared name (or an indexed one, see :func:`indexed`).
        environ: Where to read it (default: this process's environment); the
            other getters take it too, so that pure functions can decide from
            an environment they are given.
    """
    return _lookup(name, environ)


def get_int(name: str, environ: Mapping[str, str] | None = None) -> int | None:
    """Return a declared variable as an int (``None`` when unset, no default).

    Raises:
        ValueError: The value is not an integer.
    """
    value = _lookup(name, environ)
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name}={value!r} is not an integer") from None


def get_float(name: str, environ: Mapping[str, str] | None = None) -> float | None:
    """Return a declared variable as a finite float (``None`` when unset, no default).

    ``nan`` and ``inf`` are refused: every float hybridagg reads is a time or
    a size, and a NaN compares false with everything (a NaN timeout would
    never expire).

    Raises:
        ValueError: The value is not a finite number.
    """
    value = _lookup(name, environ)
    if value is None:
        return None
    try:
        number = float(value)
    except ValueError:
        raise ValueError(f"{name}={value!r} is not a number") from None
    if not math.isfinite(number):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return number


def get_bool(name: str, environ: Mapping[str, str] | None = None) -> bool:
    """Return a declared variable as a boolean (1/0, true/false, yes/no, on/off).

    Raises:
        ValueError: The value is none of those.
    """
    value = _lookup(name, environ)
    if value is None:
        return False
    low = value.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{name}={value!r} is not a boolean (use 1 or 0)")


_GETTERS = {"int": get_int, "float": get_float, "bool": get_bool}


def check_all(environ: Mapping[str, str] | None = None) -> None:
    """Read every declared variable as its ``kind`` says, so a bad one fails now.

    ``hybridagg train`` calls it before MPI starts, so a bad value is one
    clear error (and exit code 2) on every rank instead of a failure deep in
    whichever rank reads it first.

    Args:
        environ: Where to read (default: this process's environment).

    Raises:
        ValueError: A variable that is not of its kind (an int, a finite
            float, a boolean), or not above zero where it must be; the
            message names it.
    """
    for var in _DECLARED:
        getter = _GETTERS.get(var.kind)
        if getter is None:
            continue
        value = getter(var.name, environ)
        if var.positive and value is not None and not value > 0:
            raise ValueError(f"{var.name} must be positive, got {value!r}")


def export(name: str, value: str) -> None:
    """Set a declared variable for this process and the processes it starts."""
    if name not in ENV_VARS:
        raise KeyError(
            f"environment variable {name!r} is not declared in hybridagg.runtime.envvars"
        )
    os.environ[name] = value


def describe() -> str:
    """Return a Markdown table of every declared variable and its current value."""
    lines = ["| variable | set by | default | now | meaning |", "|---|---|---|---|---|"]
    for var in _DECLARED:
        now = os.environ.get(var.name, "")
        lines.append(
            f"| `{var.name}` | {var.owner} | {var.default or ''} | {now} | {var.doc} |"
        )
    return "\n".join(lines)
