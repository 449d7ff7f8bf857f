"""The training driver behind ``hybridagg train``: it only wires the layers.

One call of :func:`train` on every rank of the job. Servers serve
(:class:`~hybridagg.train.server_role.ServerRole`); workers iterate their
share of the data, emulate their speed, step the
:class:`~hybridagg.optimizer.DistributedOptimizer`, validate (rank 0),
checkpoint and log (:class:`~hybridagg.train.worker.WorkerRole`). Errors in
the set-up (a bad data file, a checkpoint of another model) become the same
error on every rank before any training collective starts. A checkpoint
written with other ranks, servers or groups is resharded
(:mod:`~hybridagg.train.elastic`).
"""

from __future__ import annotations

from pathlib import Path

from ..runtime.signals import stop_flag
from ..topology import Topology, init
from .checkpoint import Checkpointer, latest_checkpoint, read_manifest
from .common import check_manifest
from .config import TrainConfig
from .elastic import Layout, ReshardPlan, reshard_plan
from .server_role import ServerRole
from .worker import WorkerRole

__all__ = ["train"]


def _find_resume(
    cfg: TrainConfig, topo: Topology
) -> tuple[Path | None, dict | None, ReshardPlan | None]:
    world = topo.comms.world
    err, found = None, None
    if cfg.resume and world.rank == 0:
        found = latest_checkpoint(cfg.checkpoint)
    found = world.bcast(None if found is None else str(found), 0, what="resume path")
    manifest, plan = None, None
    if found is not None:
        try:
            manifest = read_manifest(Path(found))
            check_manifest(manifest, cfg, topo, Path(found))
            plan = reshard_plan(manifest, Layout.of(topo), Path(found))
        except ValueError as exc:
            err = exc
    world.check(err, what="checkpoint to resume from")
    return (Path(found) if found else None), manifest, plan


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
    resume, manifest, plan = _find_resume(cfg, topo)
    if cfg.checkpoint and world.rank == 0:
        Checkpointer(cfg.checkpoint, 0).remove_stale()  # parts of a killed run
    if topo.is_server:
        return ServerRole(cfg, topo, resume, stop, plan).run()
    return WorkerRole(cfg, topo, resume, manifest, stop, plan).run()
