"""The training driver behind ``hybridagg train``: it only wires the layers.

One call of :func:`train` on every rank of the job. Servers serve
(:class:`~hybridagg.train.server_role.ServerRole`); workers iterate their
share of the data, emulate their speed, step the
:class:`~hybridagg.optimizer.DistributedOptimizer`, validate (rank 0),
checkpoint and log (:class:`~hybridagg.train.worker.WorkerRole`). Whether
the run starts fresh or resumes, and from which checkpoint, is decided first
(:mod:`~hybridagg.train.resume`). Errors in the set-up (a bad data file, a
checkpoint folder of another run, a changed configuration) become the same
error on every rank before any training collective starts. A checkpoint
written with other ranks, servers or groups is resharded
(:mod:`~hybridagg.train.elastic`).

A :class:`~hybridagg.comm.Heartbeat` runs for the whole run: a dead or stuck
rank is found within ``HYBRIDAGG_FAILURE_TIMEOUT`` and every rank exits 5,
the rank that found it naming the dead one and its role.
"""

from __future__ import annotations

import functools
import logging

from ..comm import Heartbeat, end_job, is_peer_failure, solo
from ..comm.liveness import failure_timeout, solo_work_timeout
from ..devices import device_summary
from ..runtime import logs
from ..runtime.outcomes import PeerFailure
from ..runtime.signals import stop_flag
from ..topology import Topology, init
from .checkpoint import Checkpointer
from .chunks import ChunkService, check_fault_tolerance, job_counter_home
from .config import TrainConfig
from .pipelined import PipelinedWorkerRole
from .resume import start_run
from .server_role import ServerRole
from .survival import RankStatus
from .worker import WorkerRole

__all__ = ["run", "train"]


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
        comm,
        groups=cfg.group_spec,
        servers=cfg.num_servers,
        slowdown=cfg.slowdown,
        device=cfg.device,
    )
    # (the command line installed the handler; called from Python, init() did)
    logging.getLogger(logs.LOGGER).setLevel(logs.level_of(cfg.log_level, "--log-level"))
    if topo.rank == 0:
        logging.getLogger(__name__).info("devices: %s", device_summary(topo.devices))
    err = None
    try:  # a bad value: the same error on every rank, before the collective start
        failure_timeout()
        solo_work_timeout()
    except ValueError as exc:
        err = exc
    topo.comms.world.check(err, what="the heartbeat's settings")
    if cfg.survives_group_loss:
        # ULFM reports a dead rank (within a second) and the survivors go on:
        # a heartbeat's verdict would end the job they are keeping alive, and
        # its ring would break at the first death
        return _run(cfg, topo, stop)
    heartbeat = Heartbeat(
        topo.comms.world.mpi,
        describe=topo.describe_rank,
        on_failure=functools.partial(end_job, program="hybridagg train"),
    )
    try:
        result = _run(cfg, topo, stop)
    except BaseException as exc:
        if not (isinstance(exc, PeerFailure) or is_peer_failure(exc)):
            heartbeat.stop()  # this rank leaves: its successor must not mourn it
        raise
    heartbeat.free()
    return result


def _run(
    cfg: TrainConfig, topo: Topology, stop
) -> tuple[dict | None, RankStatus | None]:
    world = topo.comms.world
    err = None
    try:
        cfg.parsed_slowdown().validate_workers(topo.num_workers)
    except ValueError as exc:
        err = exc
    world.check(err, what="--slowdown")
    if cfg.survives_group_loss:
        check_fault_tolerance(world)  # after MPI init: the same verdict everywhere
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
            with solo("removing a killed run's checkpoint parts"):
                ck.remove_stale()
    home = job_counter_home(cfg, topo)
    if home is not None:
        logging.getLogger(__name__).info(
            "the workers draw their data's chunks from %s",
            "parameter server 0" if home == "server" else "a window on worker 0",
        )
    chunks = ChunkService.build(topo) if home == "server" else None
    if topo.is_server:
        role = ServerRole(cfg, topo, start, ck, stop, chunks)
    elif cfg.pipelined:  # every worker holds a stage of its group's replica
        role = PipelinedWorkerRole(cfg, topo, start, ck, stop, chunks)
    else:
        role = WorkerRole(cfg, topo, start, ck, stop, chunks)
    summary = role.run()
    return summary, role.status
