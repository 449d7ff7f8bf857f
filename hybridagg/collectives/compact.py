"""Sums and broadcasts whose messages carry bf16 or fp16, formed in float32.

MPI has no bf16 or fp16 type it could reduce, and a ring that forwards
partial sums would round each of them again at every hop. These
operations instead let the receiver see every sender's compact piece and
add the pieces up in float32 (or the buffer's own float64):

* :class:`CompactAllreduce`: a direct reduce-scatter, then a direct
  all-gather. The buffer is cut into ``n`` segments; rank ``r`` receives
  segment ``r`` of every other rank's rounded contribution, adds them to its
  own in float32, in rank order, rounds the sum once and sends it to every
  other rank. Each rank sends and receives ``2 (n - 1) / n`` of the buffer,
  as the bandwidth-optimal ring does, at half the bytes per element; the
  sum is exact in float32 over the rounded contributions, and every rank
  ends with bitwise the same values (each segment is summed and rounded by
  one rank only).
* :class:`CompactReduce`: every other rank sends its rounded contribution to
  the root, which adds them to its own (unrounded) values in float32.
* :class:`CompactBcast`: the root rounds its values, keeps the rounded
  values itself (so that every replica holds the same model) and
  broadcasts the bits (``MPI_Ibcast``: moving bits needs no reduction).

Every rounding of a gradient goes through the caller's
:class:`~hybridagg.comm.ErrorFeedback`, keyed by the buffer: a contribution
(``"part"``), the sum a rank forms for its segment (``"sum"``) and the
values a root broadcasts (``"bcast"``). Each operation is posted on
construction and completed by calling :meth:`test` until it returns true.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from mpi4py import MPI

from ..comm import Comm, ErrorFeedback, ScratchPool, as_buffer, wire_view
from .partition import even_bounds

__all__ = ["CompactAllreduce", "CompactBcast", "CompactReduce", "compact_tag"]

_TAG_BASE = 200  # below the settled (900) and pipelined (1000+) rings' tags
_ROUNDS = 300


def compact_tag(seq: int, phase: int) -> int:
    """The tag of phase ``phase`` (0 or 1) of compact operation number ``seq``.

    Operations of one communicator may complete in another order on
    different ranks, so each in flight needs its own tags; 300 may be in
    flight before tags repeat.
    """
    return _TAG_BASE + (seq % _ROUNDS) * 2 + phase


def _key(kind: str, x: torch.Tensor) -> tuple:
    # a bucket is one buffer for the whole run: its memory names it
    return (kind, x.data_ptr(), x.numel())


class _CompactOp:
    """What the three operations share: scratch, requests, counters."""

    def __init__(
        self,
        comm: Comm,
        x: torch.Tensor,
        feedback: ErrorFeedback,
        seq: int,
        scratch: ScratchPool,
        on_stage: Callable[[], None],
        on_send: Callable[[int], None],
    ) -> None:
        if not x.is_contiguous() or x.device.type != "cpu":
            raise ValueError("a compact collective needs a contiguous CPU tensor")
        self.comm, self.n, self.r = comm, comm.size, comm.rank
        self.x = x.view(-1)
        self.feedback, self.seq, self.scratch = feedback, seq, scratch
        self.on_stage, self.on_send = on_stage, on_send
        self.dtype = feedback.dtype
        self.taken: list[torch.Tensor] = []
        self.reqs: list[MPI.Request] = []
        self.done = False

    def take(self, numel: int) -> torch.Tensor:
        buf = self.scratch.take(numel, self.dtype)
        self.taken.append(buf)
        return buf

    def send(self, buf: torch.Tensor, dest: int, phase: int) -> None:
        self.on_send(buf.numel() * buf.element_size())
        self.reqs.append(
            self.comm.mpi.Isend(
                as_buffer(wire_view(buf)), dest, compact_tag(self.seq, phase)
            )
        )

    def recv(self, buf: torch.Tensor, source: int, phase: int) -> None:
        self.reqs.append(
            self.comm.mpi.Irecv(
                as_buffer(wire_view(buf)), source, compact_tag(self.seq, phase)
            )
        )

    def finish(self) -> None:
        self.done = True
        self.reqs = []
        for buf in self.taken:
            self.scratch.give(buf)
        self.taken = []


class CompactAllreduce(_CompactOp):
    """One in-place sum all-reduce whose messages carry a compact type.

    Construct it on every rank of ``comm`` in the same order (``seq`` counts
    the compact operations posted on ``comm``); call :meth:`test` until it
    returns true.

    Args:
        comm: The communicator (all its ranks take part, at least two).
        x: A contiguous CPU floating-point tensor; summed in place.
        feedback: Rounds this rank's contribution and its segment's sum.
        seq: Index of this operation among the compact ones on ``comm``.
        scratch: Where the compact buffers come from and go back to.
        on_stage: Called when a phase completes (progress).
        on_send: Called with the bytes of each message posted.
    """

    def __init__(
        self,
        comm: Comm,
        x: torch.Tensor,
        feedback: ErrorFeedback,
        seq: int,
        scratch: ScratchPool,
        on_stage: Callable[[], None] = lambda: None,
        on_send: Callable[[int], None] = lambda n: None,
    ) -> None:
        super().__init__(comm, x, feedback, seq, scratch, on_stage, on_send)
        n, r = self.n, self.r
        self.bounds = even_bounds(self.x.numel(), n)
        self.wire = self.take(self.x.numel())
        feedback.round(self.x, self.wire, _key("part", self.x))
        lo, hi = self.bounds[r], self.bounds[r + 1]
        # the other ranks' pieces of this rank's segment, in rank order
        self.pieces = self.take((n - 1) * (hi - lo))
        self.peers = [j for j in range(n) if j != r]
        for k, j in enumerate(self.peers):
            self.recv(self.pieces[k * (hi - lo) : (k + 1) * (hi - lo)], j, 0)
        for j in self.peers:
            self.send(self.seg(self.wire, j), j, 0)
        self.phase = 0

    def seg(self, t: torch.Tensor, j: int) -> torch.Tensor:
        return t[self.bounds[j] : self.bounds[j + 1]]

    def _sum_mine(self) -> None:
        r = self.r
        mine = self.seg(self.x, r)
        size = mine.numel()
        mine.copy_(self.seg(self.wire, r))  # this rank's own rounded piece
        for k in range(len(self.peers)):
            mine.add_(self.pieces[k * size : (k + 1) * size])
        rounded = self.seg(self.wire, r)
        self.feedback.round(mine, rounded, _key("sum", mine))
        mine.copy_(rounded)  # what every other rank will hold
        self.reqs = []
        for j in self.peers:
            self.recv(self.seg(self.wire, j), j, 1)
        for j in self.peers:
            self.send(rounded, j, 1)

    def test(self) -> bool:
        """Advance if this phase's messages have arrived; true when complete."""
        if self.done:
            return True
        if not MPI.Request.Testall(self.reqs):
            return False
        self.on_stage()
        if self.phase == 0:
            self.phase = 1
            self._sum_mine()
            return self.test()
        for j in self.peers:
            self.seg(self.x, j).copy_(self.seg(self.wire, j))
        self.finish()
        return True


class CompactReduce(_CompactOp):
    """A sum of every rank's tensor into the root's, the others sending a compact type.

    Args:
        root: The rank that receives the sum (its own values are not rounded).
        (others): As :class:`CompactAllreduce`.
    """

    def __init__(
        self,
        comm: Comm,
        x: torch.Tensor,
        root: int,
        feedback: ErrorFeedback,
        seq: int,
        scratch: ScratchPool,
        on_stage: Callable[[], None] = lambda: None,
        on_send: Callable[[int], None] = lambda n: None,
    ) -> None:
        super().__init__(comm, x, feedback, seq, scratch, on_stage, on_send)
        self.root = root
        numel = self.x.numel()
        if self.r == root:
            self.pieces = self.take((self.n - 1) * numel)
            self.peers = [j for j in range(self.n) if j != root]
            for k, j in enumerate(self.peers):
                self.recv(self.pieces[k * numel : (k + 1) * numel], j, 0)
        else:
            wire = self.take(numel)
            feedback.round(self.x, wire, _key("part", self.x))
            self.send(wire, root, 0)

    def test(self) -> bool:
        """True once the contribution has left (or, on the root, the sum is formed)."""
        if self.done:
            return True
        if not MPI.Request.Testall(self.reqs):
            return False
        self.on_stage()
        if self.r == self.root:
            numel = self.x.numel()
            for k in range(len(self.peers)):
                self.x.add_(self.pieces[k * numel : (k + 1) * numel])
        self.finish()
        return True


class CompactBcast(_CompactOp):
    """The root's tensor, rounded (with error feedback), on every rank.

    Args:
        root: The rank whose values are sent; it keeps the rounded values.
        (others): As :class:`CompactAllreduce`.
    """

    def __init__(
        self,
        comm: Comm,
        x: torch.Tensor,
        root: int,
        feedback: ErrorFeedback,
        seq: int,
        scratch: ScratchPool,
        on_stage: Callable[[], None] = lambda: None,
        on_send: Callable[[int], None] = lambda n: None,
    ) -> None:
        super().__init__(comm, x, feedback, seq, scratch, on_stage, on_send)
        self.root = root
        self.wire = self.take(self.x.numel())
        if self.r == root:
            feedback.round(self.x, self.wire, _key("bcast", self.x))
            self.x.copy_(self.wire)  # every replica holds the same values
            # (a broadcast tree sends the buffer once per child: count it once)
            on_send(self.wire.numel() * self.wire.element_size())
        self.reqs = [self.comm.mpi.Ibcast(as_buffer(wire_view(self.wire)), root)]

    def test(self) -> bool:
        """True once the broadcast is complete (and widened into the tensor)."""
        if self.done:
            return True
        if not MPI.Request.Testall(self.reqs):
            return False
        self.on_stage()
        if self.r != self.root:
            self.x.copy_(self.wire)
        self.finish()
        return True
