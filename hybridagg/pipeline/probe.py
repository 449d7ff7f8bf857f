"""The links between neighbouring stages, measured by a ping-pong at start-up.

The partition weighs the seconds a stage spends receiving its neighbours'
activations and gradients (:class:`~.partition.Link`). Where the ranks sit
is known only at launch (the same job may put two stages on one node or
on two), so a pipelined job measures each neighbouring pair once before it
cuts the model: a small message for the latency, a large one for the
bandwidth, the best of a few round trips each (the least disturbed). It is
a mechanism over the group's communicator; every wait is the
communicator's polled wait with its timeout.
"""

from __future__ import annotations

import math
import time

import numpy as np

from ..comm import Comm
from .partition import Link

__all__ = ["PROBE_BYTES", "measure_link", "neighbour_links"]

PROBE_BYTES = 1 << 20
"""Bytes of the bandwidth message: 1 MiB, 8 ms at 1 Gbit/s. A shaper's
token bucket lets its first burst through at once (256 KiB on an emulated
cluster), so a message of that size would overstate the link's rate."""

_TAG = 41  # (apart from the stages' activation, gradient and label tags)


def _round_trip(comm: Comm, peer: int, buf: np.ndarray, first: bool) -> float:
    t0 = time.perf_counter()
    if first:
        comm.wait(comm.Isend(buf, peer, _TAG), "a link probe's send")
        comm.wait(comm.Irecv(buf, peer, _TAG), "a link probe's echo")
    else:
        comm.wait(comm.Irecv(buf, peer, _TAG), "a link probe")
        comm.wait(comm.Isend(buf, peer, _TAG), "a link probe's echo")
    return time.perf_counter() - t0


def measure_link(
    comm: Comm, peer: int, *, nbytes: int = PROBE_BYTES, repeats: int = 5
) -> Link:
    """Latency and bandwidth to ``peer``; ``peer`` must call it with this rank.

    The lower rank sends first. One untimed round trip of each size warms
    the path; then the best of ``repeats`` round trips of 8 bytes gives the
    latency (half of it), and of ``nbytes`` the bandwidth (``nbytes`` over
    the extra one-way time). Both ranks return the same measurement.

    Raises:
        ValueError: ``peer`` is this rank or outside the communicator, or
            ``nbytes``/``repeats`` below 1 (the same on both ranks).
    """
    if not 0 <= peer < comm.size or peer == comm.rank:
        raise ValueError(f"peer must be another rank of {comm.name}, got {peer}")
    if nbytes < 1 or repeats < 1:
        raise ValueError(f"nbytes and repeats must be >= 1, got {nbytes}, {repeats}")
    first = comm.rank < peer
    small, big = np.zeros(8, np.uint8), np.zeros(nbytes, np.uint8)
    best = {}
    for name, buf in (("small", small), ("big", big)):
        _round_trip(comm, peer, buf, first)
        best[name] = min(_round_trip(comm, peer, buf, first) for _ in range(repeats))
    # the lower rank's times decide, so both sides hold the same Link
    if first:
        result = np.array([best["small"], best["big"]])  # (alive until sent)
        comm.wait(comm.Isend(result, peer, _TAG), "a link probe's result")
    else:
        got = np.zeros(2)
        comm.wait(comm.Irecv(got, peer, _TAG), "a link probe's result")
        best = {"small": float(got[0]), "big": float(got[1])}
    latency = best["small"] / 2
    extra = (best["big"] - best["small"]) / 2
    bandwidth = (nbytes - 8) / extra if extra > 0 else math.inf
    return Link(latency_s=latency, bandwidth_Bps=bandwidth)


def neighbour_links(
    group: Comm, *, nbytes: int = PROBE_BYTES, repeats: int = 5
) -> list[Link]:
    """Every link between neighbouring ranks of ``group``, on every rank.

    Collective over ``group``: pairs ``(0, 1), (2, 3), ...`` measure first,
    then ``(1, 2), (3, 4), ...``, so each rank probes one peer at a time.

    Returns:
        ``group.size - 1`` links, entry ``k`` between ranks ``k`` and ``k + 1``.
    """
    k, size = group.rank, group.size
    mine: Link | None = None
    for parity in (0, 1):
        if k % 2 == parity and k + 1 < size:
            mine = measure_link(group, k + 1, nbytes=nbytes, repeats=repeats)
        elif k >= 1 and (k - 1) % 2 == parity:
            measure_link(group, k - 1, nbytes=nbytes, repeats=repeats)
    links = group.allgather(
        None if mine is None else (mine.latency_s, mine.bandwidth_Bps),
        what="the group's links",
    )
    return [Link(lat, bw) for lat, bw in links[:-1]]
