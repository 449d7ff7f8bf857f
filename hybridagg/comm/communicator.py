"""The communicator wrapper every hybridagg module talks to MPI through.

:class:`Comm` follows mpi4py's naming, which every MPI user knows: methods
in upper case move buffers (tensors and arrays, in place, no copy), methods
in lower case move picklable Python objects. Every operation is posted
non-blocking and completed through the polled waits of
:mod:`hybridagg.comm.waits`; :meth:`Comm.check` turns an error on one rank
into the same error on every rank. Which algorithm reduces a large buffer
is not decided here but in :mod:`hybridagg.collectives`.
"""

from __future__ import annotations

import builtins
import contextlib
import numbers
import pickle
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from mpi4py import MPI

from .buffers import as_buffer
from .waits import check_timeout, default_timeout, wait, wait_until

__all__ = ["Comm", "RemoteError"]


class RemoteError(RuntimeError):
    """An error raised on another rank, re-raised here by :meth:`Comm.check`."""


def _refuse_buffer(method: str, obj: Any) -> None:
    # a buffer handed to an object method is almost certainly a caller that
    # meant the upper-case (in-place, buffer) variant: say so loudly
    if isinstance(obj, (torch.Tensor, np.ndarray)):
        raise TypeError(
            f"Comm.{method} sends picklable objects; for a {type(obj).__name__} "
            f"use Comm.{method[0].upper() + method[1:]} (buffers, in place)"
        )


class Comm:
    """A communicator with cached rank/size and polled, timed operations.

    Construct it once from the user's communicator (which is duplicated, so
    hybridagg's traffic never mixes with the user's); derive others with
    :meth:`split`, which does not duplicate again. :meth:`free` (or a
    ``with`` block) releases what hybridagg created.

    Args:
        comm: The user's mpi4py communicator (default ``MPI.COMM_WORLD``).
        name: Names this communicator in error messages.
        dup: Duplicate ``comm`` (default). Pass ``False`` only for a
            communicator hybridagg created itself.
        timeout: Default timeout of its waits (``HYBRIDAGG_TIMEOUT``).
    """

    def __init__(
        self,
        comm: MPI.Comm | None = None,
        *,
        name: str = "world",
        dup: bool = True,
        timeout: float | None = None,
    ) -> None:
        base = MPI.COMM_WORLD if comm is None else comm
        if not isinstance(base, MPI.Comm):
            raise TypeError(f"comm must be an mpi4py MPI.Comm, got {type(base)}")
        if base == MPI.COMM_NULL:
            raise ValueError("comm is MPI.COMM_NULL")
        self.name = name
        self.timeout = default_timeout() if timeout is None else check_timeout(timeout)
        if dup:
            self.mpi, req = base.Idup()
            wait(
                req,
                what=f"duplicating the communicator for {name}",
                timeout=self.timeout,
            )
        else:
            self.mpi = base
        self.rank: int = self.mpi.Get_rank()
        self.size: int = self.mpi.Get_size()
        # communicators derived from this one (split, dup): revoke() reaches them
        self.children: list[Comm] = []

    def __repr__(self) -> str:
        return f"Comm({self.name!r}, rank={self.rank}, size={self.size})"

    def __enter__(self) -> Comm:
        return self

    def __exit__(self, *exc: object) -> None:
        self.free()

    # --- construction ------------------------------------------------------
    def split(self, color: int | None, key: int = 0, *, name: str) -> Comm | None:
        """Split into sub-communicators; ranks passing ``color=None`` get ``None``.

        This is collective over this communicator.
        """
        self.barrier(what=f"split of {self.name} into {name}")
        sub = self.mpi.Split(MPI.UNDEFINED if color is None else int(color), key)
        if sub == MPI.COMM_NULL:
            return None
        return self._adopt(Comm(sub, name=name, dup=False, timeout=self.timeout))

    def split_shared(self, *, name: str = "node") -> Comm:
        """Split into node-local communicators (``MPI_COMM_TYPE_SHARED``)."""
        self.barrier(what=f"split of {self.name} into {name}")
        sub = self.mpi.Split_type(MPI.COMM_TYPE_SHARED, key=self.rank)
        return self._adopt(Comm(sub, name=name, dup=False, timeout=self.timeout))

    def dup(self, name: str) -> Comm:
        """A new communicator over the same ranks, for traffic of its own (collective)."""
        return self._adopt(Comm(self.mpi, name=name, dup=True, timeout=self.timeout))

    def _adopt(self, child: Comm) -> Comm:
        self.children.append(child)
        return child

    def revoke(self) -> None:
        """Revoke this communicator and every one derived from it (ULFM).

        After a peer died, the ranks that noticed revoke, so that every
        operation on these communicators, pending or future, fails on every
        member with ``MPI_ERR_REVOKED`` instead of waiting for the dead peer
        (a ring step whose neighbours are alive would otherwise wait for
        data that can no longer come). Local and non-blocking; errors
        (a communicator already freed or revoked) are ignored.
        """
        for child in self.children:
            child.revoke()
        if self.mpi in (MPI.COMM_WORLD, MPI.COMM_SELF, MPI.COMM_NULL):
            return
        with contextlib.suppress(MPI.Exception, NotImplementedError):
            self.mpi.Revoke()

    def free(self) -> None:
        """Free the underlying communicator (not ``COMM_WORLD``/``COMM_SELF``).

        A second call does nothing.
        """
        if self.mpi not in (MPI.COMM_WORLD, MPI.COMM_SELF, MPI.COMM_NULL):
            self.mpi.Free()

    # --- waiting -----------------------------------------------------------
    def wait(
        self,
        requests: MPI.Request | Sequence[MPI.Request],
        what: str,
        timeout: float | None = None,
        poll: Callable[[], object] | None = None,
    ) -> float:
        """:func:`~hybridagg.comm.wait` with this communicator's timeout and
        name (``poll``: called before every test, see there)."""
        return wait(
            requests,
            what=f"{what} on {self.name} (rank {self.rank}/{self.size})",
            timeout=self.timeout if timeout is None else timeout,
            poll=poll,
        )

    def wait_for(
        self,
        done: Callable[[], bool],
        what: str,
        timeout: float | None = None,
        activity: Callable[[], int] | None = None,
        spin: float | None = None,
        max_sleep: float | None = None,
        max_sleep_for: float | None = None,
    ) -> float:
        """:func:`~hybridagg.comm.wait_until` on a condition, with this communicator's timeout.

        ``activity``, ``spin``, ``max_sleep`` and ``max_sleep_for`` are passed
        on as they are.
        """
        return wait_until(
            done,
            what=f"{what} on {self.name} (rank {self.rank}/{self.size})",
            timeout=self.timeout if timeout is None else timeout,
            activity=activity,
            spin=spin,
            max_sleep=max_sleep,
            max_sleep_for=max_sleep_for,
        )

    def barrier(
        self,
        *,
        what: str = "barrier",
        timeout: float | None = None,
        poll: Callable[[], object] | None = None,
    ) -> None:
        """A polled barrier (``poll``: see :meth:`wait`)."""
        if self.size > 1:
            self.wait(self.mpi.Ibarrier(), what, timeout, poll)
        elif poll is not None:
            poll()

    # --- buffers (in place, no copy) ----------------------------------------
    def Iallreduce(
        self, x: torch.Tensor | np.ndarray, op: MPI.Op = MPI.SUM
    ) -> MPI.Request:
        """Post an in-place ``MPI_Iallreduce`` of ``x``; complete it with :meth:`wait`."""
        return self.mpi.Iallreduce(MPI.IN_PLACE, as_buffer(x), op)

    def Allreduce(
        self, x: torch.Tensor | np.ndarray, op: MPI.Op = MPI.SUM, *, what: str = ""
    ) -> torch.Tensor | np.ndarray:
        """All-reduce ``x`` in place through ``MPI_Iallreduce`` (polled); returns ``x``.

        For large sums of gradients, :class:`hybridagg.collectives.Collectives`
        chooses a faster algorithm.
        """
        if self.size > 1:
            self.wait(self.Iallreduce(x, op), what or "allreduce")
        return x

    def Iallgather(
        self, x: torch.Tensor | np.ndarray, out: torch.Tensor | np.ndarray
    ) -> MPI.Request:
        """Post a gather of every rank's ``x`` into ``out`` (``size`` times ``x``)."""
        send = as_buffer(x)
        mem, total, dtype = as_buffer(out)
        if total != send[1] * self.size:
            raise ValueError(
                f"Allgather needs an output of {self.size} x {send[1]} elements, "
                f"got {total}"
            )
        return self.mpi.Iallgather(send, [mem, send[1], dtype])  # count per rank

    def Allgather(
        self,
        x: torch.Tensor | np.ndarray,
        out: torch.Tensor | np.ndarray,
        *,
        what: str = "",
    ) -> torch.Tensor | np.ndarray:
        """Gather every rank's ``x`` into ``out``, in rank order (polled); returns ``out``."""
        self.wait(self.Iallgather(x, out), what or "allgather")
        return out

    def Ibcast(self, x: torch.Tensor | np.ndarray, root: int = 0) -> MPI.Request:
        """Post a broadcast of ``x`` from ``root`` into every rank's ``x``."""
        return self.mpi.Ibcast(as_buffer(x), root=root)

    def Bcast(
        self, x: torch.Tensor | np.ndarray, root: int = 0, *, what: str = ""
    ) -> torch.Tensor | np.ndarray:
        """Broadcast ``x`` in place from ``root`` (polled); returns ``x``."""
        if self.size > 1:
            self.wait(self.Ibcast(x, root), what or f"bcast from {root}")
        return x

    def Isend(
        self, x: torch.Tensor | np.ndarray, dest: int, tag: int = 0
    ) -> MPI.Request:
        """Post a send of ``x`` to ``dest``."""
        return self.mpi.Isend(as_buffer(x), dest, tag)

    def Irecv(
        self, x: torch.Tensor | np.ndarray, source: int = MPI.ANY_SOURCE, tag: int = 0
    ) -> MPI.Request:
        """Post a receive into ``x`` from ``source``."""
        return self.mpi.Irecv(as_buffer(x), source, tag)

    # --- picklable objects ----------------------------------------------------
    def isend(self, obj: Any, dest: int, tag: int = 0) -> tuple[MPI.Request, Any]:
        """Post a send of a picklable object; keep the returned buffer until done.

        Raises:
            TypeError: ``obj`` is a tensor or array (use :meth:`Isend`).
        """
        _refuse_buffer("isend", obj)
        payload = np.frombuffer(pickle.dumps(obj, protocol=5), dtype=np.uint8)
        return self.mpi.Isend([payload, MPI.UINT8_T], dest, tag), payload

    def recv(
        self,
        source: int,
        tag: int = 0,
        *,
        what: str = "",
        poll: Callable[[], object] | None = None,
    ) -> Any:
        """Receive a picklable object sent with :meth:`isend` (polled).

        ``poll``: called while waiting (a service of this rank's own).
        """
        if not isinstance(source, numbers.Integral) or isinstance(source, bool):
            raise TypeError(
                f"Comm.recv takes a source rank, got {type(source).__name__} "
                "(use Comm.Irecv to receive into a buffer)"
            )
        status = MPI.Status()

        def arrived() -> bool:
            if poll is not None:
                poll()
            return self.mpi.Iprobe(source, tag, status)

        self.wait_for(arrived, what or f"object from rank {source} (tag {tag})")
        payload = np.empty(status.Get_count(MPI.UINT8_T), dtype=np.uint8)
        req = self.mpi.Irecv([payload, MPI.UINT8_T], status.Get_source(), tag)
        self.wait(req, what or f"object from rank {source}")
        return pickle.loads(payload.tobytes())

    def allgather(
        self,
        obj: Any,
        *,
        what: str = "allgather of objects",
        poll: Callable[[], object] | None = None,
    ) -> list:
        """Gather a picklable object from every rank to every rank (polled).

        ``poll``: see :meth:`wait`.

        Raises:
            TypeError: ``obj`` is a tensor or array.
        """
        _refuse_buffer("allgather", obj)
        if self.size == 1:
            return [obj]
        data = np.frombuffer(pickle.dumps(obj, protocol=5), dtype=np.uint8)
        sizes = np.zeros(self.size, dtype=np.int64)
        sizes[self.rank] = data.size
        self.wait(self.mpi.Iallgather(MPI.IN_PLACE, sizes), what, poll=poll)
        offsets = np.concatenate(([0], np.cumsum(sizes)[:-1]))
        out = np.empty(int(sizes.sum()), dtype=np.uint8)
        req = self.mpi.Iallgatherv(data, [out, sizes, offsets, MPI.UINT8_T])
        self.wait(req, what, poll=poll)
        return [
            pickle.loads(out[o : o + s].tobytes())
            for o, s in zip(offsets.tolist(), sizes.tolist(), strict=True)
        ]

    def bcast(self, obj: Any, root: int = 0, *, what: str = "") -> Any:
        """Broadcast a picklable object from ``root`` (polled).

        Raises:
            TypeError: ``obj`` is a tensor or array (use :meth:`Bcast`).
        """
        _refuse_buffer("bcast", obj)
        if self.size == 1:
            return obj
        what = what or f"bcast of an object from {root}"
        size = np.zeros(1, dtype=np.int64)
        if self.rank == root:
            payload = np.frombuffer(pickle.dumps(obj, protocol=5), dtype=np.uint8)
            size[0] = payload.size
        self.Bcast(size, root, what=what)
        if self.rank != root:
            payload = np.empty(int(size[0]), dtype=np.uint8)
        self.Bcast(payload, root, what=what)
        return obj if self.rank == root else pickle.loads(payload.tobytes())

    def allreduce(
        self, obj: Any, op: Callable[[Any, Any], Any] | None = None, *, what: str = ""
    ) -> Any:
        """Reduce a picklable value over every rank, in rank order (polled).

        Args:
            obj: This rank's value.
            op: A binary function (default ``+``), applied left to right in
                rank order, so every rank gets the same result.

        Raises:
            TypeError: ``obj`` is a tensor or array (use :meth:`Allreduce`).
        """
        _refuse_buffer("allreduce", obj)
        values = self.allgather(obj, what=what or "allreduce of objects")
        result = values[0]
        for value in values[1:]:
            result = result + value if op is None else op(result, value)
        return result

    # --- agreement on errors --------------------------------------------------
    def check(
        self,
        error: BaseException | None,
        *,
        what: str = "",
        poll: Callable[[], object] | None = None,
    ) -> None:
        """Raise the same error on every rank if any rank passes one.

        Every rank must call this (it is collective). The error of the lowest
        failing rank is re-raised everywhere with the same message, prefixed
        by that rank; its type is kept for the common built-in exceptions
        (``ValueError``, ``IsADirectoryError``, ...: the most derived built-in
        class) and is a :class:`RemoteError` otherwise.

        Args:
            error: This rank's exception, or ``None`` if it succeeded.
            what: What was being checked, for the message.
            poll: Called while waiting (see :meth:`wait`).
        """
        if error is None:
            local = None
        else:
            local = (type(error).__name__, str(error), _builtin_name(error))
        reports = self.allgather(local, what=what or "error agreement", poll=poll)
        for rank, report in enumerate(reports):
            if report is None:
                continue
            tname, msg, builtin = report
            text = f"[rank {self.world_rank_of(rank)}] {msg}"
            cls = getattr(builtins, builtin) if builtin else RemoteError
            try:
                exc = cls(text)
            except TypeError:  # a built-in that takes more than a message
                cls = RemoteError
            if cls is RemoteError:
                exc = RemoteError(f"[rank {self.world_rank_of(rank)}] {tname}: {msg}")
            if error is not None and rank == self.rank:
                raise exc from error
            raise exc

    def world_rank_of(self, rank: int) -> int:
        """The ``MPI_COMM_WORLD`` rank of this communicator's ``rank``."""
        if self.mpi == MPI.COMM_WORLD:
            return rank
        try:
            grp, world = self.mpi.Get_group(), MPI.COMM_WORLD.Get_group()
            return int(MPI.Group.Translate_ranks(grp, [rank], world)[0])
        except MPI.Exception:
            return rank


def _builtin_name(error: BaseException) -> str | None:
    """Name of the most derived built-in exception class ``error`` is an instance of."""
    for cls in type(error).__mro__:
        if (
            issubclass(cls, Exception)
            and cls.__module__ == "builtins"
            and getattr(builtins, cls.__name__, None) is cls
            and cls is not Exception
        ):
            return cls.__name__
    return None
