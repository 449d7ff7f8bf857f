"""MPI's fault-tolerance errors, as a :class:`PeerFailure` naming world ranks.

Under ULFM (Open MPI's ``mpirun --with-ft ulfm``) an operation that involves
a dead process fails within a fraction of a second with
``MPI_ERR_PROC_FAILED`` (or ``MPI_ERR_PROC_FAILED_PENDING`` for a receive
from any source, ``MPI_ERR_REVOKED`` on a communicator another rank
revoked); mpi4py raises it as ``MPI.Exception``. This module recognises
those errors and asks MPI which processes failed (``Comm.Get_failed``, the
locally known failures), translated to world ranks. Pure apart from those
two queries; shared by the heartbeat, the polled waits, the command line's
abort path and the group-failure recovery.
"""

from __future__ import annotations

from collections.abc import Callable

from mpi4py import MPI

from ..runtime.outcomes import PeerFailure

__all__ = [
    "failed_world_ranks",
    "is_peer_failure",
    "peer_failure_from",
]


def _classes() -> frozenset[int]:
    # looked up at call time: an MPI without ULFM may lack some constants
    names = ("ERR_PROC_FAILED", "ERR_PROC_FAILED_PENDING", "ERR_REVOKED")
    return frozenset(getattr(MPI, n) for n in names if hasattr(MPI, n))


def is_peer_failure(error: BaseException) -> bool:
    """Whether ``error`` is MPI reporting a failed process or a revoked communicator."""
    if not isinstance(error, MPI.Exception):
        return False
    try:
        return error.Get_error_class() in _classes()
    except MPI.Exception:
        return False


def failed_world_ranks(comm: MPI.Comm | None = None) -> tuple[int, ...]:
    """World ranks of the processes of ``comm`` known here to have failed.

    Args:
        comm: The communicator the error came from (default
            ``MPI.COMM_WORLD``; Open MPI's knowledge of failures is
            process-wide, so any communicator over the dead rank names it).

    Returns:
        Ascending world ranks; empty where MPI cannot tell (no ULFM).
    """
    comm = MPI.COMM_WORLD if comm is None else comm
    try:
        failed = comm.Get_failed()
    except (MPI.Exception, NotImplementedError, AttributeError):
        return ()
    try:
        size = failed.Get_size()
        if size == 0:
            return ()
        world = MPI.COMM_WORLD.Get_group()
        try:
            ranks = MPI.Group.Translate_ranks(failed, list(range(size)), world)
        finally:
            world.Free()
        return tuple(sorted(int(r) for r in ranks if r != MPI.UNDEFINED))
    except MPI.Exception:
        return ()
    finally:
        failed.Free()


def _default_role(rank: int) -> str:
    return f"rank {rank}"


def peer_failure_from(
    error: BaseException,
    comm: MPI.Comm | None = None,
    *,
    describe: Callable[[int], str] = _default_role,
    what: str = "",
) -> PeerFailure | None:
    """The :class:`PeerFailure` behind an MPI error, or ``None`` for other errors.

    Args:
        error: An exception raised by an MPI call.
        comm: The communicator of the failed call (see :func:`failed_world_ranks`).
        describe: Names a world rank with its role (default ``"rank R"``).
        what: The operation that failed, for the message.

    Returns:
        A ``PeerFailure`` whose ``ranks`` are the failed world ranks (empty
        when MPI does not say which), or ``None`` if ``error`` is not a
        process failure or a revoked communicator.
    """
    if not is_peer_failure(error):
        return None
    ranks = failed_world_ranks(comm)
    during = f" during {what}" if what else ""
    if ranks:
        who = ", ".join(describe(r) for r in ranks)
        text = f"{who} failed (MPI reported a process failure{during})"
    elif error.Get_error_class() == getattr(MPI, "ERR_REVOKED", None):
        text = f"a communicator was revoked after a process failure{during}"
    else:
        text = f"a process failed (MPI did not say which){during}"
    return PeerFailure(text, ranks)
