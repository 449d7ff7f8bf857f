"""A weighted-mean ring all-reduce that also sums a small header."""

from __future__ import annotations

import numpy as np
import torch

from ..comm import Comm, ScratchPool, as_buffer
from .partition import ring_neighbours
from .ring import Segments, gather_blocking

__all__ = ["mean_allreduce"]

_MEAN_TAG = 904


def mean_allreduce(
    comm: Comm,
    buf: torch.Tensor,
    header: np.ndarray,
    scratch: ScratchPool,
    *,
    what: str = "mean all-reduce",
    timeout: float | None = None,
) -> np.ndarray:
    """Replace every rank's ``buf`` by the weighted mean; sum the headers.

    Every rank contributes its values ``buf_i`` with the weight
    ``header_i[0]`` (a sample count, at least 0); afterwards every rank holds
    ``sum_i header_i[0] * buf_i / sum_i header_i[0]`` in ``buf``, bitwise the
    same everywhere, and gets back ``sum_i header_i``.

    The last gradient bucket of a step is reduced this way together with the
    step's header (sample counts, flags), in one ring instead of a small
    all-reduce followed by the gradient's. The header travels with every
    reduce-scatter message: the header a rank receives sums exactly the ranks
    whose values the received segment holds, so its first entry is that
    segment's weight, and merging it is one ``lerp_`` (a running weighted
    mean; no division pass). The reduce-scatter is polled, since a peer may
    still be in backward; once it is over every rank has provably arrived
    (each rank's header reached every other), so the all-gather uses blocking
    calls.

    Args:
        comm: The communicator; every rank calls with the same sizes.
        buf: A contiguous CPU floating-point tensor, reduced in place. A
            rank whose weight is 0 must hold zeros. If every weight is 0,
            ``buf`` keeps those zeros.
        header: A 1-D float64 array whose first entry is the rank's weight.
            The sum of the weights is computed in rank order, and sums of
            integers (counts, flags) or of entries that only one rank sets
            are exact: all of these are the same on every rank. Other sums
            may differ in the last bit between ranks (their order differs).
        scratch: Where the receive buffer comes from.
        what: Names the operation in a timeout.
        timeout: Seconds a stage may wait for a neighbour (default: the
            communicator's).

    Returns:
        The element-wise sum of every rank's header (a new array).

    Raises:
        CommTimeoutError: A neighbour did not arrive within ``timeout``.
    """
    n, r = comm.size, comm.rank
    m = len(header)
    if n == 1:
        return np.array(header, dtype=np.float64)
    # each rank's weight also gets a slot of its own, so that every rank can
    # add the weights up in the same order
    header = np.concatenate([np.asarray(header, dtype=np.float64), np.zeros(n)])
    header[m + r] = header[0]
    total = header
    seg = Segments(buf.view(-1), n)
    tmp = scratch.take(seg.longest, buf.dtype)
    left, right = ring_neighbours(r, n)
    got = np.empty_like(total)
    own = float(total[0])
    mpi = comm.mpi
    # (the scratch goes back to the pool only on success: after a timeout a
    # receive into it may still be posted)
    for k in range(n - 1):  # reduce-scatter, polled
        mine = seg(r - k - 1)
        into = tmp[: mine.numel()]
        reqs = [
            mpi.Irecv(got, left, _MEAN_TAG),
            mpi.Irecv(as_buffer(into), left, _MEAN_TAG + 1),
            mpi.Isend(total, right, _MEAN_TAG),
            mpi.Isend(as_buffer(seg(r - k)), right, _MEAN_TAG + 1),
        ]
        comm.wait(reqs, what=f"{what}, stage {k} from rank {left}", timeout=timeout)
        # ``mine`` still holds this rank's own values (weight ``own``);
        # ``into`` the mean of the ranks counted in ``got[0]``
        weight = float(got[0])
        if weight + own > 0:
            mine.lerp_(into, weight / (weight + own))
        total = got + header  # also what the next stage sends
    gather_blocking(comm, seg, _MEAN_TAG + 2)
    scratch.give(tmp)
    out = total[:m].copy()
    out[0] = total[m:].sum()
    return out
