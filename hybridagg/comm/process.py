"""Process-wide MPI plumbing: an abort hook for unhandled errors, compute threads."""

from __future__ import annotations

import sys
import threading

import torch
from mpi4py import MPI

from ..runtime import envvars

__all__ = ["configure_threads", "install_abort_hook"]

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
            MPI.COMM_WORLD.Abort(1)

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
