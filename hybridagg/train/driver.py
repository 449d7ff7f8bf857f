"""The training driver behind ``hybridagg train``: it only wires the layers.

One call of :func:`train` on every rank of the job. Servers serve
(:class:`~hybridagg.train.server_role.ServerRole`); workers iterate their
share of the data, emulate their speed, step the
:class:`~hybridagg.optimizer.DistributedOptimizer`, validate (rank 0),
checkpoint and log (:class:`~hybridagg.train.worker.WorkerRole`). Whether
the run starts fresh or resumes, and from which checkpoint, is decided first
(:mod:`~hybridagg.train.resume`). Errors in the set-up (a bad data file, a
checkpoint folder of another run, a changed configuration) become the same
error on every rank before any training collective starts.
"""

from __future__ import annotations

from ..runtime.signals import stop_flag
from ..topology import init
from .checkpoint import Checkpointer
from .config import TrainConfig
from .resume import start_run
from .server_role import ServerRole
from .worker import WorkerRole

__all__ = ["train"]


def train(cfg: TrainConfig, comm=None) -> dict | None:
    """Run one training job (collective over ``comm``, default ``COMM_WORLD``).

    Returns:
        The run's summary on rank 0, ``None`` elsewhere.

    Raises:
        ValueError, TypeError, FileNotFoundError: A bad option, data file or
            checkpoint; the same error on every rank.
    """
    stop = stop_flag()
    topo = init(
        comm, groups=cfg.group_spec, servers=cfg.num_servers, slowdown=cfg.slowdown
    )
    world = topo.comms.world
    err = None
    try:
        cfg.parsed_slowdown().validate_workers(topo.num_workers)
    except ValueError as exc:
        err = exc
    world.check(err, what="--slowdown")
    start = start_run(cfg, topo)
    ck = None
    if cfg.checkpoint:
        ck = Checkpointer(
            cfg.checkpoint,
            topo.rank,
            start.run_id,
            replace_others=cfg.overwrite_checkpoints,
        )
        if world.rank == 0:
            ck.remove_stale()  # parts of a killed run
    if topo.is_server:
        return ServerRole(cfg, topo, start, ck, stop).run()
    return WorkerRole(cfg, topo, start, ck, stop).run()
