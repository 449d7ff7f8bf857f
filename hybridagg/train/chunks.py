"""Where the dynamic shares' chunk counter lives, and the ULFM check of ``--on-group-failure continue``.

Hybrid and async workers draw their data's chunks from one counter. Its
usual home is an MPI one-sided window on worker 0
(:class:`hybridagg.data.shares.WindowCounter`): on one node Open MPI's
shared-memory window completes a draw without worker 0, but across nodes
without RDMA atomics (TCP) the window's lock, fetch and unlock each wait
until worker 0 next enters MPI, which a paced or computing worker does once
a step: a draw waited about two steps, and the drawing thread spun a core
meanwhile (bench/chunk_draw.py). Across nodes the counter lives instead in parameter server 0,
whose loop polls for messages all the time (:class:`ChunkService`), on the
communicator :func:`hybridagg.init` makes for it in every job with servers
(:attr:`hybridagg.topology.Comms.chunks`). A user's own loop gets the same
through :class:`hybridagg.data.ShareSampler`, whose draws
:func:`hybridagg.serve` answers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..comm import Comm
from ..comm.counter import CounterHost, ServedCounter
from ..comm.ulfm import ulfm_status
from ..topology import Topology

__all__ = ["ChunkService", "check_fault_tolerance", "counter_home", "job_counter_home"]


def counter_home(
    choice: str,
    *,
    mode: str,
    survives_group_loss: bool,
    pipelined: bool,
    worker_hosts: Sequence[str],
) -> str | None:
    """Where the workers draw their chunks from (pure policy, the same on every rank).

    Args:
        choice: ``--chunk-counter``: ``auto``, ``window`` or ``server``.
        mode: ``sync``, ``hybrid`` or ``async``.
        survives_group_loss: ``--on-group-failure continue``.
        pipelined: Groups are pipelines (their stages' loader keeps a window).
        worker_hosts: The node of every worker.

    Returns:
        ``None`` (sync: fixed shares, no counter), ``"window"`` or
        ``"server"``.
    """
    if mode == "sync":
        return None
    if survives_group_loss:
        return "server"  # (a window does not survive a dead lock holder)
    if pipelined:
        return "window"
    if choice != "auto":
        return choice
    return "window" if len(set(worker_hosts)) <= 1 else "server"


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


def job_counter_home(cfg, topo: Topology) -> str | None:
    """:func:`counter_home` for a run's options and topology."""
    return counter_home(
        cfg.chunk_counter,
        mode=cfg.mode,
        survives_group_loss=cfg.survives_group_loss,
        pipelined=cfg.pipelined,
        worker_hosts=[topo.hosts[r] for r in topo.workers] if topo.hosts else [],
    )


@dataclass
class ChunkService:
    """The dynamic shares' chunk counter, held by server 0 and served by messages.

    Why not the usual MPI window: see :mod:`hybridagg.comm.counter` (a dead
    worker) and this module (workers on several nodes).

    Attributes:
        comm: The workers and server 0 (``None`` on the other servers): the
            topology's (:attr:`hybridagg.topology.Comms.chunks`), which
            frees it.
        client: A worker's counter (``None`` on servers).
        host: Server 0's side (``None`` elsewhere).
    """

    comm: Comm | None
    client: ServedCounter | None = None
    host: CounterHost | None = None

    @classmethod
    def build(cls, topo: Topology) -> ChunkService:
        """Create it on the topology's chunk-counter communicator (not
        collective: :func:`hybridagg.init` made that communicator).

        Raises:
            ValueError: A topology without servers.
        """
        if not topo.servers or topo.comms is None:
            raise ValueError("the chunk counter lives on server 0: no servers")
        home = topo.servers[0]
        comm = topo.comms.chunks
        if comm is None:
            return cls(None)
        if topo.rank == home:  # (the highest rank of comm)
            return cls(comm, host=CounterHost(comm, range(topo.num_workers)))
        return cls(comm, client=ServedCounter(comm, comm.size - 1, topo.comms.workers))

    def poll(self) -> None:
        """Server 0: answer the requests that have arrived."""
        if self.host is not None:
            self.host.poll()

    def drain(self, world: Comm) -> None:
        """Wait until every rank has drawn its last chunk (collective over ``world``).

        A worker's loader may still be reading ahead when the servers' loop
        ends; server 0 answers its draws until every worker has closed its
        loader and joined this barrier.
        """
        world.barrier(what="the workers' last chunk draws", poll=self.poll)

    def close(self) -> None:
        """Server 0: stop serving."""
        if self.host is not None:
            self.host.close()
