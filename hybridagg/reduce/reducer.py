"""Bucketed, overlapped, sample-weighted gradient reduction inside a group.

:class:`GradientReducer` packs gradients into fused buckets (default 25 MiB,
like DDP) in a fixed order, identical on every rank. A bucket's reduction is
posted as soon as all its gradients are accumulated
(``Tensor.register_post_accumulate_grad_hook``), strictly in bucket order so
every rank posts the same sequence of collectives; a parameter that gets no
gradient in a step still takes part, with zeros, when the step synchronizes.

Progress: a posted non-blocking collective in Open MPI does not advance
while the rank makes no MPI calls, so every gradient hook tests all requests
in flight, and the final wait polls (:func:`hybridagg.comm.wait_until`).

Weighting: each rank's gradient enters multiplied by its sample count, and
the sum is divided by the total, so ranks with different batch sizes give
exactly the gradient of the union batch. The counts travel in the step's
control vector (:mod:`.control`); how the last bucket and the control
vector are reduced is the strategy :mod:`.lastbucket` chooses.

Stages: with one group the reduction is a flat all-reduce. Hierarchical
(``cross`` given): reduce to the group leader, all-reduce across leaders,
broadcast inside the group. Each stage has its own communicator, so a bucket
can be in one stage while the next bucket is in another.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

import numpy as np
import torch
from mpi4py import MPI

from ..collectives import CollectiveSettings
from ..comm import Comm, alloc
from .buckets import DEFAULT_BUCKET_BYTES, Bucket, assign_buckets
from .control import MISUSE_TEXT, SHARE_SLOTS, ControlVector, Misuse, MisuseError
from .lastbucket import LastBucketFacts, make_last_bucket
from .transports import MPITransport, Transport

__all__ = ["GradientReducer"]


class GradientReducer:
    """Reduce the gradients of a set of parameters across a group, overlapped.

    Args:
        named_parameters: ``(name, parameter)`` pairs, in the model's order.
        transport: The group's transport (see :func:`make_transport`).
        control: A communicator over every rank whose gradients are summed
            (the group, or all workers when ``cross`` is given); carries
            the control vector (unless the last bucket's reduction carries
            it). Use one hybridagg created for this reducer alone.
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
        settings: The collectives' thresholds (default: the environment's).
        early_total: Learn the step's total sample count while backward runs
            (a small all-reduce of its own, posted at the step's first
            gradient), so that each bucket is *final*, divided by the total,
            as soon as its reduction completes, and :attr:`on_final` hears
            of it then (a leader pushes it to the parameter servers). The
            last bucket is final in :meth:`synchronize` (in a group of one,
            when backward fills it). Collective: the same on every rank.
        backward_passes: Gradient accumulation: each parameter's gradient
            is reduced after this many backward passes (its hook's count,
            as Horovod's ``backward_passes_per_step``); the passes before
            accumulate locally into ``.grad``. A parameter whose gradient
            accumulated while reduction was held back (here, or under
            :attr:`enabled` ``False``) but that the last pass did not reach
            is reduced with its accumulated gradient in :meth:`synchronize`,
            not with zeros.
        on_cpu: Whether every rank of the reduction keeps its gradients on
            the CPU (``None``: this rank's own buckets tell). The last
            bucket's strategy depends on it, so in a reduction that mixes
            CPU and GPU ranks the caller passes the answer it agreed on
            (:func:`hybridagg.devices.reduction_backend`): every rank must
            choose the same strategy.

    Mixed precision: :attr:`loss_scale` (set before backward) is the factor
    the loss was multiplied by; each gradient is divided by it together
    with its sample weight, so the reduction (and whatever follows it: a
    push to the servers) carries true gradients.

    Attributes:
        on_final: ``f(bucket)`` when a bucket becomes final before
            :meth:`synchronize` (in bucket order), or ``None``.
    """

    def __init__(
        self,
        named_parameters: Iterable[tuple[str, torch.nn.Parameter]],
        transport: Transport,
        control: Comm,
        *,
        cross: Transport | None = None,
        bcast: Transport | None = None,
        hierarchical: bool = False,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        settings: CollectiveSettings | None = None,
        early_total: bool = False,
        backward_passes: int = 1,
        on_cpu: bool | None = None,
    ) -> None:
        if (
            isinstance(backward_passes, bool)
            or not isinstance(backward_passes, int)
            or backward_passes < 1
        ):
            raise ValueError(
                f"backward_passes must be a positive integer, got {backward_passes!r}"
            )
        if hierarchical and transport.size > 1 and bcast is None:
            raise ValueError("a hierarchical reducer needs a separate bcast transport")
        if bucket_bytes < 1:
            raise ValueError(f"bucket size must be positive, got {bucket_bytes} bytes")
        settings = CollectiveSettings.from_env() if settings is None else settings
        named = [(n, p) for n, p in named_parameters if p.requires_grad]
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.transport, self.cross, self.control = transport, cross, control
        self.bcast, self.hierarchical = bcast, hierarchical
        self.is_root = transport.rank == 0
        self.stages = self._stages()
        self.buckets: list[Bucket] = []
        self._where: dict[int, tuple[int, int]] = {}
        for b, members in enumerate(assign_buckets(self.params, bucket_bytes)):
            # a bucket holds a contiguous run of parameters; laid out in model
            # order, its memory is one range of the flat model, which a leader
            # pushes to the parameter servers as it lies
            members = sorted(members)
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
                Bucket(b, members, offsets, flat, ready=[False] * len(members))
            )
        self._next = [0] * len(self.stages)
        last = self.buckets[-1]
        header_len = ControlVector(control.size, len(self.params)).header_len
        facts = LastBucketFacts(
            nbytes=last.nbytes,
            floating=last.flat.dtype in (torch.float32, torch.float64),
            on_cpu=last.flat.device.type == "cpu" if on_cpu is None else on_cpu,
            mpi=isinstance(transport, MPITransport),
            flat=not hierarchical and bool(self.stages),
            same_ranks=transport.size == control.size,
            compact=transport.wire != "fp32",
        )
        # (collective over the group when shared memory may serve; every rank
        # reaches the same choice)
        self.last_bucket = make_last_bucket(
            facts, settings, transport, last.flat, header_len
        )
        memory = self.last_bucket.memory()
        if memory is not None:  # the bucket lives where the strategy says
            last.flat = memory
        self.layout = ControlVector(
            control.size, len(self.params), self.last_bucket.payload
        )
        self._raw = set(last.params) if self.last_bucket.raw else set()
        self._views: list[torch.Tensor] = [None] * len(self.params)  # type: ignore[list-item]
        for bucket in self.buckets:
            self.rebind_views(bucket)
        self.settling = False
        """Every rank is known to be in ``synchronize()`` (strategies read it)."""
        self._hooks = [
            p.register_post_accumulate_grad_hook(self._make_hook(i))
            for i, p in enumerate(self.params)
        ]
        self._closed = False
        self.samples = 1.0
        self.loss_scale = 1.0
        """What the loss was multiplied by before backward (a loss scaler's
        scale): each gradient is divided by it as it enters the reduction."""
        self.enabled = True
        self._misuse = 0
        self._got_grad = [False] * len(self.params)
        self._fired = False
        self.backward_passes = backward_passes
        # per parameter: backward passes seen since the last reduction, and
        # whether .grad holds a local accumulation not yet handed over
        self._passes = [0] * len(self.params)
        self._held = [False] * len(self.params)
        self.last_total_samples = 0.0
        self.last_comm_seconds = 0.0
        self.on_final: Callable[[Bucket], None] | None = None
        self.early_total = early_total
        # the early total: its own communicator, one all-reduce per step
        self._total_comm = (
            control.dup("samples") if early_total and control.size > 1 else None
        )
        self._total_buf = np.zeros(1, dtype=np.float64)
        self._total_req: MPI.Request | None = None
        self.known_total: float | None = None
        """This step's total sample count, once known before :meth:`synchronize`."""
        self._final_next = 0
        # per-rank values that ride along with the control vector
        self.share_out = torch.zeros(SHARE_SLOTS, dtype=torch.float64)
        self.shared = torch.zeros(control.size, SHARE_SLOTS, dtype=torch.float64)

    def _stages(self) -> list[tuple[str, Transport]]:
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

    def rebind_views(self, bucket: Bucket) -> None:
        """Point the parameters' views (and gradients that were views) at ``bucket.flat``."""
        for slot, i in enumerate(bucket.params):
            p, off = self.params[i], bucket.offsets[slot]
            view = bucket.flat[off : off + p.numel()].view_as(p)
            old = self._views[i]
            if (
                old is not None
                and p.grad is not None
                and p.grad.data_ptr() == old.data_ptr()
            ):
                p.grad = view
            self._views[i] = view

    # --- hooks -------------------------------------------------------------
    def _make_hook(self, i: int):
        def hook(param: torch.Tensor) -> None:
            if not self.enabled:
                self._held[i] = True
                return
            if self.backward_passes > 1 and not self._got_grad[i]:
                self._passes[i] += 1
                if self._passes[i] < self.backward_passes:
                    self._held[i] = True
                    return
            self._fired = True
            b, slot = self._where[i]
            bucket = self.buckets[b]
            # (a bucket held back for synchronize() is never in flight during
            # backward: a second gradient of the same parameter shows it)
            if bucket.stage_done > 0 or bucket.test is not None or self._got_grad[i]:
                self._misuse = self._misuse or Misuse.TWICE
                return
            self._copy_in(i, param.grad)
            bucket.ready[slot] = True
            self._got_grad[i] = True
            self._post_total()
            self.progress()

        return hook

    def _copy_in(self, i: int, grad: torch.Tensor | None) -> None:
        view = self._views[i]
        if grad is None or self.samples == 0:
            view.zero_()  # a rank without samples adds nothing (not even NaN)
            return
        if grad.data_ptr() != view.data_ptr():  # not accumulated in the bucket
            view.copy_(grad)
        # the sample weight and the loss scale's inverse in one pass, so
        # every rank contributes its true gradient at no extra cost (a
        # scaler's scale is a power of two: dividing by it is exact)
        factor = 1.0 if i in self._raw else self.samples
        if self.loss_scale != 1.0:
            factor /= self.loss_scale
        if factor != 1.0:
            view.mul_(factor)

    def point_grads_at_buckets(self) -> None:
        """Zero the buckets and make each ``.grad`` a view into its bucket.

        Backward then accumulates straight into the memory that is reduced,
        with no copy (like DDP's ``gradient_as_bucket_view``).
        """
        for bucket in self.buckets:
            bucket.flat.zero_()
        for p, view in zip(self.params, self._views, strict=True):
            p.grad = view

    # --- the early total -----------------------------------------------------
    def _post_total(self) -> None:
        """Post this step's all-reduce of the sample counts (once; ``early_total``)."""
        if not self.early_total or self._total_req is not None:
            return
        if self.known_total is not None:
            return
        if self._total_comm is None:  # a group of one
            self.known_total = float(self.samples)
            return
        self._total_buf[0] = self.samples
        self._total_req = self._total_comm.Iallreduce(self._total_buf)

    def _test_total(self) -> None:
        req = self._total_req
        if req is not None and self.known_total is None and req.Test():
            self.known_total = float(self._total_buf[0])

    def _finalize_ready(self) -> None:
        """Divide every bucket whose reduction completed by the known total, in order."""
        self._test_total()
        total = self.known_total
        last = len(self.buckets) - 1
        while total is not None and self._final_next < len(self.buckets):
            k = self._final_next
            bucket = self.buckets[k]
            # the last bucket's strategy may still rewrite it in synchronize()
            if (k == last and self.stages) or not self.bucket_done(bucket):
                return
            if total > 0:
                bucket.flat.div_(total)
            bucket.final = True
            self._final_next += 1
            if self.on_final is not None:
                self.on_final(bucket)

    # --- progress ------------------------------------------------------------
    def start_stage(self, stage: str, transport: Transport, bucket: Bucket):
        """Post one stage (``allreduce``, ``reduce`` or ``bcast``) of ``bucket``."""
        if stage == "allreduce":
            return transport.start_allreduce(bucket.flat)
        if stage == "reduce":
            return transport.start_reduce(bucket.flat, 0)
        return transport.start_bcast(bucket.flat, 0)

    def progress(self) -> bool:
        """Post every bucket stage that may start, test those in flight.

        Returns:
            Whether every bucket has completed all its stages.
        """
        last = len(self.buckets) - 1
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
                if s == 0 and k == last:
                    if not self.last_bucket.may_post(self.settling):
                        continue
                    bucket.test = self.last_bucket.post(self, stage, transport)
                else:
                    bucket.test = self.start_stage(stage, transport, bucket)
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
        if self.early_total:
            self._finalize_ready()
        return all(self.bucket_done(b) for b in self.buckets)

    def bucket_done(self, bucket: Bucket) -> bool:
        """Whether ``bucket`` holds every gradient and finished every stage."""
        return all(bucket.ready) and bucket.stage_done == len(self.stages)

    # --- the step ---------------------------------------------------------------
    def note_zero_grad(self) -> bool:
        """Record a ``zero_grad()``; returns whether it is a misuse (mid-reduction)."""
        if self._fired:
            self._misuse = self._misuse or Misuse.ZERO_GRAD
            return True
        return False

    def synchronize(self) -> float:
        """Finish the reduction and write the weighted average into ``.grad``.

        Collective over the group (and the control communicator). Raises
        :class:`MisuseError` on every rank if any rank misused the optimizer.

        Returns:
            The total sample count of the update (0: nobody had samples).
        """
        if self._closed:
            raise ValueError(
                "the gradient reducer was closed by finish(); no step may follow"
            )
        start = time.perf_counter()
        held = any(self._held)
        if not self._fired and not held and self.samples != 0 and self._misuse == 0:
            self._misuse = Misuse.NO_BACKWARD
        for i in range(len(self.params)):
            b, slot = self._where[i]
            if not self.buckets[b].ready[slot]:
                if self._held[i]:  # accumulated, never handed over: reduce it
                    self._copy_in(i, self.params[i].grad)
                    self._got_grad[i] = True
                else:
                    self._copy_in(i, None)
                self.buckets[b].ready[slot] = True
        self._post_total()  # (a rank without backward: before the control vector)
        layout = self.layout
        ctrl = layout.pack(
            self.control.rank,
            self.samples,
            self._misuse,
            self._got_grad,
            self.share_out.numpy(),
            self.buckets[-1].flat.numpy() if layout.payload_len else None,
        )
        what = f"gradient all-reduce on {self.transport.name}"
        transports = [t for _, t in self.stages]
        activity = lambda: sum(t.events for t in transports)  # noqa: E731
        total_vec = self.last_bucket.reduce(self, ctrl, what, activity)
        if self._total_req is not None:  # (posted everywhere before the control)
            self._total_comm.wait(self._total_req, "sample count all-reduce")
        self.last_comm_seconds = time.perf_counter() - start
        self.last_bucket.unpack(self, total_vec)
        final = [b.final for b in self.buckets]
        self._reset()
        misuse = layout.first_misuse(total_vec)
        if misuse is not None:
            rank, code = misuse
            raise MisuseError(
                f"[rank {self.control.world_rank_of(rank)}] {MISUSE_TEXT[code]}"
            )
        total = float(total_vec[layout.samples])
        self.last_total_samples = total
        anywhere = total_vec[layout.got_grad].tolist()
        self.shared = torch.from_numpy(layout.shared_values(total_vec))
        if total > 0:
            weighed = self.buckets[:-1] if self.last_bucket.raw else self.buckets
            for bucket in weighed:
                if not final[bucket.index]:  # (else divided by the same total)
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

    def _reset(self) -> None:
        for bucket in self.buckets:
            bucket.reset()
        self._next = [0] * len(self.stages)
        self.settling = False
        self._misuse = 0
        self._got_grad = [False] * len(self.params)
        self._fired = False
        self._passes = [0] * len(self.params)
        self._held = [False] * len(self.params)
        self._total_req = None
        self.known_total = None
        self._final_next = 0

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

        Every rank of the group must call it; a second call does nothing.
        Gradients that were views into a shared-memory bucket become copies
        of their values in private memory. Other tensors that alias those
        gradients (``g = p.grad`` taken earlier) point into released memory
        and must not be used.
        """
        self.remove_hooks()
        if not self._closed:
            self._closed = True
            self.last_bucket.close(self)
            if self._total_comm is not None:
                self._total_comm.free()
