"""Ring all-reduces over point-to-point messages.

Why not ``MPI_Iallreduce`` for large buffers: on shared memory it ran
several times slower than the blocking ``MPI_Allreduce``, while a ring of
``MPI_Isend``/``MPI_Irecv`` matched or beat the blocking call
(bench/RESULTS.md), and a blocking collective cannot be polled (it spins a
core while a peer is still in backward). So large buckets are reduced by
this ring, progressed by ``MPI_Test`` from the gradient hooks and from the
polled wait, like every other request.

Algorithm (Patarasuk and Yuan's bandwidth-optimal ring, as Baidu and Horovod
use it): the buffer is cut into ``n`` segments. In ``n - 1`` reduce-scatter
stages rank ``r`` sends segment ``(r - k) mod n`` to its right neighbour and
adds the segment ``(r - k - 1) mod n`` it receives from its left one; rank
``r`` then holds the complete sum of segment ``(r + 1) mod n``. In ``n - 1``
all-gather stages the complete segments travel once more around the ring.
Each rank sends and receives ``2 (n - 1) / n`` of the buffer, the optimum.
Every segment is further cut into chunks that advance independently, so the
addition of one chunk overlaps the transfer of the next.

Every rank ends with bitwise the same result (each element is summed once, in
one fixed order, then copied), which keeps replicas identical.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from mpi4py import MPI

from ..comm import Comm, ScratchPool, as_buffer
from .partition import even_bounds, ring_neighbours

__all__ = [
    "MAX_CHUNKS",
    "RingAllreduce",
    "Segments",
    "ring_tag",
    "ring_tags",
    "settled_allreduce",
]

MAX_CHUNKS = 64
_TAG_BASE = 1000
_SETTLED_TAG = 900  # below the pipelined rings' tags


class Segments:
    """A flat tensor cut into ``n`` ring segments; ``seg(i)`` wraps around."""

    def __init__(self, flat: torch.Tensor, n: int) -> None:
        self.flat, self.n = flat, n
        self.bounds = even_bounds(flat.numel(), n)
        self.longest = max(self.bounds[i + 1] - self.bounds[i] for i in range(n))

    def __call__(self, i: int) -> torch.Tensor:
        i %= self.n
        return self.flat[self.bounds[i] : self.bounds[i + 1]]

    def range(self, i: int) -> tuple[int, int]:
        """Start and end of segment ``i`` (wrapping around)."""
        i %= self.n
        return self.bounds[i], self.bounds[i + 1]


def _tag_ub() -> int:
    # TAG_UB is defined on COMM_WORLD; duplicates need not carry it
    value = MPI.COMM_WORLD.Get_attr(MPI.TAG_UB)
    return 32767 if value is None else int(value)


def ring_tags(tag_ub: int, nranks: int, nchunks: int) -> int:
    """How many ring all-reduces may be in flight before their tags repeat.

    Tags are ``base + ((seq mod S) x stages + stage) x nchunks + chunk``,
    where :func:`ring_tag` passes the most chunks a ring may have; the result
    ``S`` is what fits below ``MPI_TAG_UB``.

    Raises:
        ValueError: Not even two rounds fit (a very small ``MPI_TAG_UB``).
    """
    per_round = max(1, 2 * (nranks - 1)) * nchunks
    rounds = (tag_ub - _TAG_BASE) // per_round
    if rounds < 2:
        raise ValueError(
            f"MPI_TAG_UB={tag_ub} is too small for a ring over {nranks} ranks"
        )
    return rounds


def ring_tag(seq: int, stage: int, chunk: int, *, nranks: int, tag_ub: int) -> int:
    """The tag of one chunk's message in one stage of ring number ``seq``.

    Every ring reserves room for ``MAX_CHUNKS`` chunks, whatever its own
    chunk count, so rings of different sizes in flight on one communicator
    never share a tag (a receive could otherwise match another ring's
    message of the same tag). With the smallest ``MPI_TAG_UB`` the standard
    allows (32767), that leaves 248 rings in flight at 2 ranks and 35 at 8
    (Open MPI's bound is 2**31 - 1).
    """
    stages = max(1, 2 * (nranks - 1))
    rounds = ring_tags(tag_ub, nranks, MAX_CHUNKS)
    return _TAG_BASE + ((seq % rounds) * stages + stage) * MAX_CHUNKS + chunk


class RingAllreduce:
    """One in-place sum all-reduce of a contiguous CPU tensor, in progress.

    Construct it on every rank of ``comm`` in the same order (``seq`` counts
    the rings posted on ``comm``); call :meth:`test` until it returns true.

    Args:
        comm: The communicator (all its ranks take part).
        buf: A contiguous CPU tensor; reduced in place.
        seq: Index of this ring among those posted on ``comm`` (same on every rank).
        chunk_bytes: Pipelining granularity.
        scratch: Where the receive buffers come from and go back to.
        on_stage: Called whenever a chunk completes a stage (progress).
    """

    def __init__(
        self,
        comm: Comm,
        buf: torch.Tensor,
        seq: int,
        chunk_bytes: int,
        scratch: ScratchPool,
        on_stage: Callable[[], None] = lambda: None,
    ) -> None:
        if not buf.is_contiguous() or buf.device.type != "cpu":
            raise ValueError("the ring all-reduce needs a contiguous CPU tensor")
        self.comm, self.n, self.r = comm, comm.size, comm.rank
        self.scratch, self.on_stage = scratch, on_stage
        self.flat = buf.view(-1)
        self.segments = Segments(self.flat, self.n)
        longest = self.segments.longest
        nbytes = longest * self.flat.element_size()
        self.nchunks = max(1, min(MAX_CHUNKS, -(-nbytes // max(1, chunk_bytes))))
        self.slot = -(-longest // self.nchunks) if longest else 0
        self._cuts = []  # per segment: its start and its chunks' cut points
        for i in range(self.n):
            a, b = self.segments.range(i)
            self._cuts.append((a, even_bounds(b - a, self.nchunks)))
        self.tmp = scratch.take(self.slot * self.nchunks, self.flat.dtype)
        self.stages = 2 * (self.n - 1)
        self.seq, self.tag_ub = seq, _tag_ub()
        self.left, self.right = ring_neighbours(self.r, self.n)
        self.stage = [0] * self.nchunks
        self.reqs: list[list[MPI.Request]] = [[] for _ in range(self.nchunks)]
        self.done = self.n == 1 or self.flat.numel() == 0
        if self.done:
            scratch.give(self.tmp)
        else:
            for j in range(self.nchunks):
                self._post(j)

    def _chunk(self, segment: int, j: int) -> tuple[int, int]:
        a, cut = self._cuts[segment % self.n]
        return a + cut[j], a + cut[j + 1]

    def _post(self, j: int) -> None:
        k, n, r = self.stage[j], self.n, self.r
        tag = ring_tag(self.seq, k, j, nranks=n, tag_ub=self.tag_ub)
        if k < n - 1:  # reduce-scatter
            slo, shi = self._chunk(r - k, j)
            rlo, rhi = self._chunk(r - k - 1, j)
            into = self.tmp[j * self.slot : j * self.slot + (rhi - rlo)]
        else:  # all-gather
            s = k - (n - 1)
            slo, shi = self._chunk(r + 1 - s, j)
            rlo, rhi = self._chunk(r - s, j)
            into = self.flat[rlo:rhi]
        mpi = self.comm.mpi
        self.reqs[j] = [
            mpi.Irecv(as_buffer(into), self.left, tag),
            mpi.Isend(as_buffer(self.flat[slo:shi]), self.right, tag),
        ]

    def _finish_stage(self, j: int) -> None:
        k = self.stage[j]
        if k < self.n - 1:
            rlo, rhi = self._chunk(self.r - k - 1, j)
            self.flat[rlo:rhi].add_(
                self.tmp[j * self.slot : j * self.slot + (rhi - rlo)]
            )
        self.stage[j] = k + 1
        self.on_stage()
        if self.stage[j] < self.stages:
            self._post(j)
        else:
            self.reqs[j] = []

    def test(self) -> bool:
        """Advance every chunk whose messages have arrived; true when all are done."""
        if self.done:
            return True
        finished = True
        for j in range(self.nchunks):
            while self.stage[j] < self.stages and MPI.Request.Testall(self.reqs[j]):
                self._finish_stage(j)
            if self.stage[j] < self.stages:
                finished = False
        self.done = finished
        if finished:
            self.scratch.give(self.tmp)
        return finished


def gather_blocking(comm: Comm, seg: Segments, tag: int) -> None:
    """The ring's all-gather as blocking ``MPI_Sendrecv`` calls.

    Only for when every rank is known to have arrived: nobody is late, so
    the blocking calls spin only briefly.
    """
    r = comm.rank
    left, right = ring_neighbours(r, comm.size)
    for s in range(comm.size - 1):
        comm.mpi.Sendrecv(
            as_buffer(seg(r + 1 - s)), right, tag,
            as_buffer(seg(r - s)), left, tag,
        )  # fmt: skip


def settled_allreduce(comm: Comm, buf: torch.Tensor, scratch: ScratchPool) -> None:
    """A blocking ring sum all-reduce, for when every rank is known to have arrived.

    Sums ``buf`` in place on every rank, bitwise the same everywhere: the
    same ring as :class:`RingAllreduce`, one ``MPI_Sendrecv`` per stage and
    no chunks. Nobody is late, so the blocking calls spin only briefly and
    cost no polling.

    Args:
        comm: The communicator; every rank calls with the same size.
        buf: A contiguous CPU tensor, reduced in place.
        scratch: Where the receive buffer comes from.
    """
    n, r = comm.size, comm.rank
    if n == 1:
        return
    seg = Segments(buf.view(-1), n)
    tmp = scratch.take(seg.longest, buf.dtype)
    left, right = ring_neighbours(r, n)
    try:
        for k in range(n - 1):  # reduce-scatter
            mine = seg(r - k - 1)
            into = tmp[: mine.numel()]
            comm.mpi.Sendrecv(
                as_buffer(seg(r - k)), right, _SETTLED_TAG,
                as_buffer(into), left, _SETTLED_TAG,
            )  # fmt: skip
            mine.add_(into)
        gather_blocking(comm, seg, _SETTLED_TAG + 1)
    finally:
        scratch.give(tmp)
