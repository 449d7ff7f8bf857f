"""The group transports of each all-reduce backend, and ``torch.distributed`` set-up."""

from __future__ import annotations

import socket
from dataclasses import dataclass

from ..collectives import CollectiveSettings
from ..comm import Comm
from ..devices import DeviceSlot
from ..reduce import MPITransport, Transport, make_transport
from ..topology import Topology

__all__ = [
    "BACKENDS",
    "GroupTransports",
    "build_transports",
    "device_slot",
    "init_torch_distributed",
]

BACKENDS = ("auto", "mpi", "torch", "horovod")


def device_slot(params, host: str) -> DeviceSlot:
    """Where this rank's parameters live (the first CUDA one's GPU, if any)."""
    for p in params:
        if p.device.type == "cuda":
            return DeviceSlot(host, "cuda", p.device.index)
    return DeviceSlot(host, "cpu")


@dataclass
class GroupTransports:
    """The transports a gradient reducer needs, and the communicators they own."""

    group: Transport
    bcast: Transport | None
    cross: Transport | None
    owned: list[Comm]

    def free(self) -> None:
        """Free the communicators created for these transports (and their
        host buffers)."""
        for transport in (self.group, self.bcast, self.cross):
            if isinstance(transport, MPITransport):
                transport.free()
        for comm in self.owned:
            comm.free()
        self.owned = []


def build_transports(
    backend: str,
    topo: Topology,
    on_cuda: bool,
    hierarchical: bool,
    settings: CollectiveSettings,
    wire: str = "fp32",
    per_group: bool = False,
) -> GroupTransports:
    """Create the group's communicators and transports (collective over the
    workers; over the group alone with ``per_group``).

    Args:
        backend: ``"mpi"``, ``"torch"`` or ``"horovod"``.
        topo: The topology.
        on_cuda: The parameters of the reduction's ranks live on CUDA devices.
        hierarchical: Reduce to the leader, across leaders, then broadcast.
        settings: The MPI collectives' thresholds.
        wire: The type gradients travel in (``fp32``, ``bf16``, ``fp16``).
        per_group: Each group reduces on its own (hybrid, async; not
            hierarchical) and chose its backend alone: with ``torch``, the
            group is a ``torch.distributed`` world of its own (NCCL for a
            group of GPU ranks), so the other groups, which may reduce
            through MPI on CPUs, never join it.
    """
    comms = topo.comms
    group = comms.group.dup(f"group{topo.group}.reduce")
    bcast = comms.group.dup(f"group{topo.group}.bcast") if hierarchical else None
    cross_comm = (
        comms.leaders.dup("leaders.allreduce")
        if topo.is_leader and hierarchical
        else None
    )
    owned = [c for c in (group, bcast, cross_comm) if c is not None]

    def mpi(comm: Comm | None) -> Transport | None:
        if comm is None:
            return None
        return make_transport("mpi", comm, [], 0, settings=settings, wire=wire)

    if backend == "mpi":
        return GroupTransports(mpi(group), mpi(bcast), mpi(cross_comm), owned)
    ranks, me = list(topo.group_ranks), topo.rank
    if backend == "torch" and per_group:
        if hierarchical:
            raise ValueError("a per-group torch reduction is not hierarchical")
        init_torch_distributed(comms.group, "nccl" if on_cuda else "gloo")
        order = list(range(group.size))  # (the group's own torch world)
        return GroupTransports(
            make_transport("torch", group, order, group.rank, None, wire=wire),
            None,
            None,
            owned,
        )
    if backend == "torch":
        pgs = _torch_groups(topo, on_cuda)
        cross = None
        if cross_comm is not None:
            cross = make_transport(
                "torch", cross_comm, list(topo.leaders), me, pgs["leaders"], wire=wire
            )
        return GroupTransports(
            make_transport("torch", group, ranks, me, pgs["group"], wire=wire),
            make_transport("torch", bcast, ranks, me, pgs["bcast"], wire=wire)
            if bcast
            else None,
            cross,
            owned,
        )
    sets = _horovod_sets(topo)
    return GroupTransports(
        make_transport("horovod", group, ranks, me, sets["group"], wire=wire),
        make_transport("horovod", bcast, ranks, me, sets["group"]) if bcast else None,
        mpi(cross_comm),
        owned,
    )


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
    host, port = comm.bcast(addr, 0, what="torch.distributed address")
    dist.init_process_group(
        backend,
        init_method=f"tcp://{host}:{port}",
        rank=comm.rank,
        world_size=comm.size,
    )


def _torch_groups(topo: Topology, on_cuda: bool) -> dict:
    """Create torch.distributed process groups over the workers (collective)."""
    import torch.distributed as dist

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
