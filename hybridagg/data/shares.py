"""Who reads what in an epoch: block shuffling, static shares, dynamic chunks.

An epoch's sample order is built in two steps, deterministic from
``(seed, epoch)``:

1. The split's rows are cut into *blocks* of ``block_samples`` consecutive
   rows (one HDF5 chunk each; blocks never cross files). The blocks are
   permuted and grouped into *windows* of ``window_blocks`` blocks.
2. Inside a window, blocks are read in file order into one buffer, and the
   buffer's rows are permuted.

Concatenating the windows gives the epoch's *stream*: position ``p`` of the
stream is one sample. Reads are whole blocks (large contiguous hyperslabs);
the randomness a model sees is block order plus a shuffle over
``window_blocks * block_samples`` samples.

**Static shares** (sync mode): the stream is cut into one contiguous piece
per worker, sized in proportion to the workers' batch sizes so that every
worker takes the same number of steps (:func:`split_static`). When batch
sizes change mid-epoch, the unread rest of every worker's piece is pooled
and cut again (:func:`resplit_static`).

**Dynamic chunks** (hybrid and async modes): a chunk is one window; workers
take chunk numbers from a shared counter (:class:`LocalCounter` for one
process, :class:`WindowCounter` for MPI), so fast workers take more chunks.

This module is pure logic except :class:`WindowCounter`.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence

import numpy as np

__all__ = [
    "EpochPlan",
    "Interval",
    "LocalCounter",
    "WindowCounter",
    "drop_prefix",
    "intervals_length",
    "make_blocks",
    "reshard_static",
    "resplit_static",
    "split_even_steps",
    "split_static",
]

Interval = tuple[int, int]


def make_blocks(lengths: Sequence[int], block_samples: int) -> np.ndarray:
    """Cut files of ``lengths`` rows into blocks of ``block_samples`` rows.

    Returns:
        An ``(n_blocks, 3)`` int64 array of ``(file, start, stop)``.

    Raises:
        ValueError: ``block_samples`` is not positive or a length is negative.
    """
    if block_samples < 1:
        raise ValueError(f"block_samples must be >= 1, got {block_samples}")
    rows = []
    for f, n in enumerate(lengths):
        if n < 0:
            raise ValueError(f"file {f} has a negative length {n}")
        starts = np.arange(0, n, block_samples, dtype=np.int64)
        stops = np.minimum(starts + block_samples, n)
        rows.append(np.stack([np.full_like(starts, f), starts, stops], axis=1))
    if not rows:
        return np.zeros((0, 3), dtype=np.int64)
    return np.concatenate(rows).reshape(-1, 3)


def _seed_seq(seed: int, *more: int) -> list[int]:
    if seed < 0:
        raise ValueError(f"seed must be >= 0, got {seed}")
    return [int(seed), *(int(m) for m in more)]


class EpochPlan:
    """The sample order of one epoch (see the module docstring).

    Args:
        lengths: Rows of each file of the split.
        block_samples: Rows per block.
        window_blocks: Blocks per window (the in-memory shuffle buffer and the
            dynamic chunk).
        seed: Seed of the run (``>= 0``).
        epoch: Epoch number; with ``seed`` it fixes the order.
        shuffle: ``False`` keeps file order (for validation).
    """

    def __init__(
        self,
        lengths: Sequence[int],
        block_samples: int,
        window_blocks: int,
        seed: int,
        epoch: int,
        *,
        shuffle: bool = True,
    ) -> None:
        if window_blocks < 1:
            raise ValueError(f"window_blocks must be >= 1, got {window_blocks}")
        self.seed, self.epoch, self.shuffle = int(seed), int(epoch), shuffle
        blocks = make_blocks(lengths, block_samples)
        if shuffle:
            rng = np.random.default_rng(_seed_seq(seed, epoch))
            blocks = blocks[rng.permutation(len(blocks))]
        self._windows: list[np.ndarray] = []
        for lo in range(0, len(blocks), window_blocks):
            w = blocks[lo : lo + window_blocks]
            self._windows.append(w[np.lexsort((w[:, 1], w[:, 0]))])
        sizes = [int((w[:, 2] - w[:, 1]).sum()) for w in self._windows]
        self.offsets = np.concatenate(([0], np.cumsum(sizes, dtype=np.int64)))
        self.total = int(self.offsets[-1])

    @property
    def n_windows(self) -> int:
        """Number of windows (= dynamic chunks) in the epoch."""
        return len(self._windows)

    def window_blocks(self, g: int) -> np.ndarray:
        """The ``(file, start, stop)`` blocks of window ``g``, in file order."""
        return self._windows[g]

    def window_size(self, g: int) -> int:
        """Samples in window ``g``."""
        return int(self.offsets[g + 1] - self.offsets[g])

    def window_perm(self, g: int) -> np.ndarray:
        """The permutation applied to window ``g``'s buffer."""
        n = self.window_size(g)
        if not self.shuffle:
            return np.arange(n, dtype=np.int64)
        rng = np.random.default_rng(_seed_seq(self.seed, self.epoch, g + 1))
        return rng.permutation(n).astype(np.int64)

    def pieces(self, intervals: Sequence[Interval]) -> Iterator[tuple[int, int, int]]:
        """Split stream intervals at window borders.

        Yields:
            ``(g, lo, hi)``: stream positions ``[lo, hi)`` relative to the
            start of window ``g``.
        """
        for a, b in intervals:
            if not 0 <= a <= b <= self.total:
                raise ValueError(
                    f"interval [{a}, {b}) outside the stream [0, {self.total})"
                )
            pos = a
            while pos < b:
                g = int(np.searchsorted(self.offsets, pos, side="right")) - 1
                end = min(b, int(self.offsets[g + 1]))
                yield g, pos - int(self.offsets[g]), end - int(self.offsets[g])
                pos = end

    def rows(self, intervals: Sequence[Interval]) -> np.ndarray:
        """The ``(file, row)`` of every stream position in ``intervals`` (tests, tools)."""
        out = []
        for g, lo, hi in self.pieces(intervals):
            blocks = self.window_blocks(g)
            file_rows = np.concatenate(
                [
                    np.stack([np.full(c - s, f), np.arange(s, c)], 1)
                    for f, s, c in blocks
                ]
            )
            out.append(file_rows[self.window_perm(g)[lo:hi]])
        if not out:
            return np.zeros((0, 2), dtype=np.int64)
        return np.concatenate(out)


def intervals_length(intervals: Sequence[Interval]) -> int:
    """Total samples in a list of intervals."""
    return int(sum(b - a for a, b in intervals))


def drop_prefix(intervals: Sequence[Interval], k: int) -> list[Interval]:
    """Remove the first ``k`` samples from a list of intervals."""
    out: list[Interval] = []
    for a, b in intervals:
        if k >= b - a:
            k -= b - a
            continue
        out.append((a + k, b))
        k = 0
    return out


def _take(intervals: list[Interval], k: int) -> tuple[list[Interval], list[Interval]]:
    head: list[Interval] = []
    rest = list(intervals)
    while k > 0 and rest:
        a, b = rest.pop(0)
        if b - a <= k:
            head.append((a, b))
            k -= b - a
        else:
            head.append((a, a + k))
            rest.insert(0, (a + k, b))
            k = 0
    return head, rest


def _check_batch_sizes(
    batch_sizes: Sequence[int], *, parked: bool = False
) -> list[int]:
    sizes = [int(b) for b in batch_sizes]
    if not sizes:
        raise ValueError("batch_sizes is empty")
    if parked:  # (a parked worker's size is 0; someone must still read)
        if min(sizes) < 0 or max(sizes) < 1:
            raise ValueError(
                f"batch sizes must be >= 0 with at least one >= 1, got {sizes}"
            )
    elif min(sizes) < 1:
        raise ValueError(f"every batch size must be >= 1, got {sizes}")
    return sizes


def split_static(
    pool: Sequence[Interval], batch_sizes: Sequence[int], *, drop_last: bool = False
) -> tuple[list[list[Interval]], int]:
    """Cut ``pool`` into one contiguous share per worker, by batch size.

    Every worker gets ``full * b_r`` samples, ``full = M // sum(b)``; the
    remainder (fewer than ``sum(b)`` samples) is shared in proportion to the
    batch sizes (largest remainder), each worker taking at most one more,
    partial, batch. So all workers take the same number of steps, and the
    last batch of a worker may be smaller (or empty when fewer samples remain
    than workers). With ``drop_last`` the remainder is left out. A batch
    size of 0 parks its worker: its share is empty, and it takes the same
    steps with empty batches.

    Returns:
        The shares (lists of intervals) in worker order, and the number of
        steps every worker takes.
    """
    sizes = _check_batch_sizes(batch_sizes, parked=True)
    total, global_batch = intervals_length(pool), sum(sizes)
    full, rem = divmod(total, global_batch)
    extra = [0] * len(sizes)
    if rem and not drop_last:
        quota = [rem * b / global_batch for b in sizes]
        extra = [int(q) for q in quota]
        order = sorted(range(len(sizes)), key=lambda r: (-(quota[r] - extra[r]), r))
        for r in order[: rem - sum(extra)]:
            extra[r] += 1
    shares, rest = [], list(pool)
    for b, e in zip(sizes, extra, strict=True):
        head, rest = _take(rest, full * b + e)
        shares.append(head)
    steps = full + (1 if rem and not drop_last else 0)
    return shares, steps


def split_even_steps(
    total: int, batch_sizes: Sequence[int], *, drop_last: bool = False
) -> tuple[list[list[Interval]], int]:
    """Cut ``[0, total)`` into shares that a fixed-batch ``DataLoader`` cuts into equal steps.

    :func:`split_static` may leave a worker's last batch empty, which
    :class:`~hybridagg.data.HDF5Loader` hands out as an empty batch; a
    ``DataLoader`` cutting a share into batches of ``b_r`` would instead take
    one step fewer on that worker, and a synchronous all-reduce would wait
    for it forever. So every share here is ``full * b_r`` samples plus, when
    there is a remainder, a last batch of at least one and at most ``b_r``
    samples: one each first, the rest in proportion to ``b_r - 1`` (largest
    remainder). When fewer samples remain than workers, the workers left
    without one get one sample again from the start of the epoch's order
    (as ``torch``'s ``DistributedSampler`` pads): at most ``workers - 1``
    samples are read twice in such an epoch, every other sample once. With
    ``drop_last`` the remainder is left out and nothing is read twice.

    Args:
        total: Samples of the epoch (stream positions ``0..total-1``).
        batch_sizes: Each worker's batch size.
        drop_last: Leave out the final partial step.

    Returns:
        Each worker's share (intervals of stream positions, in order), and
        the number of steps every worker takes
        (``ceil(len(share_r) / b_r)``, the same for all).

    Raises:
        ValueError: A batch size below 1, a negative total, or
            ``drop_last`` with fewer samples than one global batch.
    """
    sizes = _check_batch_sizes(batch_sizes)
    if total < 0:
        raise ValueError(f"total must be >= 0, got {total}")
    workers, global_batch = len(sizes), sum(sizes)
    full, rem = divmod(int(total), global_batch)
    if drop_last and full == 0:
        raise ValueError(
            f"drop_last with {total} samples and a global batch of {global_batch} "
            f"(batch sizes {sizes}) leaves no step"
        )
    extra = [0] * workers
    if rem and not drop_last:
        if rem >= workers:
            # one each, then the rest by the room left in each last batch
            # (rem < global_batch, so the room is positive when left > 0)
            left = rem - workers
            quota = [
                left * (b - 1) / (global_batch - workers) if left else 0.0
                for b in sizes
            ]
            add = [int(q) for q in quota]
            order = sorted(range(workers), key=lambda r: (-(quota[r] - add[r]), r))
            for r in order[: left - sum(add)]:
                add[r] += 1
            extra = [1 + a for a in add]
        else:
            extra = [1 if r < rem else 0 for r in range(workers)]
    shares: list[list[Interval]] = []
    start = 0
    for b, e in zip(sizes, extra, strict=True):
        n = full * b + e
        shares.append([(start, start + n)] if n else [])
        start += n
    steps = full + (1 if rem and not drop_last else 0)
    pad = 0
    for r, b in enumerate(sizes):
        while -(-intervals_length(shares[r]) // b) < steps:
            shares[r].append((pad % max(1, total), pad % max(1, total) + 1))
            pad += 1
    return shares, steps


def resplit_static(
    shares: Sequence[Sequence[Interval]],
    consumed: Sequence[int],
    batch_sizes: Sequence[int],
    *,
    drop_last: bool = False,
) -> tuple[list[list[Interval]], int]:
    """Re-cut the unread rest of every share for new batch sizes.

    Args:
        shares: Each worker's current share.
        consumed: Samples each worker has already taken from its share.
        batch_sizes: The new batch sizes.

    Returns:
        As :func:`split_static`, over what is left.
    """
    if len(shares) != len(consumed) or len(shares) != len(batch_sizes):
        raise ValueError(
            f"{len(shares)} shares, {len(consumed)} consumed counts and "
            f"{len(batch_sizes)} batch sizes: one each per worker"
        )
    pool: list[Interval] = []
    for share, k in zip(shares, consumed, strict=True):
        pool += drop_prefix(share, int(k))
    return split_static(pool, batch_sizes, drop_last=drop_last)


def reshard_static(
    shares: Sequence[Sequence[Interval]],
    batch_sizes: Sequence[int],
    *,
    drop_last: bool = False,
) -> tuple[list[list[Interval]], int]:
    """Cut the unread rest of an epoch saved by some workers for other workers.

    A static position (:meth:`StaticShares.state_dict
    <hybridagg.data.share_policy.StaticShares.state_dict>`) holds the unread
    rest of every old worker's share; those samples, and only those, are
    pooled in old worker order and cut for the new workers' batch sizes, so
    the epoch continues with every sample read exactly once, whatever the
    number of workers before and after.

    Args:
        shares: The unread rest of each old worker's share.
        batch_sizes: The new workers' batch sizes (one per new worker).

    Returns:
        As :func:`split_static`, over what is left.
    """
    pool = [tuple(iv) for share in shares for iv in share]
    return split_static(pool, batch_sizes, drop_last=drop_last)


class LocalCounter:
    """A chunk counter for a single process (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._next = 0

    def reset(self) -> None:
        """Start again from chunk 0."""
        with self._lock:
            self._next = 0

    def fetch_add(self) -> int:
        """Return the next chunk number."""
        with self._lock:
            value = self._next
            self._next += 1
            return value

    def read(self) -> int:
        """The next chunk number, without taking it."""
        with self._lock:
            return self._next

    def set(self, value: int) -> None:
        """Continue from ``value``."""
        with self._lock:
            self._next = int(value)

    def free(self) -> None:
        """Nothing to free."""


class WindowCounter:
    """An atomic chunk counter in an MPI one-sided window on rank 0.

    ``fetch_add`` is ``MPI_Fetch_and_op(SUM)`` inside a passive-target
    ``Lock``/``Unlock`` epoch on rank 0's window. Where every worker shares
    rank 0's node (Open MPI's shared-memory window) it completes without
    rank 0, so a worker never waits for a busy peer and no rank serves
    requests; across nodes without RDMA atomics each step waits until rank 0
    next enters MPI, which is why ``hybridagg train`` then serves the
    counter from parameter server 0 instead (:mod:`hybridagg.train.chunks`).
    The counter is not reset between epochs
    (value ``c`` is window ``c mod W`` of epoch ``c div W``, see
    :mod:`hybridagg.data.position`), so no worker waits for another at an
    epoch boundary. :meth:`set` is collective.

    Args:
        comm: A :class:`hybridagg.comm.Comm` over the workers (creating the
            window is collective over it).
    """

    def __init__(self, comm) -> None:
        from mpi4py import MPI

        self._mpi = MPI
        self.comm = comm
        itemsize = MPI.INT64_T.Get_size()
        size = itemsize if comm.rank == 0 else 0
        # creating and freeing a window block until every worker joins: a
        # polled barrier first makes the blocking call itself short
        comm.barrier(what="chunk counter window creation")
        self.win = MPI.Win.Allocate(size, itemsize, comm=comm.mpi)
        self._one = np.ones(1, dtype=np.int64)
        self._zero = np.zeros(1, dtype=np.int64)
        self._out = np.zeros(1, dtype=np.int64)
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        """Set the counter to 0 (collective)."""
        self.set(0)

    def set(self, value: int) -> None:
        """Set the counter to ``value`` once every worker gets here (collective)."""
        MPI = self._mpi
        self.comm.barrier(what="chunk counter set (nobody is taking chunks)")
        if self.comm.rank == 0:
            with self._lock:
                self._zero[0] = int(value)
                self.win.Lock(0, MPI.LOCK_EXCLUSIVE)
                self.win.Put([self._zero, 1, MPI.INT64_T], 0, 0)
                self.win.Unlock(0)
        self.comm.barrier(what="chunk counter set")

    def read(self) -> int:
        """The next chunk number, without taking it (no other worker takes part)."""
        MPI = self._mpi
        with self._lock:
            self.win.Lock(0, MPI.LOCK_SHARED)
            self.win.Fetch_and_op(
                [self._one, 1, MPI.INT64_T],
                [self._out, 1, MPI.INT64_T],
                0,
                0,
                MPI.NO_OP,
            )
            self.win.Unlock(0)
            return int(self._out[0])

    def fetch_add(self) -> int:
        """Atomically take the next chunk number."""
        MPI = self._mpi
        with self._lock:
            self.win.Lock(0, MPI.LOCK_SHARED)
            self.win.Fetch_and_op(
                [self._one, 1, MPI.INT64_T], [self._out, 1, MPI.INT64_T], 0, 0, MPI.SUM
            )
            self.win.Unlock(0)
            return int(self._out[0])

    def free(self) -> None:
        """Free the window (collective)."""
        if self.win is not None:
            self.comm.barrier(what="chunk counter window release")
            self.win.Free()
            self.win = None
