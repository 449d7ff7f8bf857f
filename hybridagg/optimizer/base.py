"""``DistributedOptimizer``: the base class and factory of hybridagg's optimizers.

::

    topo = hybridagg.init(groups="0-1,2-3")
    opt = hybridagg.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        model.named_parameters(), topo, mode="sync", model=model)

Like Horovod's ``DistributedOptimizer``, calling it picks the
implementation: :class:`~hybridagg.optimizer.sync.SyncOptimizer` for
``mode="sync"`` and :class:`~hybridagg.optimizer.server.ServerOptimizer`
for ``"hybrid"`` and ``"async"``; both are subclasses, so
``isinstance(opt, hybridagg.DistributedOptimizer)`` holds. This class holds
what they share: the wrapped optimizer's interface, the gradient reducer
and its side channel, and the queries whose answer differs by mode.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from typing import ClassVar

import torch

from ..collectives import Collectives, CollectiveSettings
from ..comm import Comm, all_finite, check_wire, staging_setting
from ..devices import reduction_backend
from ..modes import check_mode
from ..ps.compensation import Compensation
from ..reduce import DEFAULT_BUCKET_BYTES, SHARE_SLOTS, GradientReducer
from ..topology import Topology, default_topology
from .backends import BACKENDS, build_transports, device_slot

__all__ = ["DistributedOptimizer"]

_log = logging.getLogger(__name__)


def _nccl_available() -> bool:
    import torch.distributed as dist

    return bool(dist.is_available() and dist.is_nccl_available())


class DistributedOptimizer(torch.optim.Optimizer):
    """Wrap a ``torch.optim`` optimizer so each step aggregates across ranks.

    Args:
        optimizer: Any ``torch.optim.Optimizer`` over the model's parameters.
        named_parameters: ``model.named_parameters()`` (default: from ``model``).
        topology: From :func:`hybridagg.init` (default: ``init()``).
        mode: ``"sync"``, ``"hybrid"`` or ``"async"``: chooses the class.
        model: The module; when given, its floating buffers (BatchNorm
            statistics) are averaged over the ranks of each reduction, and
            in hybrid and async mode travel to the servers with the weights.
        bucket_mb: Fused bucket size in MiB (default 25, like DDP).
        allreduce_backend: ``"mpi"``, ``"torch"`` (NCCL on CUDA, gloo on CPU),
            ``"horovod"``, or ``"auto"``: NCCL for a reduction whose ranks
            all train on GPUs of their own, else MPI (GPU tensors through
            pinned host memory), decided per group in hybrid and async
            (:func:`hybridagg.devices.reduction_backend`; the reason is
            :attr:`backend_reason`).
        compensation: The learning-rate rule
            (:class:`~hybridagg.ps.compensation.Compensation`): linear
            scaling by the update's samples with warm-up, and staleness
            damping, and optionally the momentum lookahead of the servers'
            replies. Default: no scaling (the rate as given), damping
            ``1 / (1 + staleness)`` in hybrid and async, no lookahead
            (``hybridagg train`` turns it on).
        staleness_bound: Hybrid/async: SSP bound ``s`` in a group's own
            updates (``None``: groups never wait for each other).
        max_updates: Hybrid/async: server version after which
            :attr:`should_stop` turns true on every worker.
        overlap: Hybrid/async: overlap the leader's exchange with the
            group's next step (each update then at least one version stale).
        stream_push: Hybrid/async: the leader streams its push bucket by
            bucket as the group's reduction completes, and the servers
            update and return each part as it arrives (not with
            ``overlap``, nor for parameters off the CPU; off by default:
            on a CPU-bound node the work it moves into backward slowed
            compute as much as it saved, bench/RESULTS.md).
        server_batching: Hybrid/async: server 0 sizes each group's batch
            from the times leaders :meth:`report` (OmniLearn's controller,
            :mod:`hybridagg.batching`); the advice arrives as
            :attr:`batch_advice`. Keys: ``initial`` (each group's batch),
            ``deadband``, ``smoothing``, ``window``, ``min_batch``,
            ``max_group_batch``.
        wire: The type gradients and weights travel in: ``"fp32"`` (the
            default), ``"bf16"`` or ``"fp16"`` (half the bytes; every rank
            that rounds a gradient keeps what the rounding lost and adds it
            to its next gradient, so nothing is lost over time; sums are
            formed in float32; the servers' float32 master weights never
            leave them). The same in every mode, so modes compare on one
            wire. Needs the ``mpi`` or ``torch`` all-reduce backend; with
            ``fp16``, a gradient element beyond 65504 becomes an infinity
            and the non-finite check stops the run.
        backward_passes_per_step: Gradient accumulation (Horovod's name):
            each gradient is reduced, and may be stepped, once every this
            many backward passes; the passes in between sum into ``.grad``
            locally, with no communication. Call :meth:`step` after the
            last of them (a parameter the last pass missed is reduced with
            what it accumulated). Default 1.
        fault_tolerant: The run survives the loss of a group
            (``--on-group-failure continue``): no shared-memory window is
            used for the group's reduction (Open MPI does not support its
            shared-memory windows after a process failure).

    Raises:
        TypeError: ``optimizer`` or ``topology`` is of the wrong kind.
        ValueError: Unknown mode or backend, a mode that does not fit the
            topology, or parameters or settings that differ across ranks
            (on every rank).
    """

    _IMPLEMENTATIONS: ClassVar[dict[str, type[DistributedOptimizer]]] = {}

    def __init_subclass__(cls, modes: tuple[str, ...] = (), **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        for mode in modes:
            DistributedOptimizer._IMPLEMENTATIONS[mode] = cls

    def __new__(cls, *args, mode: str = "sync", **kwargs):
        if cls is DistributedOptimizer:
            check_mode(mode, servers=None)
            cls = DistributedOptimizer._IMPLEMENTATIONS[mode]
        return super().__new__(cls)

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        named_parameters: Iterable[tuple[str, torch.nn.Parameter]] | None = None,
        topology: Topology | None = None,
        *,
        mode: str = "sync",
        model: torch.nn.Module | None = None,
        bucket_mb: float = DEFAULT_BUCKET_BYTES / 2**20,
        allreduce_backend: str = "auto",
        compensation: Compensation | None = None,
        staleness_bound: int | None = None,
        max_updates: int | None = None,
        overlap: bool = False,
        stream_push: bool = False,
        server_batching: dict | None = None,
        fault_tolerant: bool = False,
        wire: str = "fp32",
        backward_passes_per_step: int = 1,
    ) -> None:
        check_wire(wire)
        if (
            isinstance(backward_passes_per_step, bool)
            or not isinstance(backward_passes_per_step, int)
            or backward_passes_per_step < 1
        ):
            raise ValueError(
                "backward_passes_per_step must be a positive integer, got "
                f"{backward_passes_per_step!r}"
            )
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"optimizer must be a torch.optim.Optimizer, got {type(optimizer)}"
            )
        if isinstance(optimizer, DistributedOptimizer):
            raise TypeError("optimizer is already a DistributedOptimizer")
        if allreduce_backend not in BACKENDS:
            raise ValueError(
                f"allreduce_backend must be one of {BACKENDS}, got {allreduce_backend!r}"
            )
        if not bucket_mb > 0:
            raise ValueError(f"bucket_mb must be positive, got {bucket_mb}")
        if wire != "fp32" and allreduce_backend == "horovod":
            raise ValueError(
                f"wire {wire!r} needs allreduce_backend 'mpi' or 'torch', not horovod"
            )
        if compensation is not None and not isinstance(compensation, Compensation):
            raise TypeError("compensation must be a hybridagg.ps.Compensation")
        topo = default_topology(topology)
        if named_parameters is None:
            if model is None:
                raise ValueError("pass named_parameters or model")
            named_parameters = model.named_parameters()
        named = list(named_parameters)
        if not all(
            isinstance(n, str) and isinstance(p, torch.Tensor) for n, p in named
        ):
            raise TypeError("named_parameters must yield (name, tensor) pairs")
        if topo.is_server:
            raise ValueError(
                f"rank {topo.rank} is a parameter server; DistributedOptimizer runs on workers"
            )
        check_mode(
            mode,
            servers=len(topo.servers),
            singleton_groups=all(len(g) == 1 for g in topo.groups),
            groups=f"the topology has groups {[list(g) for g in topo.groups]}",
        )
        self._setup_optimizer_attrs(optimizer)
        self.topology, self.mode, self.model = topo, mode, model
        self.compensation = compensation or Compensation()
        settings, error = None, None
        try:
            settings = CollectiveSettings.from_env()
            staging_setting()  # (HYBRIDAGG_HOST_STAGING, read by the transports)
            if fault_tolerant:
                # Open MPI does not support its shared-memory windows after a
                # process failure: a peer killed inside a window's lock or
                # flag wait would leave the survivors waiting past any ULFM
                # error, so groups reduce by messages only
                settings = dataclasses.replace(settings, shared_memory=False)
        except ValueError as exc:  # (one rank's bad value: an error on every rank)
            error = exc
        self._control = self._scope(topo).dup("control")
        self._control.check(error, what="collective settings")
        _check_agreement(named, settings, self._control, wire)
        self.wire = wire
        mine = self._choose_backend(allreduce_backend, named, topo)
        self.allreduce_backend = mine.backend
        self.backend_reason = mine.reason
        """Why this rank's reduction uses :attr:`allreduce_backend` (words)."""
        self._on_cpu = mine.on_cpu
        hierarchical = self._hierarchical(topo)
        self._transports = build_transports(
            mine.backend,
            topo,
            not mine.on_cpu,
            hierarchical,
            settings,
            wire,
            per_group=self._per_group,
        )
        t = self._transports
        self._reducer = GradientReducer(
            named,
            t.group,
            self._control,
            cross=t.cross,
            bcast=t.bcast,
            hierarchical=hierarchical,
            bucket_bytes=int(bucket_mb * 2**20),
            settings=settings,
            early_total=self._early_total(named),
            backward_passes=backward_passes_per_step,
            on_cpu=mine.on_cpu,
        )
        self._buffers = [
            b for b in (model.buffers() if model else []) if b.is_floating_point()
        ]
        # buffers are averaged over the same ranks as the gradients
        self._buffer_collectives = Collectives(self._control, settings)
        self._synced = False
        self._halted: str | None = None
        self._scaling = False
        self._overflowed = False
        self._finished = False
        self.last_total_samples = 0.0
        self.updates = 0

    def _choose_backend(self, requested: str, named: list, topo: Topology):
        """This reduction's backend, from the parameter device of every rank
        of it (collective over the reduction's ranks: the same choice, or
        the same error, on each)."""
        from mpi4py import MPI

        host = topo.hosts[topo.rank] if topo.hosts else MPI.Get_processor_name()
        mine = device_slot([p for _, p in named], host)
        slots = self._control.allgather(mine, what="parameter devices")
        choice = reduction_backend(requested, slots, _nccl_available())
        if self._control.rank == 0 and requested == "auto":
            where = f"group {topo.group}" if self._per_group else "the workers"
            _log.info("all-reduce of %s: %s", where, choice.reason)
        return choice

    _per_group: ClassVar[bool] = False
    """Each group reduces on its own (hybrid, async), so each picks its backend."""

    # --- what the implementations decide ---------------------------------------
    def _scope(self, topo: Topology) -> Comm:
        """The ranks whose gradients one update sums."""
        raise NotImplementedError

    def _hierarchical(self, topo: Topology) -> bool:
        """Whether the reduction goes group, leaders, group."""
        return False

    def _apply(self, total: float) -> None:
        """Update the weights from the reduced gradients of ``total`` samples."""
        raise NotImplementedError

    def _early_total(self, named: list) -> bool:
        """Whether the reducer learns the total early and finalizes buckets as
        they complete (a leader streams them to the servers)."""
        return False

    # --- wiring --------------------------------------------------------------
    def _setup_optimizer_attrs(self, optimizer: torch.optim.Optimizer) -> None:
        # Share, not copy: schedulers and users edit param_groups in place.
        self.optimizer = optimizer
        self.defaults = optimizer.defaults
        self.param_groups = optimizer.param_groups
        self.state = optimizer.state
        for hooks in (
            "_optimizer_step_pre_hooks",
            "_optimizer_step_post_hooks",
            "_optimizer_state_dict_pre_hooks",
            "_optimizer_state_dict_post_hooks",
            "_optimizer_load_state_dict_pre_hooks",
            "_optimizer_load_state_dict_post_hooks",
        ):
            setattr(self, hooks, OrderedDict())

    # --- the optimizer interface ---------------------------------------------
    def set_samples(self, n: int | float) -> None:
        """Set this rank's sample count for the next backward (persists).

        Gradients are weighted by it, so ranks with different batch sizes give
        the gradient of the union batch. A rank with ``n=0`` may skip forward
        and backward and call :meth:`step` directly; it still takes part.

        Raises:
            ValueError: ``n`` is negative or not a number.
        """
        if isinstance(n, bool) or not isinstance(n, (int, float)) or not n >= 0:
            raise ValueError(f"samples must be a number >= 0, got {n!r}")
        self._reducer.samples = float(n)

    @property
    def samples(self) -> float:
        """This rank's current sample count."""
        return self._reducer.samples

    def set_loss_scale(self, scale: float | None) -> None:
        """Declare the loss scale of the next backward passes (mixed precision).

        With a loss scaler (fp16 autocast), the loss is multiplied by
        ``scale`` before backward so small gradients survive fp16. Each
        gradient is divided by ``scale`` as it enters the reduction, with its
        sample weight (no extra pass), so every rank, and in hybrid and
        async mode the servers, receive true gradients. While a scale is
        set, a reduced gradient that is not finite is an *overflow*, not a
        fault: :meth:`step` applies nothing (in hybrid and async mode nothing
        is pushed), :attr:`overflowed` says so, and the caller lowers its
        scale. The reduced gradient is the same on every rank of the
        reduction, so every rank skips the same step with no extra message.
        A loss or averaged buffer that is not finite still halts
        (:meth:`halt`). Persists until changed; ``None``: no loss scaling.

        Args:
            scale: The factor the loss was multiplied by (positive, finite),
                or ``None``.

        Raises:
            ValueError: ``scale`` is not a positive finite number, or this
                optimizer streams its pushes (see
                :class:`~hybridagg.optimizer.server.ServerOptimizer`).
        """
        if scale is None:
            self._scaling = False
            self._reducer.loss_scale = 1.0
            return
        if (
            isinstance(scale, bool)
            or not isinstance(scale, (int, float))
            or not 0 < scale < float("inf")
        ):
            raise ValueError(
                f"loss scale must be a positive finite number, got {scale!r}"
            )
        self._check_loss_scaling()
        self._scaling = True
        self._reducer.loss_scale = float(scale)

    def _check_loss_scaling(self) -> None:
        """Raise ``ValueError`` if this optimizer cannot skip an overflowed step."""

    @property
    def overflowed(self) -> bool:
        """The last reduction's gradient was not finite under a loss scale
        (:meth:`set_loss_scale`): that step applied nothing, on every rank of
        the reduction."""
        return self._overflowed

    def synchronize(self) -> float:
        """Finish reducing gradients (collective); ``.grad`` then holds the average.

        The reduced gradient (and the averaged buffers) are then checked: if
        any value is NaN or infinite, the optimizer halts (:meth:`halt`).
        The reduction's result is the same on every rank of its scope, so
        every rank reaches the same verdict without a message.

        Returns:
            The total sample count of this update over the ranks reduced.
        """
        total = self._reducer.synchronize()
        self.last_total_samples = total
        if self._buffers:
            self._average_buffers()
        self._synced = True
        self._overflowed = False
        if total > 0 and self._halted is None:
            grads_finite = all_finite(b.flat for b in self._reducer.buckets)
            if not grads_finite and self._scaling:
                self._overflowed = True  # the loss scale was too high: skip
            elif not grads_finite:
                self.halt(f"the reduced gradient {self._where()}is not finite")
            if self._halted is None and self._buffers and not all_finite(self._buffers):
                self.halt(f"the averaged buffers {self._where()}are not finite")
        return total

    def _where(self) -> str:
        """Whose reduction, for a message (``""`` where it is every worker's)."""
        return ""

    def halt(self, reason: str) -> None:
        """Stop training here: a value of this reduction is NaN or infinite.

        No update is applied from now on (in hybrid and async mode nothing is
        pushed; the leader tells the servers at :meth:`finish`, and they
        stop every group); :attr:`should_stop` turns true and
        :attr:`nonfinite` says why. Call on every rank of the reduction with
        the same verdict (the driver calls it when a loss in the shared
        values is not finite; :meth:`synchronize` when the gradient is not).

        Args:
            reason: What was not finite.
        """
        if self._halted is None:
            self._halted = reason
        elif reason not in self._halted:  # (the loss first: it is the cause)
            self._halted = f"{reason}, and {self._halted}"

    @property
    def nonfinite(self) -> str | None:
        """Why training must stop on a NaN or an infinity (``None``: it need not)."""
        return self._halted

    @property
    def nonfinite_here(self) -> bool:
        """Whether this rank's own reduction found the NaN or infinity (not the servers)."""
        return self._halted is not None

    def _average_buffers(self) -> None:
        """Average the floating buffers (BatchNorm statistics), equal weights."""
        flat = torch.cat([b.detach().reshape(-1).double().cpu() for b in self._buffers])
        self._buffer_collectives.allreduce(flat, what="buffer average")
        flat /= self._control.size
        offset = 0
        for b in self._buffers:
            n = b.numel()
            b.copy_(flat[offset : offset + n].view_as(b))
            offset += n

    def step(self, closure=None):
        """Reduce (unless :meth:`synchronize` already did) and update.

        An update whose total sample count is zero changes nothing.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if not self._synced:
            self.synchronize()
        self._synced = False
        # a non-finite gradient changes nothing; an overflow under a loss
        # scale skips this step only
        if self._halted is None and not self._overflowed:
            self._apply(self.last_total_samples)
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the gradients (a misuse between ``backward()`` and ``step()``).

        The gradients become zeroed views into the reduction buckets, so the
        next backward accumulates where the reduction reads, with no copy;
        ``set_to_none`` is accepted for compatibility. After :meth:`step`, a
        parameter that no rank computed a gradient for has ``.grad = None``,
        as it would have without hybridagg.
        """
        if self._reducer.note_zero_grad():
            return  # reported by step() on every rank; buckets may be in flight
        self._reducer.point_grads_at_buckets()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally; the next backward outside reduces them."""
        self._reducer.enabled = False
        try:
            yield
        finally:
            self._reducer.enabled = True

    def state_dict(self):
        """The inner optimizer's state dict."""
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict) -> None:
        """Load into the inner optimizer."""
        self.optimizer.load_state_dict(state_dict)

    def add_param_group(self, param_group) -> None:
        """Not supported after wrapping: the buckets are fixed at construction."""
        raise ValueError("add parameter groups before wrapping the optimizer")

    def finish(self, timeout: float | None = None) -> int | None:
        """End training on this worker; call once on every worker after the last step.

        The gradient reducer detaches and releases its shared memory; the
        gradients keep their values (in new memory: a tensor that aliased a
        gradient before, ``g = p.grad``, must not be used afterwards). In
        hybrid/async mode the leaders also tell the servers they are done,
        and rank 0 receives the final weights from the servers.

        Returns:
            On rank 0 in hybrid/async mode the final server version, else ``None``.
        """
        self._reducer.close()  # (collective over the group)
        self._transports.free()
        self._finished = True
        return None

    def final_state_dict(self) -> dict[str, torch.Tensor]:
        """The trained model as a plain ``state_dict``, for ``torch.save``.

        Call after :meth:`finish`, on a rank that holds the final model: in
        sync mode any worker (every worker holds the same); in hybrid and
        async mode rank 0, which :meth:`finish` gave the servers' final
        weights (the weights the servers hold, never a momentum-lookahead
        prediction of a reply) and floating buffers (BatchNorm statistics,
        as the servers keep them). Integer buffers (BatchNorm's
        ``num_batches_tracked``) are this rank's own. Parameters and buffers
        are detached copies on the CPU, so the file loads anywhere::

            if hybridagg.rank() == 0:   # after opt.finish()
                torch.save(opt.final_state_dict(), "model.pt")
            model.load_state_dict(torch.load("model.pt", weights_only=True))

        Raises:
            ValueError: No ``model=`` was given, :meth:`finish` was not
                called, or (hybrid/async) this rank did not receive the
                final weights.
        """
        if self.model is None:
            raise ValueError(
                "final_state_dict() needs the model: pass model= to "
                "DistributedOptimizer"
            )
        if not self._finished:
            raise ValueError("final_state_dict(): call finish() first")
        self._check_holds_final()
        state = self.model.state_dict()
        out = OrderedDict((k, v.detach().cpu().clone()) for k, v in state.items())
        # (the modules' versions: load_state_dict upgrades old layouts by them)
        out._metadata = getattr(state, "_metadata", None)  # type: ignore[attr-defined]
        return out

    def _check_holds_final(self) -> None:
        """Raise ``ValueError`` unless this rank's model holds the final weights."""

    # --- side channels -----------------------------------------------------------
    def share(self, values) -> None:
        """Send up to ``SHARE_SLOTS`` (5) numbers with the next reduction.

        After the next :meth:`synchronize`, :attr:`shared` holds every rank's
        values (rows in rank order of the reduction: all workers in sync
        mode, the group in hybrid/async), at no extra collective: they ride
        along with the reduction's own small control data. The driver uses
        this to agree on stopping after a signal, to measure per-rank step
        times and to stop every rank when a loss is not finite.
        """
        vals = torch.as_tensor(values, dtype=torch.float64).reshape(-1)
        if vals.numel() > SHARE_SLOTS:
            raise ValueError(f"share() takes at most {SHARE_SLOTS} values")
        out = self._reducer.share_out
        out.zero_()
        out[: vals.numel()] = vals

    @property
    def shared(self) -> torch.Tensor:
        """Every rank's shared values of the last reduction, ``(ranks, SHARE_SLOTS)``."""
        return self._reducer.shared

    @property
    def reducer(self) -> GradientReducer:
        """The gradient reducer (bucket sizes, timings, the last bucket's strategy)."""
        return self._reducer

    def progress(self) -> None:
        """Advance the group's reduction in flight: post the buckets whose
        gradients are ready, test those posted (called while the rank
        emulates compute, as a communication thread would run meanwhile)."""
        self._reducer.progress()

    # --- queries whose answer depends on the mode (sync's answers here) ----------
    def request_stop(self) -> None:
        """Hybrid/async: ask every group to stop (sent with this group's next push)."""

    def report(self, seconds_per_sample: float) -> None:
        """Hybrid/async: the group's compute time per sample, sent with each push."""

    @property
    def server_version(self) -> int:
        """Hybrid/async: the newest server version this group has seen (sync: updates)."""
        return self.updates

    @property
    def batch_advice(self) -> float:
        """Async adaptive batching: the batch size server 0 advises (0: none)."""
        return 0.0

    @property
    def checkpoint_due(self) -> int:
        """Hybrid/async: the checkpoint the servers asked this group to save now (0: none)."""
        return 0

    @property
    def should_stop(self) -> bool:
        """The run must stop: a non-finite value (:attr:`nonfinite`), or in
        hybrid/async the servers reached ``max_updates`` or were asked to stop
        (same on every worker of a reduction)."""
        return self._halted is not None

    @property
    def last_staleness(self) -> int:
        """Staleness of this group's last update (0 in sync mode)."""
        return 0

    def _servers_only(self, what: str):
        raise ValueError(f"{what}() needs mode='hybrid' or 'async'")

    def checkpointed(self, number: int) -> None:
        """Hybrid/async: every member of this group saved its part of checkpoint ``number``."""
        self._servers_only("checkpointed")

    def refresh_from_servers(self) -> None:
        """Hybrid/async: load the servers' weights into the model (collective in the group)."""
        self._servers_only("refresh_from_servers")

    def pull_weights(self) -> torch.Tensor:
        """Hybrid/async, on a group leader: the servers' current flat weights."""
        return self._servers_only("pull_weights")

    def pull_state(
        self, out: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Hybrid/async, on a group leader: the servers' flat weights and
        buffers (the weights copied into ``out`` when given, a flat tensor
        of the model's size kept by a caller that pulls again and again)."""
        return self._servers_only("pull_state")

    def __repr__(self) -> str:
        return f"{type(self).__name__}(mode={self.mode!r}, {self.optimizer!r})"


def _check_agreement(
    named, settings: CollectiveSettings, control: Comm, wire: str = "fp32"
) -> None:
    """Check that every rank has the same parameters, collective settings and wire.

    Ranks whose thresholds differ would post different collectives, and
    ranks whose parameters differ would reduce mismatched buckets: both
    would hang or corrupt, so they fail here, on every rank, naming the
    difference.
    """
    params = [(n, tuple(p.shape), str(p.dtype)) for n, p in named]
    everyone = control.allgather(
        (params, settings, wire), what="parameter shapes and settings"
    )
    first = everyone[0][1]
    for rank, (_, _, theirs_wire) in enumerate(everyone):
        if theirs_wire != everyone[0][2]:
            raise ValueError(
                f"wire differs between rank 0 ({everyone[0][2]!r}) and rank "
                f"{rank} ({theirs_wire!r}) of the workers; it must be the same "
                "on every rank"
            )
    for rank, (_, theirs, _) in enumerate(everyone):
        for name, env in _SETTING_NAMES.items():
            if getattr(theirs, name) != getattr(first, name):
                raise ValueError(
                    f"{env} differs between rank 0 ({getattr(first, name)!r}) and "
                    f"rank {rank} ({getattr(theirs, name)!r}) of the workers; it "
                    "must be the same on every rank"
                )
    shapes = [p for p, _, _ in everyone]
    for rank, theirs in enumerate(shapes):
        if theirs != shapes[0]:
            diff = next(
                (
                    f"{a} vs {b}"
                    for a, b in zip(shapes[0], theirs, strict=False)
                    if a != b
                ),
                f"{len(shapes[0])} vs {len(theirs)} parameters",
            )
            raise ValueError(
                f"parameters differ between rank 0 and rank {rank} of the "
                f"workers: {diff}"
            )


# the settings that choose how each bucket is reduced, and their variables
_SETTING_NAMES = {
    "ring_min_bytes": "HYBRIDAGG_RING_MIN_BYTES",
    "settled_max_bytes": "HYBRIDAGG_SETTLED_MAX_BYTES",
    "ring_chunk_bytes": "HYBRIDAGG_RING_CHUNK_BYTES",
}
