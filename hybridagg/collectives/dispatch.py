"""One dispatch: which algorithm sums a buffer, and the counters it keeps.

:func:`choose_allreduce` is the only reader of the size thresholds
(:class:`~hybridagg.collectives.CollectiveSettings`); :class:`Collectives`
owns, per communicator, the sequence number of the pipelined rings, the
progress counter that polled waits watch, and the scratch pool.
"""

from __future__ import annotations

from collections.abc import Callable
from enum import Enum

import numpy as np
import torch

from ..comm import Comm, ErrorFeedback, ScratchPool, wire_dtype
from .compact import CompactAllreduce, CompactBcast, CompactReduce
from .mean import mean_allreduce
from .ring import RingAllreduce, settled_allreduce
from .settings import CollectiveSettings

__all__ = ["Algorithm", "Collectives", "choose_allreduce"]


class Algorithm(Enum):
    """How a sum all-reduce of a CPU buffer is carried out."""

    NONE = "none"
    """One rank: nothing to do."""
    MPI = "mpi"
    """``MPI_Iallreduce``, polled."""
    RING = "ring"
    """The pipelined ring of non-blocking messages, polled."""
    SETTLED = "settled"
    """A ring of blocking ``MPI_Sendrecv`` calls: every rank has arrived."""
    COMPACT = "compact"
    """A direct reduce-scatter and all-gather in bf16/fp16, summed in float32
    (:class:`~hybridagg.collectives.compact.CompactAllreduce`), polled."""


def choose_allreduce(
    nbytes: int,
    size: int,
    *,
    settled: bool,
    settings: CollectiveSettings,
    compact: bool = False,
) -> Algorithm:
    """The algorithm for a sum all-reduce of ``nbytes`` over ``size`` ranks.

    Pure logic: every rank passing the same arguments gets the same answer.

    Args:
        nbytes: The buffer's size.
        size: The communicator's size.
        settled: Every rank is known to have arrived (the caller saw a
            collective complete that each rank posted just before), so
            blocking calls cannot spin long on a late peer.
        settings: The thresholds.
        compact: The wire format is bf16 or fp16 (and the buffer floating
            point): MPI cannot reduce those types, so every size takes the
            compact algorithm.
    """
    if size == 1:
        return Algorithm.NONE
    if compact:
        return Algorithm.COMPACT
    if settled and nbytes < settings.settled_max_bytes:
        return Algorithm.SETTLED
    if nbytes >= settings.ring_min_bytes:
        return Algorithm.RING
    return Algorithm.MPI


class Collectives:
    """Sum all-reduces of CPU tensors over one communicator, by the best algorithm.

    Create one per communicator: the rings' tags carry this object's
    sequence number, so two of them with rings in flight on one
    communicator could match each other's messages.

    Args:
        comm: The communicator; every rank of it makes the same calls in the
            same order.
        settings: Thresholds (default: from the environment).
        wire: ``"fp32"``, or ``"bf16"``/``"fp16"``: floating-point sums,
            reductions to a root and broadcasts send that type (with error
            feedback, :mod:`.compact`); for gradients only.
    """

    def __init__(
        self,
        comm: Comm,
        settings: CollectiveSettings | None = None,
        wire: str = "fp32",
    ) -> None:
        self.comm = comm
        self.settings = CollectiveSettings.from_env() if settings is None else settings
        self.scratch = ScratchPool()
        self.events = 0
        """Stages completed by multi-stage operations: polled waits watch it."""
        self._rings = 0
        self.wire = wire
        dtype = wire_dtype(wire)
        self.feedback = None if dtype == torch.float32 else ErrorFeedback(dtype)
        """The residuals of every gradient this rank rounds (compact wire)."""
        self._compact = 0
        self.bytes_sent = 0
        """Bytes the compact operations posted to send (what the wire carries)."""

    def compacts(self, x: torch.Tensor) -> bool:
        """Whether operations on ``x`` travel in the compact type."""
        return self.feedback is not None and x.dtype in (torch.float32, torch.float64)

    def _sent(self, nbytes: int) -> None:
        self.bytes_sent += nbytes

    def _compact_args(self) -> tuple:
        seq = self._compact
        self._compact += 1
        return self.feedback, seq, self.scratch, self._stage_done, self._sent

    def start_reduce(self, x: torch.Tensor, root: int) -> Callable[[], bool]:
        """Post a compact sum of every rank's ``x`` into ``root``'s (see :meth:`compacts`)."""
        if self.comm.size == 1:
            return lambda: True
        return CompactReduce(self.comm, x, root, *self._compact_args()).test

    def start_bcast(self, x: torch.Tensor, root: int) -> Callable[[], bool]:
        """Post a compact broadcast of ``root``'s ``x`` (see :meth:`compacts`)."""
        if self.comm.size == 1:
            return lambda: True
        return CompactBcast(self.comm, x, root, *self._compact_args()).test

    def _stage_done(self) -> None:
        self.events += 1

    def start_allreduce(
        self, x: torch.Tensor, *, settled: bool = False
    ) -> Callable[[], bool]:
        """Post an in-place sum all-reduce of a contiguous CPU tensor.

        Every rank must pass the same size and ``settled``.

        Args:
            x: Reduced in place.
            settled: See :func:`choose_allreduce`; a settled reduction is
                carried out before this returns.

        Returns:
            Its ``test()``: drives progress, true once complete.
        """
        nbytes = x.numel() * x.element_size()
        algorithm = choose_allreduce(
            nbytes,
            self.comm.size,
            settled=settled,
            settings=self.settings,
            compact=self.compacts(x),
        )
        if algorithm is Algorithm.NONE:
            return lambda: True
        if algorithm is Algorithm.COMPACT:
            return CompactAllreduce(self.comm, x, *self._compact_args()).test
        if algorithm is Algorithm.SETTLED:
            settled_allreduce(self.comm, x, self.scratch)
            self._stage_done()
            return lambda: True
        if algorithm is Algorithm.RING:
            ring = RingAllreduce(
                self.comm,
                x,
                self._rings,
                self.settings.ring_chunk_bytes,
                self.scratch,
                self._stage_done,
            )
            self._rings += 1
            return ring.test
        return self.comm.Iallreduce(x).Test

    def allreduce(self, x: torch.Tensor, *, what: str = "allreduce") -> torch.Tensor:
        """Sum a contiguous CPU tensor in place over every rank (polled); returns it.

        Nothing is left to overlap, so when the size suits the blocking ring
        every rank first meets in a polled barrier, after which the ring is
        settled.
        """
        if self.comm.size == 1:
            return x
        nbytes = x.numel() * x.element_size()
        s = self.settings
        settled = s.ring_min_bytes <= nbytes < s.settled_max_bytes
        settled = settled and not self.compacts(x)
        if settled:
            self.comm.barrier(what=what)
        test = self.start_allreduce(x, settled=settled)
        self.comm.wait_for(test, what, activity=lambda: self.events)
        return x

    def mean_allreduce(
        self,
        x: torch.Tensor,
        header: np.ndarray,
        *,
        what: str = "mean all-reduce",
        timeout: float | None = None,
    ) -> np.ndarray:
        """:func:`~hybridagg.collectives.mean_allreduce` with this pool and counter."""
        total = mean_allreduce(
            self.comm, x, header, self.scratch, what=what, timeout=timeout
        )
        self._stage_done()
        return total
