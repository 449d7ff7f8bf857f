"""Process-wide MPI plumbing: the ways a rank ends a job, compute threads."""

from __future__ import annotations

import os
import sys
import threading
import time

import torch
from mpi4py import MPI

from ..runtime import envvars
from ..runtime.outcomes import ExitCode, PeerFailure
from . import liveness
from .failures import peer_failure_from

__all__ = [
    "configure_threads",
    "end_job",
    "end_on_peer_failure",
    "install_abort_hook",
    "peer_failure_of",
]

_hook_lock = threading.Lock()
_hook_installed = False


def install_abort_hook() -> bool:
    """Make an unhandled exception on any rank abort the whole MPI job.

    Like ``python -m mpi4py``: the traceback is printed, then one line naming
    the rank and reason, then ``MPI_Abort`` so the other ranks do not wait
    forever in a collective. Threads are covered too. Does nothing with a
    single rank or when ``HYBRIDAGG_ABORT_ON_ERROR=0``.

    Returns:
        Whether the hook is installed.
    """
    global _hook_installed
    with _hook_lock:
        if _hook_installed:
            return True
        if not envvars.get_bool("HYBRIDAGG_ABORT_ON_ERROR"):
            return False
        if MPI.COMM_WORLD.Get_size() == 1:
            return False
        previous = sys.excepthook

        def _abort(etype, value) -> None:
            rank = MPI.COMM_WORLD.Get_rank()
            sys.stderr.write(
                f"[hybridagg] rank {rank}: unhandled {etype.__name__}: {value}; "
                "aborting the MPI job\n"
            )
            sys.stderr.flush()
            sys.stdout.flush()
            code = getattr(value, "exit_code", ExitCode.INTERNAL)
            MPI.COMM_WORLD.Abort(int(code))

        def excepthook(etype, value, tb) -> None:
            previous(etype, value, tb)
            _abort(etype, value)

        def thread_hook(args) -> None:
            if args.exc_type is SystemExit:
                return
            threading.__excepthook__(args)
            _abort(args.exc_type, args.exc_value)

        sys.excepthook = excepthook
        threading.excepthook = thread_hook
        _hook_installed = True
        return True


def configure_threads(num_threads: int | None = None) -> int:
    """Set the compute threads of this rank (``torch.set_num_threads``).

    Several ranks usually share a node's cores, so the default is one thread
    per rank: ``num_threads``, else ``HYBRIDAGG_NUM_THREADS``, else
    ``OMP_NUM_THREADS``, else 1. ``OMP_NUM_THREADS`` is exported for child
    processes.

    Returns:
        The number of threads set.

    Raises:
        ValueError: The number is not positive.
    """
    n = num_threads
    if n is None:
        n = envvars.get_int("HYBRIDAGG_NUM_THREADS")
    if n is None:
        n = envvars.get_int("OMP_NUM_THREADS")
    if n is None:
        n = 1
    if n < 1:
        raise ValueError(f"number of compute threads must be >= 1, got {n}")
    torch.set_num_threads(n)
    envvars.export("OMP_NUM_THREADS", str(n))
    return n


def _status_line(program: str, code: ExitCode) -> str:
    rank = MPI.COMM_WORLD.Get_rank()
    return f"{program}: rank {rank}: {code.name.lower()} (exit {int(code)})\n"


_REPORTER_GRACE_S = 2.0
"""Seconds the reporter of a failure waits after printing before its
``MPI_Abort`` ends every rank still running: the others learn the verdict
within a fraction of a second and print their status lines meanwhile."""

_LINGER_S = 2 * _REPORTER_GRACE_S
"""Seconds a rank that did not report waits, after printing, for the
reporter's ``MPI_Abort`` before it exits by itself (a reporter that died
before its abort)."""

_ending = threading.Event()  # end_job runs in some thread of this process


def end_job(
    failure: PeerFailure, reporter: bool, *, program: str = "hybridagg"
) -> None:
    """End this rank, and with it the job, after a peer failure; never returns.

    Every rank prints its status line, ``PROGRAM: rank R: aborted (exit 5)``,
    so that each rank's outcome can be read where the launcher does not
    report it; the reporter (the one rank that declared the failure) prints
    its message first. Then the reporter waits ``_REPORTER_GRACE_S`` and
    calls ``MPI_Abort`` with exit code 5, which ends every rank still
    running, a stuck one included, and makes the launcher exit 5 (Open MPI
    does so with and without ``--with-ft ulfm``). The other ranks wait for
    that abort (at most ``_LINGER_S``, then ``os._exit(5)``: ``MPI_Finalize``
    could wait for the dead peer) instead of exiting at once: a launcher
    (Open MPI's under ULFM) ends the whole job at the first rank's exit,
    which would kill the ranks that had not yet learnt the verdict before
    they print their status lines.

    Args:
        failure: What failed, naming the rank(s).
        reporter: Whether this rank declared it (prints the message).
        program: Prefix of the lines printed (the command's name).
    """
    _ending.set()
    code = ExitCode.ABORTED
    try:
        if reporter:
            sys.stderr.write(f"{program}: error: {failure}; aborting the job\n")
        sys.stderr.write(_status_line(program, code))
        sys.stderr.flush()
        sys.stdout.flush()
    finally:
        if reporter:
            time.sleep(_REPORTER_GRACE_S)
            MPI.COMM_WORLD.Abort(int(code))
        else:
            time.sleep(_LINGER_S)
        os._exit(int(code))


def peer_failure_of(error: BaseException) -> PeerFailure | None:
    """``error`` as a :class:`PeerFailure` (itself, or an MPI process failure), or ``None``."""
    if isinstance(error, PeerFailure):
        return error
    return peer_failure_from(error)


def end_on_peer_failure(failure: PeerFailure, *, program: str = "hybridagg") -> None:
    """The main thread met ``failure``: end the job through the heartbeat; never returns.

    With a heartbeat running, the verdict (this one, or the one the dead
    rank's watcher declares, whichever comes first) ends every rank with
    exit 5 and one message (:func:`end_job`). Without one, or should it not
    end the process, this rank prints ``failure`` and aborts the job itself.
    """
    watch = liveness.current()
    conclude = getattr(watch, "conclude", None)
    if conclude is not None:
        conclude(failure)
    if _ending.is_set():
        # the heartbeat's thread is ending the job (its line is printed, it
        # waits for the reporter's abort): a second end here would print a
        # second error, and exit before that wait is over
        time.sleep(_LINGER_S + _REPORTER_GRACE_S)
        os._exit(int(ExitCode.ABORTED))
    end_job(failure, True, program=program)
