"""The training driver behind ``hybridagg train``: it only wires the layers.

One call of :func:`train` on every rank of the job. Servers serve
(:class:`~hybridagg.train.server_role.ServerRole`); workers iterate their
share of the data, emulate their speed, step the
:class:`~hybridagg.optimizer.DistributedOptimizer`, validate (rank 0),
checkpoint and log (:class:`~hybridagg.train.worker.WorkerRole`). Errors in
the set-up (a bad data file, a checkpoint of another model) become the same
error on every rank before any training collective starts.
"""

from __future__ import annotations

from pathlib import Path

from ..runtime.signals import stop_flag
from ..topology import Topology, init
from .checkpoint import Checkpointer, latest_checkpoint, read_manifest
from .chunks import ChunkService, check_fault_tolerance
from .common import check_manifest
from .config import TrainConfig
from .server_role import ServerRole
from .survival import RankStatus
from .worker import WorkerRole

__all__ = ["run", "train"]


def _find_resume(cfg: TrainConfig, topo: Topology) -> tuple[Path | None, dict | None]:
    world = topo.comms.world
    err, found = None, None
    if cfg.resume and world.rank == 0:
        found = latest_checkpoint(cfg.checkpoint)
    found = world.bcast(None if found is None else str(found), 0, what="resume path")
    manifest = None
    if found is not None:
        try:
            manifest = read_manifest(Path(found))
            check_manifest(manifest, cfg, topo, Path(found))
        except ValueError as exc:
            err = exc
    world.check(err, what="checkpoint to resume from")
    return (Path(found) if found else None), manifest


def train(cfg: TrainConfig, comm=None) -> dict | None:
    """Run one training job (collective over ``comm``, default ``COMM_WORLD``).

    Returns:
        The run's summary on rank 0 (with ``--on-group-failure continue``: on
        the rank that wrote it), ``None`` elsewhere.

    Raises:
        ValueError, TypeError, FileNotFoundError: A bad option, data file or
            checkpoint; the same error on every rank.
    """
    return run(cfg, comm)[0]


def run(cfg: TrainConfig, comm=None) -> tuple[dict | None, RankStatus | None]:
    """:func:`train`, also returning this rank's status.

    Returns:
        The summary (or ``None``) and, with ``--on-group-failure continue``,
        this rank's :class:`~hybridagg.train.survival.RankStatus` (its exit
        code and why); ``None`` otherwise.
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
    if cfg.survives_group_loss:
        check_fault_tolerance(world)  # after MPI init: the same verdict everywhere
    resume, manifest = _find_resume(cfg, topo)
    if cfg.checkpoint and world.rank == 0:
        Checkpointer(cfg.checkpoint, 0).remove_stale()  # parts of a killed run
    chunks = ChunkService.build(topo) if cfg.survives_group_loss else None
    if topo.is_server:
        role = ServerRole(cfg, topo, resume, stop, chunks)
    else:
        role = WorkerRole(cfg, topo, resume, manifest, stop, chunks)
    summary = role.run()
    return summary, role.status
