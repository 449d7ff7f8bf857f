"""``DistributedOptimizer``: the one object a training script wraps its optimizer in.

::

    topo = hybridagg.init(groups="0-1,2-3")
    opt = hybridagg.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        model.named_parameters(), topo, mode="sync", model=model)
    hybridagg.broadcast_parameters(model.state_dict(), root_rank=0, topology=topo)
    for x, y in loader:
        opt.set_samples(len(x))     # only needed when batch sizes differ
        opt.zero_grad()
        loss_fn(model(x), y).backward()   # buckets are reduced during backward
        opt.step()

``mode="sync"``: every worker's gradient is averaged (weighted by sample
count) before each update, flat with one group, hierarchical (group, leaders,
group) with several. Gradient clipping: call ``opt.synchronize()``, clip,
then ``opt.step()`` (which then does not reduce again), as with Horovod. LR
schedulers work on the wrapper as on any optimizer: it shares the inner
optimizer's ``param_groups``. With ``model=`` given, floating-point buffers
(BatchNorm running statistics) are averaged over the same ranks after each
reduction, with equal weights.
"""

from __future__ import annotations

import contextlib
import socket
from collections import OrderedDict
from collections.abc import Iterable, Iterator

import torch

from .allreduce import (
    DEFAULT_BUCKET_BYTES,
    SHARE_SLOTS,
    GradientReducer,
    make_transport,
)
from .comm import Comm
from .ps.compensation import Compensation
from .ps.exchange import GroupExchange
from .runtime import envvars
from .topology import Topology

__all__ = [
    "MODES",
    "DistributedOptimizer",
    "broadcast_optimizer_state",
    "broadcast_parameters",
    "init_torch_distributed",
]

# settings that choose how each gradient bucket is reduced (checked at
# construction: ranks that differ would post different collectives)
_SAME_ON_EVERY_RANK = (
    "HYBRIDAGG_RING_MIN_BYTES",
    "HYBRIDAGG_SETTLED_MAX_BYTES",
    "HYBRIDAGG_RING_CHUNK_BYTES",
)

MODES = ("sync", "hybrid", "async")
_BACKENDS = ("auto", "mpi", "torch", "horovod")


def _default_topology(topology: Topology | None) -> Topology:
    if topology is None:
        from .topology import init

        return init()
    if not isinstance(topology, Topology) or topology.comms is None:
        raise TypeError("topology must come from hybridagg.init(...)")
    return topology


class DistributedOptimizer(torch.optim.Optimizer):
    """Wrap a ``torch.optim`` optimizer so each step aggregates across ranks.

    Args:
        optimizer: Any ``torch.optim.Optimizer`` over the model's parameters.
        named_parameters: ``model.named_parameters()`` (default: from ``model``).
        topology: From :func:`hybridagg.init` (default: ``init()``).
        mode: ``"sync"``, ``"hybrid"`` or ``"async"``.
        model: The module; when given, its floating buffers are averaged too.
        bucket_mb: Fused bucket size in MiB (default 25, like DDP).
        allreduce_backend: ``"mpi"``, ``"torch"`` (NCCL on CUDA, gloo on CPU),
            ``"horovod"``, or ``"auto"`` (``"torch"`` for CUDA parameters,
            else ``"mpi"``).
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
        server_batching: Hybrid/async: server 0 sizes each group's batch
            from the times leaders :meth:`report` (OmniLearn's controller,
            :mod:`hybridagg.batching`); the advice arrives as
            :attr:`batch_advice`. Keys: ``initial`` (each group's batch),
            ``deadband``, ``smoothing``, ``window``, ``min_batch``,
            ``max_group_batch``.

    Raises:
        TypeError: ``optimizer`` or ``topology`` is of the wrong kind.
        ValueError: Unknown mode or backend, a mode that does not fit the
            topology, or parameters that differ across ranks (on every rank).
    """

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
        server_batching: dict | None = None,
    ) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"optimizer must be a torch.optim.Optimizer, got {type(optimizer)}"
            )
        if isinstance(optimizer, DistributedOptimizer):
            raise TypeError("optimizer is already a DistributedOptimizer")
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if allreduce_backend not in _BACKENDS:
            raise ValueError(
                f"allreduce_backend must be one of {_BACKENDS}, got {allreduce_backend!r}"
            )
        if not bucket_mb > 0:
            raise ValueError(f"bucket_mb must be positive, got {bucket_mb}")
        topo = _default_topology(topology)
        if named_parameters is None:
            if model is None:
                raise ValueError("pass named_parameters or model")
            named_parameters = model.named_parameters()
        named = list(named_parameters)
        if not all(
            isinstance(n, str) and isinstance(p, torch.Tensor) for n, p in named
        ):
            raise TypeError("named_parameters must yield (name, tensor) pairs")
        self._setup_optimizer_attrs(optimizer)
        self.topology, self.mode = topo, mode
        self.model = model
        comms = topo.comms
        if topo.is_server:
            raise ValueError(
                f"rank {topo.rank} is a parameter server; DistributedOptimizer runs on workers"
            )
        if mode == "sync" and topo.servers:
            raise ValueError(
                f"mode='sync' uses no parameter servers, but the topology has "
                f"{len(topo.servers)}; use mode='hybrid' or servers=0"
            )
        if mode != "sync":
            _check_ps_mode(topo, mode, staleness_bound, max_updates)
        if compensation is not None and not isinstance(compensation, Compensation):
            raise TypeError("compensation must be a hybridagg.ps.Compensation")
        self.compensation = compensation or Compensation()
        hierarchical = mode == "sync" and topo.num_groups > 1
        scope = comms.workers if mode == "sync" else comms.group
        self._control = scope.dup("control")
        self._check_parameters(named, self._control)
        backend = allreduce_backend
        if backend == "auto":
            on_cuda = any(p.is_cuda for _, p in named)
            backend = "torch" if on_cuda else "mpi"
        self.allreduce_backend = backend
        group_t, bcast_t, cross_t = self._transports(backend, named, hierarchical)
        self._reducer = GradientReducer(
            named,
            group_t,
            self._control,
            cross=cross_t,
            bcast=bcast_t,
            hierarchical=hierarchical,
            bucket_bytes=int(bucket_mb * 2**20),
        )
        self._buffers = [
            b for b in (model.buffers() if model else []) if b.is_floating_point()
        ]
        self._synced = False
        self.last_total_samples = 0.0
        self.updates = 0
        self._exchange = None
        if mode != "sync":
            self._exchange = GroupExchange(
                topo,
                [p for _, p in named],
                self._buffers,
                optimizer,
                self.compensation,
                staleness_bound,
                max_updates,
                overlap,
                server_batching,
            )

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

    @staticmethod
    def _check_parameters(named, control: Comm) -> None:
        params = [(n, tuple(p.shape), str(p.dtype)) for n, p in named]
        # the thresholds that choose each bucket's reduction must agree, or
        # ranks would post different collectives
        settings = {name: envvars.get_str(name) for name in _SAME_ON_EVERY_RANK}
        everyone = control.allgather_obj(
            (params, settings), what="parameter shapes and settings"
        )
        first = everyone[0][1]
        for rank, (_, theirs) in enumerate(everyone):
            for name, value in theirs.items():
                if value != first[name]:
                    raise ValueError(
                        f"{name} differs between rank 0 ({first[name]!r}) and "
                        f"rank {rank} ({value!r}) of the workers; it must be "
                        "the same on every rank"
                    )
        everyone = [p for p, _ in everyone]
        for rank, theirs in enumerate(everyone):
            if theirs != everyone[0]:
                diff = next(
                    (
                        f"{a} vs {b}"
                        for a, b in zip(everyone[0], theirs, strict=False)
                        if a != b
                    ),
                    f"{len(everyone[0])} vs {len(theirs)} parameters",
                )
                raise ValueError(
                    f"parameters differ between rank 0 and rank {rank} of the "
                    f"workers: {diff}"
                )

    def _transports(self, backend: str, named, hierarchical: bool):
        topo, comms = self.topology, self.topology.comms
        group = comms.group.dup(f"group{topo.group}.reduce")
        bcast = comms.group.dup(f"group{topo.group}.bcast") if hierarchical else None
        cross_comm = (
            comms.leaders.dup("leaders.allreduce")
            if topo.is_leader and hierarchical
            else None
        )
        self._owned = [c for c in (group, bcast, cross_comm) if c is not None]
        if backend == "mpi":
            cross = make_transport("mpi", cross_comm, [], 0) if cross_comm else None
            return (
                make_transport("mpi", group, [], 0),
                make_transport("mpi", bcast, [], 0) if bcast else None,
                cross,
            )
        if backend == "torch":
            pgs = _torch_groups(topo, named)
            me = topo.rank
            ranks = list(topo.group_ranks)
            group_t = make_transport("torch", group, ranks, me, pgs["group"])
            bcast_t = (
                make_transport("torch", bcast, ranks, me, pgs["bcast"])
                if bcast
                else None
            )
            cross_t = None
            if cross_comm is not None:
                cross_t = make_transport(
                    "torch", cross_comm, list(topo.leaders), me, pgs["leaders"]
                )
            return group_t, bcast_t, cross_t
        hvd_sets = _horovod_sets(topo)
        ranks = list(topo.group_ranks)
        group_t = make_transport("horovod", group, ranks, topo.rank, hvd_sets["group"])
        bcast_t = (
            make_transport("horovod", bcast, ranks, topo.rank, hvd_sets["group"])
            if bcast
            else None
        )
        cross = make_transport("mpi", cross_comm, [], 0) if cross_comm else None
        return group_t, bcast_t, cross

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

    def synchronize(self) -> float:
        """Finish reducing gradients (collective); ``.grad`` then holds the average.

        Returns:
            The total sample count of this update over the ranks reduced.
        """
        total = self._reducer.synchronize()
        self.last_total_samples = total
        if self._buffers:
            self._average_buffers()
        self._synced = True
        return total

    def _average_buffers(self) -> None:
        flat = torch.cat([b.detach().reshape(-1).double().cpu() for b in self._buffers])
        self._control.allreduce(flat, what="buffer average")
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
        total = self.last_total_samples
        if self._exchange is not None:
            grads = [p.grad for p in self._reducer.params]
            lrs = [group["lr"] for group in self.param_groups]
            self._exchange.step(grads, total, lrs)
            self.updates = self._exchange.updates
            return loss
        if total > 0:
            scale = self.compensation.scale(total, self.updates, 0)
            if scale == 1.0:
                self.optimizer.step()
            else:
                saved = [group["lr"] for group in self.param_groups]
                for group in self.param_groups:
                    group["lr"] = group["lr"] * scale
                try:
                    self.optimizer.step()
                finally:
                    for group, lr in zip(self.param_groups, saved, strict=True):
                        group["lr"] = lr
            self.updates += 1
        return loss

    # --- side channels -----------------------------------------------------------
    def share(self, values) -> None:
        """Send up to ``SHARE_SLOTS`` (4) numbers with the next reduction.

        After the next :meth:`synchronize`, :attr:`shared` holds every rank's
        values (rows in rank order of the reduction: all workers in sync
        mode, the group in hybrid/async), at no extra collective: they ride
        in the control all-reduce. The driver uses this to agree on stopping
        after a signal and to measure per-rank step times.
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

    def request_stop(self) -> None:
        """Hybrid/async: ask every group to stop (sent with this group's next push)."""
        if self._exchange is not None:
            from .ps.protocol import FLAG_STOP

            self._exchange.stop_flags |= FLAG_STOP

    def report(self, seconds_per_sample: float) -> None:
        """Hybrid/async: the group's compute time per sample, sent with each push."""
        if self._exchange is not None:
            self._exchange.info = float(seconds_per_sample)

    @property
    def server_version(self) -> int:
        """Hybrid/async: the newest server version this group has seen (sync: updates)."""
        return self.updates if self._exchange is None else self._exchange.version

    @property
    def batch_advice(self) -> float:
        """Async adaptive batching: the batch size server 0 advises (0: none)."""
        return 0.0 if self._exchange is None else self._exchange.advice

    @property
    def checkpoint_due(self) -> int:
        """Hybrid/async: the checkpoint the servers asked this group to save now (0: none)."""
        return 0 if self._exchange is None else self._exchange.checkpoint_due

    def checkpointed(self, number: int) -> None:
        """Hybrid/async: every member of this group saved its part of checkpoint ``number``."""
        if self._exchange is None:
            raise ValueError("checkpointed() is for mode='hybrid' or 'async'")
        self._exchange.checkpointed(number)

    def refresh_from_servers(self) -> None:
        """Hybrid/async: load the servers' weights into the model (collective in the group)."""
        if self._exchange is None:
            raise ValueError("refresh_from_servers() needs mode='hybrid' or 'async'")
        self._exchange.refresh()
        self.updates = self._exchange.updates

    @property
    def should_stop(self) -> bool:
        """Hybrid/async: the servers reached ``max_updates`` (same on every worker)."""
        return self._exchange is not None and self._exchange.should_stop

    @property
    def last_staleness(self) -> int:
        """Staleness of this group's last update (0 in sync mode)."""
        return 0 if self._exchange is None else self._exchange.last_staleness

    def pull_weights(self) -> torch.Tensor:
        """Hybrid/async, on a group leader: the servers' current flat weights."""
        if self._exchange is None:
            raise ValueError("pull_weights() needs mode='hybrid' or 'async'")
        return self._exchange.pull()

    def pull_state(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Hybrid/async, on a group leader: the servers' flat weights and buffers."""
        if self._exchange is None:
            raise ValueError("pull_state() needs mode='hybrid' or 'async'")
        return self._exchange.pull_state()

    def finish(self, timeout: float | None = None) -> int | None:
        """End training on this worker; call once on every worker after the last step.

        In hybrid/async mode the leaders tell the servers they are done, and
        rank 0 receives the final weights from the servers (waiting until
        every group is done) and loads them into its model, for saving.
        The gradient reducer detaches and releases its shared memory; the
        gradients keep their values (in new memory: a tensor that aliased a
        gradient before, ``g = p.grad``, must not be used afterwards).

        Returns:
            On rank 0 in hybrid/async mode the final server version, else ``None``.
        """
        self._reducer.close()  # (collective over the group)
        if self._exchange is None:
            return None
        return self._exchange.finish(timeout)

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

    @property
    def reducer(self) -> GradientReducer:
        """The gradient reducer (bucket sizes, timings)."""
        return self._reducer

    def __repr__(self) -> str:
        return f"DistributedOptimizer(mode={self.mode!r}, {self.optimizer!r})"


def _check_ps_mode(topo: Topology, mode: str, bound, budget) -> None:
    if not topo.servers:
        raise ValueError(
            f"mode={mode!r} needs at least one parameter server (servers=K)"
        )
    if mode == "async" and any(len(g) != 1 for g in topo.groups):
        raise ValueError(
            "mode='async' puts every worker in its own group; the topology has "
            f"groups {[list(g) for g in topo.groups]} (use init(groups='each'))"
        )
    if bound is not None and (
        isinstance(bound, bool) or not isinstance(bound, int) or bound < 0
    ):
        raise ValueError(f"staleness_bound must be an integer >= 0, got {bound!r}")
    if budget is not None and (
        isinstance(budget, bool) or not isinstance(budget, int) or budget < 1
    ):
        raise ValueError(f"max_updates must be a positive integer, got {budget!r}")


# --------------------------------------------------------------- broadcasts
def _workers_comm(topology: Topology | None) -> Comm:
    topo = _default_topology(topology)
    if topo.comms.workers is None:
        raise ValueError("broadcasts run on workers; this rank is a server")
    return topo.comms.workers


def broadcast_parameters(
    params, root_rank: int = 0, topology: Topology | None = None
) -> None:
    """Copy ``root_rank``'s tensors into every worker's (collective over workers).

    Args:
        params: ``model.state_dict()``, ``model.named_parameters()`` or a list
            of ``(name, tensor)`` pairs; the same names on every rank.
        root_rank: World rank of the source (a worker).
        topology: From :func:`hybridagg.init`.
    """
    comm = _workers_comm(topology)
    items = sorted(params.items()) if isinstance(params, dict) else list(params)
    pending = []
    for _, t in items:
        data = t.data if isinstance(t, torch.nn.Parameter) else t
        if data.device.type == "cpu" and data.is_contiguous():
            pending.append((data, data))
        else:
            pending.append((data, data.detach().cpu().contiguous()))
    reqs = [comm.ibcast(buf, root_rank) for _, buf in pending]
    comm.wait(reqs, f"broadcast of {len(reqs)} parameters from rank {root_rank}")
    for dst, buf in pending:
        if dst is not buf:
            dst.copy_(buf)


def broadcast_optimizer_state(
    optimizer: torch.optim.Optimizer,
    root_rank: int = 0,
    topology: Topology | None = None,
) -> None:
    """Give every worker ``root_rank``'s optimizer state (collective over workers)."""
    comm = _workers_comm(topology)
    inner = (
        optimizer.optimizer
        if isinstance(optimizer, DistributedOptimizer)
        else optimizer
    )
    state = comm.bcast_obj(
        inner.state_dict() if comm.rank == root_rank else None, root_rank
    )
    if comm.rank != root_rank:
        inner.load_state_dict(state)


# ------------------------------------------------------- other group backends
def init_torch_distributed(comm: Comm, backend: str = "gloo") -> None:
    """Initialise ``torch.distributed`` over ``comm``'s ranks (collective).

    Rank 0 of ``comm`` picks a free TCP port on its host and shares the
    address through MPI, so no ``MASTER_ADDR``/``MASTER_PORT`` is needed.
    Does nothing if already initialised.
    """
    import torch.distributed as dist

    if dist.is_initialized():
        return
    addr = None
    if comm.rank == 0:
        with socket.socket() as s:
            s.bind(("", 0))
            addr = (socket.gethostname(), s.getsockname()[1])
    host, port = comm.bcast_obj(addr, 0, what="torch.distributed address")
    dist.init_process_group(
        backend,
        init_method=f"tcp://{host}:{port}",
        rank=comm.rank,
        world_size=comm.size,
    )


def _torch_groups(topo: Topology, named) -> dict:
    """Create torch.distributed process groups over the workers (collective)."""
    import torch.distributed as dist

    on_cuda = any(p.is_cuda for _, p in named)
    init_torch_distributed(topo.comms.workers, "nccl" if on_cuda else "gloo")
    # Every worker creates every group, in the same order.
    made = {}
    for g, ranks in enumerate(topo.groups):
        reduce_pg = dist.new_group(list(ranks))
        bcast_pg = dist.new_group(list(ranks))
        if g == topo.group:
            made["group"], made["bcast"] = reduce_pg, bcast_pg
    made["leaders"] = dist.new_group(list(topo.leaders))
    return made


def _horovod_sets(topo: Topology) -> dict:
    """(Re)initialise Horovod over the workers with one process set per group."""
    try:
        import horovod.torch as hvd
    except ImportError as exc:
        raise ValueError(
            "allreduce_backend='horovod' needs Horovod (`make horovod` builds it)"
        ) from exc
    # A set equal to all workers is Horovod's global set; registering it
    # again makes Horovod's initialisation fail.
    whole = len(topo.groups) == 1
    sets = [] if whole else [hvd.ProcessSet(list(g)) for g in topo.groups]
    if hvd.is_initialized():  # process sets are fixed at init: start over
        hvd.shutdown()
    hvd.init(comm=topo.comms.workers.mpi, process_sets=sets)
    return {"group": hvd.global_process_set if whole else sets[topo.group]}
