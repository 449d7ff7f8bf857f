"""The open files of the split: which driver, and the communicator they hold."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .format import SplitInfo
from .reader import SplitReader

__all__ = ["SplitFiles", "choose_driver"]


def choose_driver(
    requested: str, *, with_comm: bool, mpio: bool, paths_agree: bool
) -> str:
    """The driver the files are opened with.

    Args:
        requested: ``"auto"``, ``"mpio"`` or ``"posix"``.
        with_comm: The loader has a communicator.
        mpio: h5py is built with MPI.
        paths_agree: Every worker named the same files.

    Returns:
        ``requested``, or for ``"auto"``: ``"mpio"`` where it can work (a
        communicator, MPI in h5py, the same files everywhere), else
        ``"posix"``.

    Raises:
        ValueError: ``"mpio"`` asked for while the workers named other files
            (a collective open needs one file).
    """
    driver = requested
    if driver == "auto":
        driver = "mpio" if (with_comm and mpio and paths_agree) else "posix"
    if driver == "mpio" and not paths_agree:
        raise ValueError("driver='mpio' needs every worker to name the same files")
    return driver


class SplitFiles:
    """Owns the open files (a :class:`SplitReader`) and, for mpio, their communicator.

    Args:
        driver: ``"mpio"`` or ``"posix"`` (see :func:`choose_driver`).
        collective: Read collectively (only meaningful with ``mpio``).
        timeout: Longest wait of the files' communicator, in seconds.
    """

    def __init__(self, *, driver: str, collective: bool, timeout: float) -> None:
        self.driver = driver
        self.collective = bool(collective and driver == "mpio")
        self.timeout = timeout
        self.reader: SplitReader | None = None
        self.file_comm: Any = None

    def open(
        self,
        infos: Sequence[SplitInfo],
        *,
        comm: Any,
        locking: bool | str | None,
    ) -> None:
        """Open the files; with ``comm``, collective (one worker's error is everyone's).

        What opened before an error stays held here, so :meth:`close` frees
        it on every worker alike.

        Args:
            infos: The validated split of each file.
            comm: The workers' :class:`hybridagg.comm.Comm`, or ``None``.
            locking: h5py's ``locking=``.
        """
        err: BaseException | None = None
        try:
            if self.driver == "mpio":
                from ..comm import Comm

                # a communicator of their own: HDF5's collective calls never
                # interleave with the loader's messages on ``comm``
                self.file_comm = Comm(comm.mpi, name="data-files", timeout=self.timeout)
            self.reader = SplitReader(
                infos,
                driver=self.driver,
                file_comm=self.file_comm,
                collective=self.collective,
                locking=locking,
            )
        except (ValueError, TypeError, OSError) as exc:
            err = exc
        if comm:
            comm.check(err, what="opening the data files")
        elif err is not None:
            raise err

    def close(self) -> None:
        """Close the files, then free their communicator (both collective with mpio)."""
        if self.reader is not None:
            self.reader.close()
            self.reader = None
        if self.file_comm is not None:
            self.file_comm.free()
            self.file_comm = None
