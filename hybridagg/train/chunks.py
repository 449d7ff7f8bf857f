"""Wiring for ``--on-group-failure continue``: the ULFM check and the chunk counter's home."""

from __future__ import annotations

from dataclasses import dataclass

from ..comm import Comm
from ..comm.counter import CounterHost, ServedCounter
from ..comm.ulfm import ulfm_status
from ..topology import Topology

__all__ = ["ChunkService", "check_fault_tolerance"]


def check_fault_tolerance(world: Comm) -> None:
    """Refuse ``--on-group-failure continue`` without ULFM (collective, same verdict).

    Raises:
        ValueError: On every rank, when any rank's MPI runs without ULFM.
    """
    ok, why = ulfm_status()
    error = None
    if not ok:
        error = ValueError(
            "--on-group-failure continue needs MPI fault tolerance (ULFM), "
            f"which this job lacks: {why}"
        )
    world.check(error, what="--on-group-failure continue")


@dataclass
class ChunkService:
    """The dynamic shares' chunk counter, held by server 0 and served by messages.

    Why not the usual MPI window: see :mod:`hybridagg.comm.counter`.

    Attributes:
        comm: The workers and server 0 (``None`` on the other servers).
        client: A worker's counter (``None`` on servers).
        host: Server 0's side (``None`` elsewhere).
    """

    comm: Comm | None
    client: ServedCounter | None = None
    host: CounterHost | None = None

    @classmethod
    def build(cls, topo: Topology) -> ChunkService:
        """Create it (collective over the world)."""
        home = topo.servers[0]
        member = topo.is_worker or topo.rank == home
        comm = topo.comms.world.split(
            0 if member else None, topo.rank, name="chunk counter"
        )
        if comm is None:
            return cls(None)
        if topo.rank == home:  # (the highest rank of comm)
            return cls(comm, host=CounterHost(comm, range(topo.num_workers)))
        return cls(comm, client=ServedCounter(comm, comm.size - 1, topo.comms.workers))

    def poll(self) -> None:
        """Server 0: answer the requests that have arrived."""
        if self.host is not None:
            self.host.poll()

    def close(self) -> None:
        """Server 0: stop serving."""
        if self.host is not None:
            self.host.close()
