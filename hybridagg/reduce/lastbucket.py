"""How the last gradient bucket of a step is reduced: a pure choice, six strategies.

The last bucket is complete only when backward ends, so nothing is left to
overlap its reduction with, and the step's control vector must travel too.
Which of these is fastest depends on facts that are the same on every rank
of the group (its size, dtype and device, the transport, whether the
reduction is flat, whether the group shares a node), so
:func:`choose_last_bucket` decides it as pure logic, and each strategy is a
small class behind one interface (:class:`LastBucket`):

========== ================================================================
EAGER      posted during backward like every other bucket; the control
           vector in its own ``MPI_Iallreduce``
FUSED      a small bucket rides inside the control ``MPI_Iallreduce``: one
           round of latency instead of two
STAGED     a small bucket and the control vector are copied into MPI shared
           memory and every rank reduces all of it after one flag wait
SETTLED    a large bucket is posted once the control all-reduce shows every
           rank has arrived, by blocking calls that cannot spin on a late peer
MEAN_RING  a mid-size bucket and the control vector in one weighted-mean
           ring (the control vector weighs the raw gradients: no pass to
           multiply or divide)
SHARED_MEAN the same weighted mean in MPI shared memory, with loads and
           stores
========== ================================================================
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING

import numpy as np
import torch

from ..collectives import (
    CollectiveSettings,
    SharedBucket,
    SharedStaging,
    shared_memory_usable,
)
from ..comm import alloc, wait_until
from .transports import MPITransport, Transport

if TYPE_CHECKING:
    from .reducer import GradientReducer

__all__ = [
    "FUSE_MAX_BYTES",
    "LastBucket",
    "LastBucketFacts",
    "LastBucketKind",
    "choose_last_bucket",
    "make_last_bucket",
    "shared_memory_vote_bytes",
]

FUSE_MAX_BYTES = 128 * 2**10
"""The largest last bucket that rides in the control all-reduce (or is staged)."""


class LastBucketKind(Enum):
    """The strategies; see the module's table."""

    EAGER = "eager"
    FUSED = "fused"
    STAGED = "staged"
    SETTLED = "settled"
    MEAN_RING = "mean-ring"
    SHARED_MEAN = "shared-mean"


@dataclass(frozen=True)
class LastBucketFacts:
    """What the choice depends on; the same on every rank of the group."""

    nbytes: int
    """The last bucket's size."""
    floating: bool
    """Its dtype is float32 or float64."""
    on_cpu: bool
    """It lives in host memory."""
    mpi: bool
    """The group's transport is MPI."""
    flat: bool
    """The reduction is one flat all-reduce over a group of more than one rank
    (not hierarchical, not a group of one)."""
    same_ranks: bool
    """The control vector's communicator spans exactly the group's ranks."""
    compact: bool = False
    """Gradients travel in bf16 or fp16 (``wire``): every strategy that sums
    the bucket elsewhere than in the transport (in the control vector, in
    shared memory, in the weighted-mean ring) would bypass the wire format
    and its error feedback, so the bucket is reduced like every other."""


def choose_last_bucket(
    facts: LastBucketFacts, settings: CollectiveSettings, *, shared_memory: bool
) -> LastBucketKind:
    """The strategy for the last bucket (pure logic).

    Args:
        facts: The bucket and its group.
        settings: The size thresholds.
        shared_memory: The group may reduce in MPI shared memory (the
            collective vote of :func:`shared_memory_usable`, for the bytes
            :func:`shared_memory_vote_bytes` names).
    """
    if facts.compact:
        return LastBucketKind.EAGER
    deferred = (
        facts.flat and facts.mpi and facts.on_cpu
        and facts.nbytes >= settings.ring_min_bytes
    )  # fmt: skip
    if deferred:
        if facts.same_ranks and facts.nbytes < settings.settled_max_bytes:
            return (
                LastBucketKind.SHARED_MEAN
                if shared_memory
                else LastBucketKind.MEAN_RING
            )
        return LastBucketKind.SETTLED
    small = (
        facts.flat and facts.mpi and facts.on_cpu and facts.same_ranks
        and facts.floating and facts.nbytes <= FUSE_MAX_BYTES
    )  # fmt: skip
    if small:
        return LastBucketKind.STAGED if shared_memory else LastBucketKind.FUSED
    return LastBucketKind.EAGER


def shared_memory_vote_bytes(
    kind: LastBucketKind, nbytes: int, header_len: int
) -> int | None:
    """Bytes per rank a shared-memory variant of ``kind`` needs (``None``: there is none).

    ``kind`` is the choice made without shared memory: a weighted-mean ring
    has a shared-memory twin that holds the bucket, the fused path one that
    holds two copies of the bucket and the control vector.
    """
    if kind is LastBucketKind.MEAN_RING:
        return nbytes
    if kind is LastBucketKind.FUSED:
        return 2 * (nbytes + 8 * header_len)
    return None


class LastBucket:
    """One strategy for the last bucket (see :func:`choose_last_bucket`).

    The reducer consults it at three points: whether the bucket may be
    posted from the hooks (:meth:`may_post`) and how (:meth:`post`), how the
    step's control vector and the bucket are completed in ``synchronize()``
    (:meth:`reduce`), and what it releases (:meth:`close`).
    """

    kind: LastBucketKind
    raw = False
    """Gradients enter the bucket unweighted: the reduction itself weighs them
    by the counts in the control vector (no multiplication, no division)."""
    payload = 0
    """Elements of the bucket that ride in the control vector."""

    def memory(self) -> torch.Tensor | None:
        """Memory the bucket must live in (``None``: the reducer's own)."""
        return None

    def may_post(self, settling: bool) -> bool:
        """Whether :meth:`GradientReducer.progress` may post it now."""
        return True

    def post(
        self, r: GradientReducer, stage: str, transport: Transport
    ) -> Callable[[], bool]:
        """Post the bucket's first stage, as the reducer posts any bucket's."""
        return r.start_stage(stage, transport, r.buckets[-1])

    def reduce(
        self, r: GradientReducer, ctrl: np.ndarray, what: str, activity
    ) -> np.ndarray:
        """Finish every bucket and the control vector; return the summed vector."""
        req = r.control.Iallreduce(ctrl)

        def done() -> bool:
            control_done = req.Test()
            if control_done:
                self.control_arrived(r)
            return r.progress() and control_done

        wait_until(done, what=what, timeout=r.control.timeout, activity=activity)
        return ctrl

    def control_arrived(self, r: GradientReducer) -> None:
        """Every rank has posted its control vector (is in ``synchronize()``)."""

    def unpack(self, r: GradientReducer, total: np.ndarray) -> None:
        """Take what rode in the summed control vector back into the bucket."""

    def close(self, r: GradientReducer) -> None:
        """Release what the strategy holds (collective over the group)."""


class Eager(LastBucket):
    kind = LastBucketKind.EAGER


class Fused(LastBucket):
    kind = LastBucketKind.FUSED

    def __init__(self, numel: int) -> None:
        self.payload = numel

    def may_post(self, settling: bool) -> bool:
        return False

    def control_arrived(self, r: GradientReducer) -> None:
        r.buckets[-1].stage_done = len(r.stages)

    def unpack(self, r: GradientReducer, total: np.ndarray) -> None:
        r.buckets[-1].flat.copy_(torch.from_numpy(total[r.layout.payload]))


class Settled(LastBucket):
    kind = LastBucketKind.SETTLED

    def may_post(self, settling: bool) -> bool:
        return settling

    def post(
        self, r: GradientReducer, stage: str, transport: Transport
    ) -> Callable[[], bool]:
        # (flat reductions only: the one stage is the group's all-reduce)
        return transport.start_allreduce(r.buckets[-1].flat, settled=True)

    def control_arrived(self, r: GradientReducer) -> None:
        if not r.settling:
            r.settling = True
            r.progress()


class _WithControl(LastBucket):
    """The bucket's own reduction carries the control vector as its header."""

    raw = True

    def may_post(self, settling: bool) -> bool:
        return False

    def reduce(
        self, r: GradientReducer, ctrl: np.ndarray, what: str, activity
    ) -> np.ndarray:
        head = r.buckets[:-1]

        def earlier_done() -> bool:
            # (posted during backward: normally no wait at all)
            r.progress()
            return all(r.bucket_done(b) for b in head)

        timeout = r.control.timeout
        wait_until(earlier_done, what=what, timeout=timeout, activity=activity)
        total = self.reduce_with(r, ctrl, what, timeout)
        r.buckets[-1].stage_done = len(r.stages)
        return total

    def reduce_with(self, r, ctrl, what, timeout) -> np.ndarray:
        raise NotImplementedError


class MeanRing(_WithControl):
    kind = LastBucketKind.MEAN_RING

    def __init__(self, transport: MPITransport) -> None:
        self.collectives = transport.collectives

    def reduce_with(self, r, ctrl, what, timeout):
        last = r.buckets[-1].flat
        return self.collectives.mean_allreduce(last, ctrl, what=what, timeout=timeout)


class SharedMean(_WithControl):
    """The bucket itself lives in the shared window (:class:`~hybridagg.collectives.SharedBucket`)."""

    kind = LastBucketKind.SHARED_MEAN

    def __init__(self, transport: MPITransport, flat: torch.Tensor) -> None:
        self.shared = SharedBucket(transport.comm, flat.numel(), flat.dtype)

    def memory(self) -> torch.Tensor | None:
        return self.shared.flat

    def reduce_with(self, r, ctrl, what, timeout):
        return self.shared.reduce(ctrl, what=what, timeout=timeout)

    def close(self, r: GradientReducer) -> None:
        # Gradients that were views into the window become copies in private
        # memory before the window goes.
        last = r.buckets[-1]
        last.flat = alloc(last.flat.numel(), last.flat.dtype, zero=False)
        last.flat.copy_(self.shared.flat)
        r.rebind_views(last)
        self.shared.free(r.control.timeout)


class Staged(_WithControl):
    """Copies of the bucket and the control vector in a shared window (:class:`SharedStaging`)."""

    kind = LastBucketKind.STAGED

    def __init__(
        self, transport: MPITransport, flat: torch.Tensor, header_len: int
    ) -> None:
        self.staging = SharedStaging(transport.comm, flat, header_len)

    def reduce_with(self, r, ctrl, what, timeout):
        return self.staging.reduce(ctrl, what=what, timeout=timeout)

    def close(self, r: GradientReducer) -> None:
        self.staging.free(r.control.timeout)


def make_last_bucket(
    facts: LastBucketFacts,
    settings: CollectiveSettings,
    transport: Transport,
    flat: torch.Tensor,
    header_len: int,
) -> LastBucket:
    """Choose the strategy (collective over the group when shared memory may
    serve) and build it.

    Args:
        facts: The bucket and its group (the same on every rank).
        settings: Thresholds and the shared-memory switch.
        transport: The group's transport.
        flat: The last bucket.
        header_len: Entries of the control vector without payload.
    """
    kind = choose_last_bucket(facts, settings, shared_memory=False)
    vote = shared_memory_vote_bytes(kind, facts.nbytes, header_len)
    if vote is not None:
        assert isinstance(transport, MPITransport)
        usable = shared_memory_usable(transport.comm, vote, settings.shared_memory)
        kind = choose_last_bucket(facts, settings, shared_memory=usable)
    if kind is LastBucketKind.FUSED:
        return Fused(flat.numel())
    if kind is LastBucketKind.STAGED:
        return Staged(transport, flat, header_len)
    if kind is LastBucketKind.SETTLED:
        return Settled()
    if kind is LastBucketKind.MEAN_RING:
        return MeanRing(transport)
    if kind is LastBucketKind.SHARED_MEAN:
        return SharedMean(transport, flat)
    return Eager()
