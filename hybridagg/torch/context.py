"""The job a Horovod script runs in: ``init``, ``shutdown`` and the rank queries.

Horovod keeps its state per process and every call finds it; so does this
module (the one place in hybridagg where that is so: a Horovod script
passes no communicator). :func:`init` reads the layout from the environment
(:mod:`.settings`), forms hybridagg's topology (which later library calls
without ``topology=`` find too) and, on the parameter-server ranks of hybrid
and async mode, serves until every group is done and then ends the process
with exit code 0: the script's training code never runs there. On the
workers, the optimizers a script made are finished when it calls
:func:`shutdown`, or when the process exits (Horovod scripts rarely call
``shutdown()``): that tells the servers the group is done, and in hybrid and
async mode rank 0's model then holds the servers' final weights.
"""

from __future__ import annotations

import atexit
from dataclasses import dataclass, field

from ..comm import Comm
from ..runtime.outcomes import NonFiniteError
from ..topology import Topology, forget_topology
from ..topology import init as init_topology
from .settings import JobSettings, settings_from_env

__all__ = [
    "Job",
    "cross_rank",
    "cross_size",
    "current_job",
    "init",
    "is_initialized",
    "local_rank",
    "local_size",
    "rank",
    "shutdown",
    "size",
]


@dataclass
class Job:
    """This worker's place in the job, and what it must finish at the end.

    Attributes:
        topology: From :func:`hybridagg.init`, on a worker.
        settings: The mode, groups and servers it was formed with.
        optimizers: The Horovod-style optimizers made here, finished at
            :func:`shutdown` (in hybrid and async mode at most one).
    """

    topology: Topology
    settings: JobSettings
    optimizers: list = field(default_factory=list)
    _scope_comm: Comm | None = None

    @property
    def mode(self) -> str:
        """``"sync"``, ``"hybrid"`` or ``"async"``."""
        return self.settings.mode

    @property
    def workers(self) -> Comm:
        """Every worker (Horovod's global communicator)."""
        return self.topology.comms.workers

    def scope(self) -> Comm:
        """A communicator of its own over the ranks one gradient update spans:
        every worker in sync mode, this worker's group in hybrid and async
        (created at its first use, collectively over those ranks)."""
        if self._scope_comm is None:
            comms = self.topology.comms
            base = comms.workers if self.mode == "sync" else comms.group
            self._scope_comm = base.dup("hvd.scope")
        return self._scope_comm

    def _worker_hosts(self) -> list[str]:
        topo = self.topology
        hosts = topo.hosts or ("localhost",) * topo.world_size
        return [hosts[r] for r in topo.workers]


_JOB: Job | None = None


def init(comm=None, process_sets=None) -> None:
    """Start hybridagg for a Horovod script (collective over ``comm``).

    Reads ``HYBRIDAGG_MODE``, ``HYBRIDAGG_GROUPS`` and ``HYBRIDAGG_SERVERS``
    (see :func:`~hybridagg.torch.settings.settings_from_env`); a bad or
    disagreeing value is the same ``ValueError`` on every rank. On a
    parameter-server rank this call serves until training ends and then
    exits the process (status 0). A second call does nothing.

    Args:
        comm: An mpi4py communicator (default ``COMM_WORLD``), or a list of
            world ranks as Horovod accepts, which is refused here.
        process_sets: Horovod's process sets: not supported (``None`` only).

    Raises:
        ValueError: A bad setting, or process sets.
        TypeError: ``comm`` is not an mpi4py communicator.
    """
    global _JOB
    if _JOB is not None:
        return
    if process_sets not in (None, [], ()):
        raise ValueError(
            "hybridagg.torch.init: process sets are not supported; hybridagg's "
            "groups come from HYBRIDAGG_GROUPS"
        )
    if isinstance(comm, (list, tuple)):
        raise ValueError(
            "hybridagg.torch.init: a list of ranks is not supported; pass an "
            "mpi4py communicator (or nothing, for COMM_WORLD)"
        )
    settings, error = None, None
    agree = Comm(comm, name="hybridagg.torch.init")
    try:
        settings = settings_from_env()
    except (TypeError, ValueError) as exc:
        error = exc
    try:
        agree.check(error, what="HYBRIDAGG_MODE, HYBRIDAGG_GROUPS, HYBRIDAGG_SERVERS")
        everyone = agree.allgather(settings, what="Horovod job settings")
    finally:
        agree.free()
    if len(set(everyone)) != 1:
        detail = ", ".join(f"rank {r}: {s}" for r, s in enumerate(everyone))
        raise ValueError(f"ranks disagree on HYBRIDAGG_MODE/GROUPS/SERVERS: {detail}")
    topo = init_topology(comm, groups=settings.groups, servers=settings.servers)
    if settings.mode == "async" and any(len(g) > 1 for g in topo.groups):
        # (a spec such as "node" shows its layout only now; the same verdict
        # on every rank, servers included, since every rank sees the groups)
        raise ValueError(
            f"HYBRIDAGG_MODE=async puts every worker in its own group, but "
            f"HYBRIDAGG_GROUPS={settings.groups} formed {[list(g) for g in topo.groups]}"
        )
    if topo.is_server:
        _serve_and_exit(topo)
    _JOB = Job(topo, settings)
    atexit.register(_finish_at_exit)


def _serve_and_exit(topo: Topology) -> None:
    """A server rank: serve until every group is done, then end the process."""
    from ..ps.server import serve

    stats = serve(topo)
    forget_topology(topo)
    if stats.nonfinite is not None:  # (the workers raise it too)
        raise NonFiniteError(
            f"group {stats.nonfinite}'s loss or gradient was not finite; "
            "training stopped"
        )
    raise SystemExit(0)


def shutdown() -> None:
    """Finish this worker's optimizers (collective over the workers) and forget the job.

    In hybrid and async mode the group leaders tell the servers they are
    done; rank 0's model then holds the servers' final weights. Called at
    exit when the script does not call it. A second call does nothing.
    """
    global _JOB
    job = _JOB
    if job is None:
        return
    _JOB = None
    try:
        for opt in job.optimizers:
            opt.finish()
        job.optimizers.clear()
    finally:
        if job._scope_comm is not None:
            job._scope_comm.free()
        forget_topology(job.topology)


def _finish_at_exit() -> None:
    # (runs before mpi4py finalizes MPI, which it does after every atexit
    # handler: this one was registered after mpi4py.MPI was imported)
    shutdown()


def is_initialized() -> bool:
    """Whether :func:`init` ran (and :func:`shutdown` did not)."""
    return _JOB is not None


def current_job() -> Job:
    """The job :func:`init` formed.

    Raises:
        ValueError: :func:`init` was not called (Horovod's message).
    """
    if _JOB is None:
        raise ValueError("hybridagg.torch has not been initialized; use hvd.init()")
    return _JOB


def rank() -> int:
    """This worker's rank among the workers (servers are not counted)."""
    return current_job().workers.rank


def size() -> int:
    """Number of workers (servers are not counted)."""
    return current_job().workers.size


def local_rank() -> int:
    """This worker's index among the workers on its node."""
    job = current_job()
    hosts = job._worker_hosts()
    mine = hosts[job.topology.rank]
    return [r for r, h in enumerate(hosts) if h == mine].index(job.topology.rank)


def local_size() -> int:
    """Number of workers on this worker's node."""
    job = current_job()
    hosts = job._worker_hosts()
    return hosts.count(hosts[job.topology.rank])


def cross_rank() -> int:
    """Index of this worker's node among the nodes with workers (first-rank order)."""
    job = current_job()
    hosts = job._worker_hosts()
    return list(dict.fromkeys(hosts)).index(hosts[job.topology.rank])


def cross_size() -> int:
    """Number of nodes with workers."""
    return len(set(current_job()._worker_hosts()))
