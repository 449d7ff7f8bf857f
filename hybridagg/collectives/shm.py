"""A gradient bucket in node-shared memory, reduced with loads and stores.

When every rank of a group runs on one node (the ``node`` grouping policy,
or one machine), message passing is a detour: a reduction through MPI
copies each segment into a scratch buffer before it can be added. Here the
bucket lives in an MPI shared-memory window (``MPI_Win_allocate_shared``),
so each rank reads its peers' gradients where they are:

1. A small all-reduce of the step's control vector (the header) shows that
   every rank has finished writing its gradients, and carries the sample
   counts that weight them.
2. Rank ``r`` computes segment ``r`` of the weighted mean from every rank's
   bucket, in place in its own bucket (nobody else reads that segment of
   it). At 2 ranks this is one ``lerp_``.
3. After a barrier, each rank copies the other segments from their owners.
4. A second barrier, so that no rank changes its bucket (the next backward,
   gradient clipping) while a peer still copies from it.

Per rank and 2 ranks this moves 40% less memory than a ring through MPI
(no scratch copy; timings in bench/RESULTS.md). Every segment is computed
once, in one fixed order, then copied, so every rank holds bitwise the same
result.

Small buckets take :class:`SharedStaging` instead: one synchronisation per
step, each rank reducing the whole bucket from copies in shared memory.
"""

from __future__ import annotations

import os

import numpy as np
import torch
from mpi4py import MPI

from ..comm import Comm
from .partition import even_bounds

__all__ = ["SharedBucket", "SharedStaging", "shared_memory_usable"]

# where Open MPI and MPICH back shared-memory windows on Linux
_SHM_DIR = "/dev/shm"
# how long the barriers after the arrival spin before they sleep
_SPIN_S = 3e-3


def _room_for(nbytes: int) -> bool:
    try:
        stat = os.statvfs(_SHM_DIR)
    except OSError:
        return True  # no such file system to check: let MPI decide
    # twice the window: the runtime's own segments live there too
    return stat.f_bavail * stat.f_frsize >= 2 * nbytes


def _barrier(
    comm: Comm, what: str, timeout: float | None = None, spin: float | None = None
) -> None:
    """A polled barrier: a rank that never arrives gives a timeout, not a hang."""
    comm.wait_for(comm.mpi.Ibarrier().Test, what, timeout, spin=spin)


def shared_memory_usable(comm: Comm, nbytes: int, enabled: bool) -> bool:
    """Whether ``comm`` may reduce a bucket of ``nbytes`` in shared memory (collective).

    True when every rank passes ``enabled`` (``HYBRIDAGG_SHM_REDUCE``, through
    :class:`~hybridagg.collectives.CollectiveSettings`), sees room for twice
    the whole window (``comm.size * nbytes``) in ``/dev/shm`` (a full one, as
    with a container's default 64 MiB, would crash the first store with
    SIGBUS instead of failing cleanly), and shares a node with every other
    rank. Every rank gets the same answer.
    """
    if comm.size == 1:
        return False  # nothing to reduce
    votes = np.array(
        [bool(enabled), _room_for(comm.size * nbytes)],
        dtype=np.int64,
    )
    # (polled: it is also the barrier before the blocking split)
    comm.wait(
        comm.mpi.Iallreduce(MPI.IN_PLACE, votes, MPI.MIN),
        what="shared-memory vote",
    )
    if not votes.all():
        return False
    node = comm.mpi.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        return node.Get_size() == comm.size
    finally:
        node.Free()


class SharedBucket:
    """A flat tensor per rank in one shared window, and its weighted-mean reduction.

    Construction is collective over ``comm``, whose ranks must share a node
    (:func:`shared_memory_usable`). :meth:`free` (collective) releases the
    window; otherwise ``MPI_Finalize`` does. Each rank's part is allocated
    on its own pages (``alloc_shared_noncontig``), near the rank that writes
    it.

    Args:
        comm: The group's communicator.
        numel: Elements of the bucket (the same on every rank).
        dtype: A floating-point dtype numpy knows.
    """

    def __init__(self, comm: Comm, numel: int, dtype: torch.dtype) -> None:
        np_dtype = torch.empty(0, dtype=dtype).numpy().dtype
        self.comm, self.numel = comm, numel
        itemsize = np_dtype.itemsize
        info = MPI.Info.Create()
        info.Set("alloc_shared_noncontig", "true")
        try:
            self.win = MPI.Win.Allocate_shared(
                max(numel, 1) * itemsize, itemsize, info=info, comm=comm.mpi
            )
        finally:
            info.Free()
        self.views = []
        for r in range(comm.size):
            mem, _ = self.win.Shared_query(r)
            array = np.frombuffer(mem, dtype=np_dtype, count=numel)
            self.views.append(torch.from_numpy(array))
        self.flat = self.views[comm.rank]
        self.flat.zero_()
        self._bounds = even_bounds(numel, comm.size)

    def _segment(self, owner: int, of: int) -> torch.Tensor:
        return self.views[of][self._bounds[owner] : self._bounds[owner + 1]]

    def _barrier(self, what: str, timeout: float | None, spin: float | None = None):
        _barrier(self.comm, what, timeout, spin)

    def reduce(
        self,
        header: np.ndarray,
        *,
        what: str = "shared-memory reduction",
        timeout: float | None = None,
    ) -> np.ndarray:
        """Replace every rank's bucket by the weighted mean; sum the headers.

        The same contract as :func:`~hybridagg.collectives.mean_allreduce`: rank
        ``i`` weighs ``header_i[0]`` (a rank with weight 0 must hold zeros;
        if every weight is 0 the zeros stay), and the result is the sum of
        the headers, whose first entry, the total weight, is added up in
        rank order. Collective over the communicator.

        Args:
            header: A 1-D float64 array whose first entry is the rank's weight.
            what: Names the operation in a timeout.
            timeout: Seconds any of the three waits may take (default: the
                communicator's).

        Returns:
            The element-wise sum of every rank's header (a new array).
        """
        comm = self.comm
        n, r, m = comm.size, comm.rank, len(header)
        if n == 1:
            return np.array(header, dtype=np.float64)
        head = np.zeros(m + n)
        head[:m] = header
        head[m + r] = head[0]
        # (MPI_Win_sync, the memory barrier between a rank's stores and its
        # peers' loads, is defined only inside a passive-target epoch)
        self.win.Lock_all(MPI.MODE_NOCHECK)
        try:
            self.win.Sync()  # this rank's gradient stores
            comm.wait(
                comm.mpi.Iallreduce(MPI.IN_PLACE, head),
                what=f"{what}: arrival",
                timeout=timeout,
            )
            weights = head[m:]
            total = float(weights.sum())
            self._combine(weights, total, what, timeout)
        finally:
            self.win.Unlock_all()
        out = head[:m].copy()
        out[0] = total
        return out

    def _combine(
        self, weights: np.ndarray, total: float, what: str, timeout: float | None
    ) -> None:
        n, r = self.comm.size, self.comm.rank
        self.win.Sync()  # see the peers' stores
        mine = self._segment(r, r)
        if total > 0:
            if n == 2:
                mine.lerp_(self._segment(r, 1 - r), float(weights[1 - r]) / total)
            else:
                mine.mul_(float(weights[r]) / total)
                for j in range(n):
                    if j != r:
                        mine.add_(self._segment(r, j), alpha=float(weights[j]) / total)
        self.win.Sync()
        # Every rank has posted the arrival and is only finishing its own
        # segment, so the two barriers spin up to _SPIN_S before they sleep.
        # (With the default short spin, a rank that went to sleep here was
        # sometimes woken late and whole reductions ran several times slower,
        # bench/RESULTS.md; polled rather than blocking, a peer that failed
        # in between still gives a timeout.)
        self._barrier(f"{what}: segments reduced", timeout, _SPIN_S)
        self.win.Sync()
        for j in range(n):
            if j != r:
                self._segment(j, r).copy_(self._segment(j, j))
        self.win.Sync()
        self._barrier(f"{what}: segments copied", timeout, _SPIN_S)

    def free(self, timeout: float | None = None) -> None:
        """Release the window (collective); the tensors must no longer be used.

        A polled barrier comes first, so a rank that never calls gives a
        timeout instead of a hang inside ``MPI_Win_free``.
        """
        self._barrier("shared bucket release", timeout)
        self.views, self.flat = [], None
        self.win.Free()


class SharedStaging:
    """A small bucket's weighted mean, computed whole by every rank from shared copies.

    For buckets of a few hundred KiB the cost of :class:`SharedBucket` is its
    three synchronisations, each a round of latency on a loaded node, and
    that of an MPI all-reduce is its rounds of messages, each needing the
    peers to be scheduled (on an oversubscribed node, ranks then finish the
    step's all-reduce at different times, and a rank that finishes late
    starts its next step late). Here each rank copies its raw bucket and
    header into its slot of a shared window and raises its flag, waits until
    every flag is raised (the only synchronisation), and sums all the slots
    itself, in rank order, so every rank holds bitwise the same result.
    Slots alternate between two copies by the parity of the step: a rank
    rewrites a copy only two steps later, after every peer has raised its
    flag for the step in between, which it does only after it has finished
    reading.

    Every wait also calls ``MPI_Iprobe``, so MPI requests in flight
    elsewhere (a leader's overlapped exchange with the servers) keep moving
    while a rank waits here, as they do in a polled MPI collective.

    Construction is collective over ``comm``, whose ranks must share a node
    (:func:`shared_memory_usable`). :meth:`free` (collective) releases the
    window; otherwise ``MPI_Finalize`` does.

    Args:
        comm: The group's communicator.
        flat: The bucket: a contiguous float32 or float64 CPU tensor that
            needs no gradient (it stays private memory).
        header_len: Entries of the float64 header :meth:`reduce` takes (>= 1).

    Raises:
        TypeError: ``flat`` is not such a tensor.
        ValueError: ``header_len`` is below 1.
    """

    def __init__(self, comm: Comm, flat: torch.Tensor, header_len: int) -> None:
        if (
            not isinstance(flat, torch.Tensor)
            or flat.device.type != "cpu"
            or flat.dtype not in (torch.float32, torch.float64)
            or flat.requires_grad
            or not flat.is_contiguous()
        ):
            raise TypeError(
                "flat must be a contiguous float32/float64 CPU tensor without "
                f"requires_grad, got {type(flat).__name__}"
                + (
                    f" {flat.dtype} on {flat.device}"
                    if isinstance(flat, torch.Tensor)
                    else ""
                )
            )
        if int(header_len) < 1:
            raise ValueError(f"header_len must be >= 1, got {header_len}")
        self.comm, self.flat, self.header_len = comm, flat, int(header_len)
        np_dtype = flat.numpy().dtype
        numel, itemsize = flat.numel(), np_dtype.itemsize
        data_bytes = -(-numel * itemsize // 8) * 8  # 8-byte aligned slots
        self._slot = 8 * header_len + data_bytes
        size = 8 + 2 * self._slot
        info = MPI.Info.Create()
        info.Set("alloc_shared_noncontig", "true")
        try:
            self.win = MPI.Win.Allocate_shared(size, 1, info=info, comm=comm.mpi)
        finally:
            info.Free()
        self.flags, self.heads, self.data = [], [], []
        for r in range(comm.size):
            mem, _ = self.win.Shared_query(r)
            raw = np.frombuffer(mem, dtype=np.uint8, count=size)
            self.flags.append(raw[:8].view(np.int64))
            heads, data = [], []
            for copy in range(2):
                at = 8 + copy * self._slot
                heads.append(raw[at : at + 8 * header_len].view(np.float64))
                body = raw[at + 8 * header_len : at + 8 * header_len + numel * itemsize]
                data.append(torch.from_numpy(body.view(np_dtype)))
            self.heads.append(heads)
            self.data.append(data)
        self.steps = 0
        # (MPI_Win_sync, the memory barrier between a rank's stores and its
        # peers' loads, is defined only inside a passive-target epoch)
        self.win.Lock_all(MPI.MODE_NOCHECK)
        try:
            self.flags[comm.rank][0] = 0
            self.win.Sync()
        finally:
            self.win.Unlock_all()
        # nobody may read a flag before its owner has zeroed it
        _barrier(comm, "shared staging set-up")

    def _all_raised(self, step: int) -> bool:
        self.comm.mpi.Iprobe(MPI.ANY_SOURCE, MPI.ANY_TAG)  # MPI progress
        self.win.Sync()  # see the peers' stores
        return all(int(f[0]) >= step for f in self.flags)

    def reduce(
        self,
        header: np.ndarray,
        *,
        what: str = "shared-memory reduction",
        timeout: float | None = None,
    ) -> np.ndarray:
        """Replace every rank's bucket by the weighted mean; sum the headers.

        The contract of :meth:`SharedBucket.reduce`: rank ``i`` weighs
        ``header_i[0]`` (a rank with weight 0 must hold zeros; if every
        weight is 0 the zeros stay), and the result is the sum of the headers,
        added up in rank order. Collective over the communicator.

        Args:
            header: A 1-D float64 array of ``header_len`` entries whose first
                is the rank's weight.
            what: Names the operation in a timeout.
            timeout: Seconds the wait for the peers may take (default: the
                communicator's).

        Returns:
            The element-wise sum of every rank's header (a new array).

        Raises:
            ValueError: The header has the wrong length.
        """
        if not self.flags:
            raise ValueError("this SharedStaging was freed")
        if len(header) != self.header_len:
            raise ValueError(
                f"header has {len(header)} entries, expected {self.header_len}"
            )
        n, r = self.comm.size, self.comm.rank
        step = self.steps + 1
        copy = step % 2
        self.win.Lock_all(MPI.MODE_NOCHECK)
        try:
            self.heads[r][copy][:] = header
            self.data[r][copy].copy_(self.flat)
            self.win.Sync()  # the slot before the flag
            self.flags[r][0] = step
            self.win.Sync()
            self.comm.wait_for(
                lambda: self._all_raised(step), f"{what}: arrival", timeout
            )
            self.win.Sync()  # the peers' slots after their flags
            self.steps = step
            out = self.heads[0][copy].copy()
            for j in range(1, n):
                out += self.heads[j][copy]
            weights = [float(self.heads[j][copy][0]) for j in range(n)]
            total = float(out[0])  # (summed in rank order, as the weights are)
            if total > 0:
                torch.mul(self.data[0][copy], weights[0] / total, out=self.flat)
                for j in range(1, n):
                    self.flat.add_(self.data[j][copy], alpha=weights[j] / total)
        finally:
            self.win.Unlock_all()
        return out

    def free(self, timeout: float | None = None) -> None:
        """Release the window (collective); the bucket itself stays usable.

        A polled barrier comes first, so a rank that never calls gives a
        timeout instead of a hang inside ``MPI_Win_free``. A second call
        does nothing.

        Args:
            timeout: Seconds the barrier may take (default: the communicator's).
        """
        if not self.flags:
            return
        _barrier(self.comm, "shared staging release", timeout)
        self.flags, self.heads, self.data = [], [], []
        self.win.Free()
