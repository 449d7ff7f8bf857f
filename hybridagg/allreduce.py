"""Bucketed, overlapped, sample-weighted gradient all-reduce inside groups.

:class:`GradientReducer` packs gradients into fused buckets (default 25 MiB,
like DDP) in a fixed order, identical on every rank: parameters in reverse
registration order, since backward produces the last layers' gradients
first. A bucket's reduction is posted as soon as all its gradients are
accumulated (``Tensor.register_post_accumulate_grad_hook``), strictly in
bucket order so every rank posts the same sequence of collectives; a
parameter that gets no gradient in a step still takes part, with zeros, when
the step synchronizes.

Progress: a posted non-blocking collective in Open MPI does not advance
while the rank makes no MPI calls, so every gradient hook tests all requests
in flight, and the final wait polls (:func:`hybridagg.comm.poll`). Buckets
of at least ``HYBRIDAGG_RING_MIN_BYTES`` (1 MiB) are reduced by hybridagg's
pipelined ring of point-to-point messages (:mod:`hybridagg.ring`), which ran
2x faster than ``MPI_Iallreduce`` on large buffers here; the wait keeps
testing at full speed while the ring's stages complete. The last bucket is
complete only when backward ends, so there is nothing left to overlap it
with: in flat mode it is reduced in ``synchronize()``, below
``HYBRIDAGG_SETTLED_MAX_BYTES`` together with the control vector (see
below), otherwise once the control all-reduce has shown every rank is
there, as a settled all-reduce (:meth:`hybridagg.comm.Comm.start_allreduce`;
it cannot spin on a late peer).

Weighting: each rank's gradient enters multiplied by its sample count, and
the sum is divided by the total, so ranks with different batch sizes give
exactly the gradient of the union batch. The counts travel in a small
control all-reduce that also carries misuse flags and which parameters got
a gradient anywhere, so a misuse on one rank is reported on every rank. A
small last bucket (at most 128 KiB, the only one of a small model) travels
inside that control all-reduce instead of a collective of its own, or, when
the group shares a node, is staged with the control vector in shared memory
where every rank reduces all of it (:class:`hybridagg.shm.SharedStaging`:
one flag wait, no message). A
deferred last bucket below ``HYBRIDAGG_SETTLED_MAX_BYTES`` works the other
way round: it keeps raw gradients and the control vector becomes part of
its reduction, which merges them as a mean weighted by the counts it
carries. When the group shares a node the bucket lives in MPI shared memory
and is reduced there with loads and stores (:class:`hybridagg.shm.SharedBucket`);
otherwise the control vector travels inside the bucket's ring
(:func:`hybridagg.ring.mean_allreduce`). Either way: one polled round less
per step, and no multiplication or division pass over the bucket, which at
16 MiB cost as much as the transfer's gap to a bare ``MPI_Allreduce``.

Stages: with one group the reduction is a flat all-reduce. Hierarchical
(``cross`` given): reduce to the group leader, all-reduce across leaders,
broadcast inside the group. Each stage has its own communicator, so a bucket
can be in one stage while the next bucket is in another.

Transports: ``"mpi"`` (default; CPU tensors straight to MPI, no copy),
``"torch"`` (a ``torch.distributed`` subgroup: NCCL on CUDA, gloo on CPU),
``"horovod"`` (Horovod process sets) for the group stages; the cross-leader
stage is MPI on CPU tensors and ``torch.distributed`` on CUDA tensors.
"""

from __future__ import annotations

import sys
import time
import types
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import numpy as np
import torch
from mpi4py import MPI

from .comm import Comm, alloc, poll, ring_min_bytes, settled_max_bytes
from .ring import mean_allreduce
from .shm import SharedBucket, SharedStaging, shared_memory_usable

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "SHARE_SLOTS",
    "GradientReducer",
    "MisuseError",
    "make_transport",
]

DEFAULT_BUCKET_BYTES = 25 * 1024 * 1024
# values each rank may share with the others of its reduction at every step
SHARE_SLOTS = 4

# Misuse codes carried in the control all-reduce.
_NO_BACKWARD = 1
_ZERO_GRAD = 2
_TWICE = 3
_MISUSE_TEXT = {
    _NO_BACKWARD: "step() was called without backward() (a rank with no samples "
    "may skip backward only after set_samples(0))",
    _ZERO_GRAD: "zero_grad() was called between backward() and step()",
    _TWICE: "backward() ran twice before step(); use `with optimizer.no_sync():` "
    "for gradient accumulation",
}


# the largest last bucket that travels inside the control all-reduce
_FUSE_MAX_BYTES = 128 * 2**10


class MisuseError(ValueError):
    """The optimizer was used out of order on some rank."""


# ----------------------------------------------------------------- transports
class _Transport:
    """Non-blocking collectives over one group; each returns a test() callable."""

    size: int
    rank: int
    name: str
    events = 0  # grows as multi-stage operations advance (see comm.poll)

    def iallreduce(self, buf: torch.Tensor) -> Callable[[], bool]:
        raise NotImplementedError

    def ireduce(self, buf: torch.Tensor, root: int) -> Callable[[], bool]:
        return self.iallreduce(buf)

    def ibcast(self, buf: torch.Tensor, root: int) -> Callable[[], bool]:
        raise NotImplementedError


class _MPITransport(_Transport):
    def __init__(self, comm: Comm) -> None:
        self.comm, self.size, self.rank, self.name = (
            comm,
            comm.size,
            comm.rank,
            comm.name,
        )

    @property
    def events(self) -> int:
        return self.comm.events

    def iallreduce(self, buf, settled: bool = False):
        return self.comm.start_allreduce(buf, settled=settled)

    def ireduce(self, buf, root):
        from .comm import as_buffer

        if self.rank == root:
            req = self.comm.mpi.Ireduce(MPI.IN_PLACE, as_buffer(buf), MPI.SUM, root)
        else:
            req = self.comm.mpi.Ireduce(as_buffer(buf), None, MPI.SUM, root)
        return req.Test

    def ibcast(self, buf, root):
        return self.comm.ibcast(buf, root).Test


class _TorchTransport(_Transport):
    def __init__(self, group, ranks: list[int], rank: int, name: str) -> None:
        self.group, self.ranks = group, ranks
        self.size, self.rank, self.name = len(ranks), ranks.index(rank), name

    def iallreduce(self, buf):
        import torch.distributed as dist

        return dist.all_reduce(buf, group=self.group, async_op=True).is_completed

    def ireduce(self, buf, root):
        import torch.distributed as dist

        work = dist.reduce(buf, dst=self.ranks[root], group=self.group, async_op=True)
        return work.is_completed

    def ibcast(self, buf, root):
        import torch.distributed as dist

        work = dist.broadcast(
            buf, src=self.ranks[root], group=self.group, async_op=True
        )
        return work.is_completed


class _HorovodTransport(_Transport):
    def __init__(self, process_set, ranks: list[int], rank: int, name: str) -> None:
        self.process_set, self.ranks = process_set, ranks
        self.size, self.rank, self.name = len(ranks), ranks.index(rank), name
        self._count = 0

    def _handle(self, handle):
        import horovod.torch as hvd

        def test() -> bool:
            if hvd.poll(handle):
                hvd.synchronize(handle)
                return True
            return False

        return test

    def iallreduce(self, buf):
        import horovod.torch as hvd

        self._count += 1
        return self._handle(
            hvd.allreduce_async_(
                buf,
                op=hvd.Sum,
                process_set=self.process_set,
                name=f"hagg.{self._count}",
            )
        )

    def ibcast(self, buf, root):
        import horovod.torch as hvd

        self._count += 1
        return self._handle(
            hvd.broadcast_async_(
                buf,
                self.ranks[root],
                process_set=self.process_set,
                name=f"hagg.{self._count}",
            )
        )


def make_transport(
    backend: str, comm: Comm, ranks: list[int], world_rank: int, handle=None
):
    """Build the transport of one group.

    Args:
        backend: ``"mpi"``, ``"torch"`` or ``"horovod"``.
        comm: The group's MPI communicator (always needed: it names the group).
        ranks: The group's ranks in the numbering of ``handle``'s backend.
        world_rank: This rank in that numbering.
        handle: The ``torch.distributed`` process group or Horovod process set.
    """
    if backend == "mpi":
        return _MPITransport(comm)
    if backend == "torch":
        return _TorchTransport(handle, ranks, world_rank, comm.name)
    if backend == "horovod":
        return _HorovodTransport(handle, ranks, world_rank, comm.name)
    raise ValueError(
        f"allreduce_backend must be 'mpi', 'torch' or 'horovod', got {backend!r}"
    )


# -------------------------------------------------------------------- buckets
@dataclass
class _Bucket:
    index: int
    params: list[int]  # indices into the reducer's parameter list
    offsets: list[int]
    flat: torch.Tensor
    ready: list[bool] = field(default_factory=list)
    stage_done: int = 0
    test: Callable[[], bool] | None = None
    posted_at: float | None = None
    completed_at: float | None = None

    @property
    def nbytes(self) -> int:
        return self.flat.numel() * self.flat.element_size()


def _assign_buckets(params: list[torch.Tensor], bucket_bytes: int) -> list[list[int]]:
    """Indices of ``params`` per bucket, reverse order, split by dtype and device."""
    buckets: list[list[int]] = []
    current: list[int] = []
    size = 0
    key = None
    for i in reversed(range(len(params))):
        p = params[i]
        nbytes = p.numel() * p.element_size()
        pkey = (p.dtype, p.device)
        if current and (pkey != key or size + nbytes > bucket_bytes):
            buckets.append(current)
            current, size = [], 0
        current.append(i)
        size += nbytes
        key = pkey
    if current:
        buckets.append(current)
    return buckets


class GradientReducer:
    """Reduce the gradients of a set of parameters across a group, overlapped.

    Args:
        named_parameters: ``(name, parameter)`` pairs, in the model's order.
        transport: The group's transport (see :func:`make_transport`).
        control: A communicator over every rank whose gradients are summed
            (the group, or all workers when ``cross`` is given); carries
            sample counts and misuse flags (except when the last bucket's
            reduction carries them, on the group's own communicator). Use
            one hybridagg created for this reducer alone.
        cross: Transport across group leaders, on leaders in hierarchical
            mode (``None`` on the other ranks and in flat mode).
        hierarchical: Reduce to the leader, all-reduce across leaders,
            broadcast in the group; else one flat all-reduce in the group.
        bcast: Hierarchical only: a second transport over the same group on
            its own communicator, for the broadcast stage (the reduce and
            broadcast stages of different buckets interleave differently on
            leaders and members, and collectives on one communicator must be
            posted in the same order everywhere).
        bucket_bytes: Bucket size.
    """

    def __init__(
        self,
        named_parameters: Iterable[tuple[str, torch.nn.Parameter]],
        transport: _Transport,
        control: Comm,
        *,
        cross: _Transport | None = None,
        bcast: _Transport | None = None,
        hierarchical: bool = False,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    ) -> None:
        if hierarchical and transport.size > 1 and bcast is None:
            raise ValueError("a hierarchical reducer needs a separate bcast transport")
        if bucket_bytes < 1:
            raise ValueError(f"bucket size must be positive, got {bucket_bytes} bytes")
        named = [(n, p) for n, p in named_parameters if p.requires_grad]
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.transport, self.cross, self.control = transport, cross, control
        self.bcast, self.hierarchical = bcast, hierarchical
        self.is_root = transport.rank == 0
        self.stages = self._stages()
        self.buckets: list[_Bucket] = []
        self._where: dict[int, tuple[int, int]] = {}
        for b, members in enumerate(_assign_buckets(self.params, bucket_bytes)):
            offsets, total = [], 0
            for i in members:
                offsets.append(total)
                total += self.params[i].numel()
                self._where[i] = (b, len(offsets) - 1)
            p0 = self.params[members[0]]
            if p0.device.type == "cpu":
                flat = alloc(total, p0.dtype)
            else:
                flat = torch.zeros(total, dtype=p0.dtype, device=p0.device)
            self.buckets.append(
                _Bucket(b, members, offsets, flat, ready=[False] * len(members))
            )
        self._next = [0] * len(self.stages)
        # The last bucket is complete only when backward ends, so nothing is
        # left to overlap: a flat MPI reduction reduces it in synchronize(),
        # together with the control vector or, above the settled size, once
        # the control all-reduce shows every rank is there, as a "settled"
        # all-reduce (see Comm.start_allreduce).
        # (flat only: every rank of the transport must decide alike; small
        # buckets are posted at once, as the wait for the control all-reduce
        # would add a round of latency to them)
        self._defer_last = (
            not hierarchical
            and bool(self.stages)
            and self.buckets[-1].nbytes >= ring_min_bytes()
            and isinstance(transport, _MPITransport)
            and self.buckets[-1].flat.device.type == "cpu"
        )
        # ...and below the settled size it is reduced by mean_allreduce, which
        # also all-reduces the control vector and weights each rank's raw
        # gradients by the sample count in it (no division pass). (only when
        # the control communicator spans the group's ranks, as in every flat
        # reducer: the control vector is laid out by control rank)
        self._mean_last = (
            self._defer_last
            and self.buckets[-1].nbytes < settled_max_bytes()
            and transport.size == control.size
        )
        self._raw = set(self.buckets[-1].params) if self._mean_last else set()
        # A small last bucket (the only one of a small model) rides along in
        # synchronize()'s control all-reduce instead of a collective of its
        # own: one round of latency per step instead of two (measured: the
        # polled rounds dominate a small model's step on a loaded node).
        # The control communicator spans the same ranks (flat reducers).
        last = self.buckets[-1]
        self._fuse_last = (
            bool(self.stages)
            and not self._defer_last
            and not hierarchical
            and isinstance(transport, _MPITransport)
            and transport.size == control.size
            and last.nbytes <= _FUSE_MAX_BYTES
            and last.flat.dtype in (torch.float32, torch.float64)
            and last.flat.device.type == "cpu"
        )
        # the control vector's length: [samples, misuse per rank, got-grad
        # per parameter, shared values per rank] (synchronize() fills it)
        self._header_len = 1 + control.size * (1 + SHARE_SLOTS) + len(self.params)
        # A deferred last bucket reduced with the control vector (_mean_last)
        # lives in shared memory when the group shares a node, and is reduced
        # there (hybridagg.shm), without MPI messages
        self._shared: SharedBucket | SharedStaging | None = None
        # (collective over the group, and the same answer on every rank)
        if self._mean_last and shared_memory_usable(transport.comm, last.nbytes):
            self._shared = SharedBucket(
                transport.comm, last.flat.numel(), last.flat.dtype
            )
            last.flat = self._shared.flat
        # ...and a small one that would ride in the control all-reduce is
        # instead staged in shared memory with the control vector, where every
        # rank reduces all of it itself: one synchronisation, no message
        if self._fuse_last and shared_memory_usable(
            transport.comm, 2 * (last.nbytes + 8 * self._header_len)
        ):
            self._fuse_last = False
            self._defer_last = self._mean_last = True
            self._raw = set(last.params)
            self._shared = SharedStaging(transport.comm, last.flat, self._header_len)
        self._views = []
        for i, p in enumerate(self.params):
            b, slot = self._where[i]
            off = self.buckets[b].offsets[slot]
            self._views.append(self.buckets[b].flat[off : off + p.numel()].view_as(p))
        self._settling = False
        self._hooks = [
            p.register_post_accumulate_grad_hook(self._make_hook(i))
            for i, p in enumerate(self.params)
        ]
        self.samples = 1.0
        self.enabled = True
        self._misuse = 0
        self._got_grad = [False] * len(self.params)
        self._fired = False
        self.last_total_samples = 0.0
        self.last_comm_seconds = 0.0
        # per-rank values that ride along with the control all-reduce
        self.share_out = torch.zeros(SHARE_SLOTS, dtype=torch.float64)
        self.shared = torch.zeros(control.size, SHARE_SLOTS, dtype=torch.float64)

    def _stages(self) -> list[tuple[str, _Transport]]:
        group, cross = self.transport, self.cross
        if not self.hierarchical:
            return [("allreduce", group)] if group.size > 1 else []
        stages = []
        if group.size > 1:
            stages.append(("reduce", group))
        if self.is_root and cross is not None and cross.size > 1:
            stages.append(("allreduce", cross))
        if group.size > 1:
            stages.append(("bcast", self.bcast))
        return stages

    # --- hooks -------------------------------------------------------------
    def _make_hook(self, i: int):
        def hook(param: torch.Tensor) -> None:
            if not self.enabled:
                return
            self._fired = True
            b, slot = self._where[i]
            bucket = self.buckets[b]
            # (a bucket held back for synchronize() is never in flight during
            # backward: a second gradient of the same parameter shows it)
            if bucket.stage_done > 0 or bucket.test is not None or self._got_grad[i]:
                self._misuse = self._misuse or _TWICE
                return
            self._copy_in(i, param.grad)
            bucket.ready[slot] = True
            self._got_grad[i] = True
            self.progress()

        return hook

    def _copy_in(self, i: int, grad: torch.Tensor | None) -> None:
        view = self._views[i]
        if grad is None or self.samples == 0:
            view.zero_()  # a rank without samples adds nothing (not even NaN)
            return
        if grad.data_ptr() != view.data_ptr():  # not accumulated in the bucket
            view.copy_(grad)
        if self.samples != 1.0 and i not in self._raw:
            view.mul_(self.samples)

    def point_grads_at_buckets(self) -> None:
        """Zero the buckets and make each ``.grad`` a view into its bucket.

        Backward then accumulates straight into the memory that is reduced,
        with no copy (like DDP's ``gradient_as_bucket_view``).
        """
        for bucket in self.buckets:
            bucket.flat.zero_()
        for p, view in zip(self.params, self._views, strict=True):
            p.grad = view

    # --- progress ------------------------------------------------------------
    def _start(self, stage: str, transport: _Transport, bucket: _Bucket):
        if stage == "allreduce":
            return transport.iallreduce(bucket.flat)
        if stage == "reduce":
            return transport.ireduce(bucket.flat, 0)
        return transport.ibcast(bucket.flat, 0)

    def progress(self) -> bool:
        """Post every bucket stage that may start, test those in flight.

        Returns:
            Whether every bucket has completed all its stages.
        """
        changed = True
        while changed:
            changed = False
            for s, (stage, transport) in enumerate(self.stages):
                k = self._next[s]
                if k >= len(self.buckets):
                    continue
                bucket = self.buckets[k]
                if bucket.stage_done != s or bucket.test is not None:
                    continue
                if s == 0 and not all(bucket.ready):
                    continue
                if s == 0 and k == len(self.buckets) - 1 and self._fuse_last:
                    continue  # reduced with the control vector
                last = s == 0 and k == len(self.buckets) - 1 and self._defer_last
                if last and not self._settling:
                    continue  # (a mean_allreduce bucket is never settling)
                if last:
                    bucket.test = transport.iallreduce(bucket.flat, settled=True)
                else:
                    bucket.test = self._start(stage, transport, bucket)
                if s == 0:
                    bucket.posted_at = time.perf_counter()
                self._next[s] += 1
                changed = True
            for bucket in self.buckets:
                if bucket.test is not None and bucket.test():
                    bucket.test = None
                    bucket.stage_done += 1
                    if bucket.stage_done == len(self.stages):
                        bucket.completed_at = time.perf_counter()
                    changed = True
        return all(self._bucket_done(b) for b in self.buckets)

    def _bucket_done(self, bucket: _Bucket) -> bool:
        return all(bucket.ready) and bucket.stage_done == len(self.stages)

    # --- the step ---------------------------------------------------------------
    def note_zero_grad(self) -> bool:
        """Record a ``zero_grad()``; returns whether it is a misuse (mid-reduction)."""
        if self._fired:
            self._misuse = self._misuse or _ZERO_GRAD
            return True
        return False

    def synchronize(self) -> float:
        """Finish the reduction and write the weighted average into ``.grad``.

        Collective over the group (and the control communicator). Raises
        :class:`MisuseError` on every rank if any rank misused the optimizer.

        Returns:
            The total sample count of the update (0: nobody had samples).
        """
        start = time.perf_counter()
        if not self._fired and self.samples != 0 and self._misuse == 0:
            self._misuse = _NO_BACKWARD
        for i in range(len(self.params)):
            b, slot = self._where[i]
            if not self.buckets[b].ready[slot]:
                self._copy_in(i, None)
                self.buckets[b].ready[slot] = True
        # control: [samples, misuse per rank..., got-grad per parameter...,
        #           shared values per rank..., the fused bucket, if any]
        size, rank, nparams = self.control.size, self.control.rank, len(self.params)
        per_rank = self._header_len
        # (numpy: a torch element assignment costs microseconds, and this
        # runs on every step)
        fused = self.buckets[-1] if self._fuse_last else None
        ctrl = np.zeros(
            per_rank + (fused.flat.numel() if fused else 0), dtype=np.float64
        )
        if fused is not None:
            ctrl[per_rank:] = fused.flat.numpy()
        ctrl[0] = self.samples
        ctrl[1 + rank] = self._misuse
        ctrl[1 + size : 1 + size + nparams] = self._got_grad
        base = 1 + size + nparams + rank * SHARE_SLOTS
        ctrl[base : base + SHARE_SLOTS] = self.share_out.numpy()
        what = f"gradient all-reduce on {self.transport.name}"
        transports = [t for _, t in self.stages]
        activity = lambda: sum(t.events for t in transports)  # noqa: E731
        if self._mean_last:
            ctrl = self._reduce_last_with(ctrl, what, activity)
        else:
            ctrl_req = self.control.iallreduce(ctrl)

            def done() -> bool:
                if fused is not None and fused.stage_done == 0 and ctrl_req.Test():
                    fused.stage_done = len(self.stages)
                finished = self.progress()
                if self._defer_last and not self._settling and ctrl_req.Test():
                    self._settling = True  # every rank is in synchronize()
                    finished = self.progress()
                return finished and ctrl_req.Test()

            poll(done, what=what, timeout=self.control.timeout, activity=activity)
        self.last_comm_seconds = time.perf_counter() - start
        if fused is not None:
            fused.flat.copy_(torch.from_numpy(ctrl[per_rank:]))
        self._reset()
        bad = {r: int(c) for r, c in enumerate(ctrl[1 : 1 + size].tolist()) if c}
        if bad:
            rank, code = min(bad.items())
            raise MisuseError(
                f"[rank {self.control._world_of(rank)}] {_MISUSE_TEXT[code]}"
            )
        total = float(ctrl[0])
        self.last_total_samples = total
        anywhere = ctrl[1 + size : 1 + size + nparams].tolist()
        self.shared = torch.from_numpy(
            ctrl[1 + size + nparams : per_rank].reshape(size, SHARE_SLOTS).copy()
        )
        if total > 0:
            for bucket in self.buckets[:-1] if self._mean_last else self.buckets:
                bucket.flat.div_(total)
        for i, p in enumerate(self.params):
            # a parameter no rank computed a gradient for keeps none, as locally
            if not anywhere[i]:
                p.grad = None
            elif total > 0:
                p.grad = self._views[i]
            else:
                p.grad = torch.zeros_like(p)
        return total

    def _reduce_last_with(self, ctrl: np.ndarray, what: str, activity) -> np.ndarray:
        """Reduce the last bucket by ``mean_allreduce``, ``ctrl`` as its header.

        The earlier buckets are finished first (they were posted during
        backward, so this is normally no wait at all). Returns the summed
        control vector.
        """
        head, last = self.buckets[:-1], self.buckets[-1]

        def earlier_done() -> bool:
            self.progress()
            return all(self._bucket_done(b) for b in head)

        timeout = self.control.timeout
        poll(earlier_done, what=what, timeout=timeout, activity=activity)
        if self._shared is not None:
            total = self._shared.reduce(ctrl, what=what, timeout=timeout)
        else:
            comm = self.transport.comm
            total = mean_allreduce(comm, last.flat, ctrl, what=what, timeout=timeout)
        last.stage_done = len(self.stages)
        return total

    def _reset(self) -> None:
        for bucket in self.buckets:
            bucket.ready = [False] * len(bucket.params)
            bucket.stage_done = 0
            bucket.test = None
        self._next = [0] * len(self.stages)
        self._settling = False
        self._misuse = 0
        self._got_grad = [False] * len(self.params)
        self._fired = False

    def bucket_sizes(self) -> list[int]:
        """Bytes in each bucket, in posting order."""
        return [b.nbytes for b in self.buckets]

    def remove_hooks(self) -> None:
        """Detach from the parameters."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    def close(self) -> None:
        """Detach from the parameters and release shared memory (collective).

        Every rank of the group must call it. Gradients that were views into
        the shared-memory bucket become copies of their values in private
        memory. Other tensors that alias those gradients (``g = p.grad``
        taken earlier) point into released memory and must not be used.
        """
        self.remove_hooks()
        shared, self._shared = self._shared, None
        if shared is None:
            return
        if isinstance(shared, SharedStaging):  # the bucket is private memory
            shared.free(self.control.timeout)
            return
        last = self.buckets[-1]
        last.flat = alloc(last.flat.numel(), last.flat.dtype, zero=False)
        last.flat.copy_(shared.flat)
        for slot, i in enumerate(last.params):
            p, off = self.params[i], last.offsets[slot]
            view = last.flat[off : off + p.numel()].view_as(p)
            if p.grad is not None and p.grad.data_ptr() == self._views[i].data_ptr():
                p.grad = view
            self._views[i] = view
        shared.free(self.control.timeout)


class _CallableModule(types.ModuleType):
    """Lets ``hybridagg.allreduce(tensor, comm)`` work after this module is imported.

    Importing ``hybridagg.allreduce`` (this module) binds the name
    ``allreduce`` on the package to the module, shadowing the Horovod-style
    function :func:`hybridagg.ops.allreduce`; calling the module calls it.
    """

    def __call__(self, tensor, comm, op: str = "average"):
        from .ops import allreduce

        return allreduce(tensor, comm, op)


sys.modules[__name__].__class__ = _CallableModule
