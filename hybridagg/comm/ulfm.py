"""MPI's own fault tolerance (ULFM): is it on, did a peer die, who died.

With ULFM (User-Level Failure Mitigation, Open MPI 5 launched with
``mpirun --with-ft ulfm``) an operation that involves a dead process fails
with ``MPI_ERR_PROC_FAILED`` instead of hanging, a receive from
``MPI_ANY_SOURCE`` fails with ``MPI_ERR_PROC_FAILED_PENDING`` until the
failure is acknowledged, and an operation on a communicator another rank
revoked fails with ``MPI_ERR_REVOKED``. mpi4py raises these as
``MPI.Exception``; :func:`is_process_failure` recognises them.

Whether ULFM is *on* is a run-time matter, not a build-time one: Open MPI 5
builds always contain it, but only a job started with ``--with-ft ulfm``
(or ``--mca mpi_ft_enable 1``) runs with it. :func:`ulfm_enabled` reads that
setting back from the library through the MPI tool interface (the control
variable ``mpi_ft_enable``), which is the library's own answer for this
process; an MPI without that variable (Open MPI 4, MPICH) has no ULFM here.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

from mpi4py import MPI

from . import failures

__all__ = [
    "failed_world_ranks",
    "is_process_failure",
    "ulfm_enabled",
    "ulfm_status",
]


def is_process_failure(error: BaseException) -> bool:
    """Whether ``error`` is an MPI error caused by a dead peer or a revocation.

    A test of several requests at once (``MPI_Testsome``) reports a failed
    request as ``MPI_ERR_IN_STATUS``, the real class being in a status
    mpi4py does not return: that counts as a peer's failure when this
    process knows of a failed process.
    """
    if failures.is_peer_failure(error):
        return True
    if not isinstance(error, MPI.Exception):
        return False
    try:
        cls = error.Get_error_class()
    except MPI.Exception:
        return False
    if cls == MPI.ERR_IN_STATUS:
        try:
            group = MPI.COMM_WORLD.Get_failed()
        except (MPI.Exception, NotImplementedError):
            return False
        known = group.Get_size() > 0
        group.Free()
        return known
    return False


def _libmpi() -> ctypes.CDLL | None:
    """The MPI library this process has loaded (mpi4py loaded it privately)."""
    try:
        maps = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return None
    for line in maps:
        path = line.split()[-1] if line.split() else ""
        if "/libmpi.so" in path:
            try:
                return ctypes.CDLL(path)
            except OSError:
                return None
    return None


def ulfm_status() -> tuple[bool, str]:
    """Whether this process runs with ULFM enabled, and why not if it does not.

    Returns:
        ``(enabled, reason)``: ``reason`` says what was found (the library,
        or the setting) when ``enabled`` is false.
    """
    version = MPI.Get_library_version().splitlines()[0].strip()
    if not hasattr(MPI.Comm, "Shrink") or not hasattr(MPI.Comm, "Revoke"):
        return False, f"mpi4py {_mpi4py_version()} has no ULFM calls"
    if "Open MPI" not in version:
        return False, f"{version} is not an MPI whose ULFM hybridagg supports"
    lib = _libmpi()
    if lib is None or not hasattr(lib, "MPI_T_cvar_get_index"):
        return False, f"{version}: its MPI tool interface could not be loaded"
    provided = ctypes.c_int()
    if lib.MPI_T_init_thread(0, ctypes.byref(provided)) != 0:
        return False, f"{version}: MPI_T_init_thread failed"
    try:
        index = ctypes.c_int(-1)
        if lib.MPI_T_cvar_get_index(b"mpi_ft_enable", ctypes.byref(index)) != 0:
            return False, f"{version} was built without ULFM (no mpi_ft_enable)"
        handle, count = ctypes.c_void_p(), ctypes.c_int()
        if (
            lib.MPI_T_cvar_handle_alloc(
                index, None, ctypes.byref(handle), ctypes.byref(count)
            )
            != 0
        ):
            return False, f"{version}: mpi_ft_enable could not be read"
        value = (ctypes.c_char * 16)()
        ok = lib.MPI_T_cvar_read(handle, value) == 0
        lib.MPI_T_cvar_handle_free(ctypes.byref(handle))
        if not ok:
            return False, f"{version}: mpi_ft_enable could not be read"
        if not any(bytes(value)):
            return False, (
                f"{version} has ULFM, but this job was started without it "
                "(launch with mpirun --with-ft ulfm)"
            )
        return True, ""
    finally:
        lib.MPI_T_finalize()


def ulfm_enabled() -> bool:
    """Whether this process runs with ULFM enabled (see :func:`ulfm_status`)."""
    return ulfm_status()[0]


def _mpi4py_version() -> str:
    import mpi4py

    return mpi4py.__version__


def failed_world_ranks(comm: MPI.Comm) -> tuple[int, ...]:
    """World ranks of the processes of ``comm`` known here to have failed, acknowledged.

    Unlike :func:`hybridagg.comm.failures.failed_world_ranks` (a query),
    this acknowledges them (``MPI_Comm_ack_failed``), so that receives from
    ``MPI_ANY_SOURCE`` on ``comm`` work again. Knowledge of a failure
    arrives with MPI progress; this call makes some (a probe on
    ``MPI_COMM_SELF``) first.
    """
    MPI.COMM_SELF.Iprobe(MPI.ANY_SOURCE, MPI.ANY_TAG)
    try:
        comm.Ack_failed()
    except MPI.Exception:
        return ()
    return failures.failed_world_ranks(comm)
