"""The parameter-server role of ``hybridagg train``: serve, checkpoint, report."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from ..ps.reshard import ShardSource, group_state
from ..ps.server import serve, server_max_sleep
from ..topology import Topology
from .checkpoint import Checkpointer, load_part
from .common import manifest, warm_up_optimizer
from .config import TrainConfig
from .elastic import ReshardPlan
from .metrics import MetricsWriter

__all__ = ["ServerRole"]


class _ServerEvents:
    """What the server loop reports: the start, checkpoints, batch decisions.

    Args:
        cfg: The run's options.
        topo: The topology.
        ck: Writes this rank's checkpoint parts (``None``: no checkpoints).
        metrics: Where ``checkpoint`` and ``batch`` records go.
    """

    def __init__(
        self,
        cfg: TrainConfig,
        topo: Topology,
        ck: Checkpointer | None,
        metrics: MetricsWriter,
    ) -> None:
        self.cfg, self.topo, self.ck, self.metrics = cfg, topo, ck, metrics
        self.start = 0.0
        self._last: dict = {}

    def on_ready(self) -> None:
        """The shards are in place: start the clock with the workers."""
        self.topo.comms.world.barrier(what="start of training")
        self.start = time.perf_counter()

    def on_snapshot(self, number: int, state: dict) -> None:
        """Write this server's part of checkpoint ``number``."""
        t = time.perf_counter()
        self.ck.write(number, {"server": state})
        self._last = state
        self.metrics.write(
            "checkpoint",
            t=t - self.start,
            number=number,
            seconds=time.perf_counter() - t,
            version=state["version"],
        )

    def on_commit(self, number: int) -> None:
        """Server 0: every part is written; publish checkpoint ``number``."""
        state = self._last
        self.ck.commit(
            number,
            manifest(
                self.cfg,
                self.topo,
                version=state["version"],
                done_groups=state["done"],
            ),
        )

    def on_batch(self, version: int, decision) -> None:
        """Server 0 resized the groups' batches."""
        self.metrics.write(
            "batch",
            t=time.perf_counter() - self.start,
            scope="server",
            version=version,
            old=decision.old,
            new=decision.new,
            seconds_per_sample=decision.seconds_per_sample,
        )


class ServerRole:
    """A server rank's part of a training run.

    Args:
        cfg: The run's options.
        topo: The topology.
        resume: The checkpoint to resume from (``None``: a fresh start).
        stop: The process's stop flag.
        plan: How this run's ranks map to the checkpoint's (with ``resume``).
    """

    def __init__(
        self,
        cfg: TrainConfig,
        topo: Topology,
        resume: Path | None,
        stop: threading.Event,
        plan: ReshardPlan | None = None,
    ) -> None:
        self.cfg, self.topo, self.resume, self.stop = cfg, topo, resume, stop
        self.plan = plan

    def _old_part(self, server: int) -> dict:
        """Old server ``server``'s saved state."""
        rank = self.plan.old_server_rank(server)
        part = load_part(self.resume, rank)
        if part is None or "server" not in part:
            raise ValueError(
                f"checkpoint {self.resume} has no part for server rank {rank}"
            )
        return part["server"]

    def _restore(self) -> tuple[dict | None, ShardSource | None]:
        """This server's state in the checkpoint resumed from (``None``: fresh).

        Returns:
            ``(state, None)`` with the checkpoint's number of servers (server
            ``s`` continues old server ``s``), ``(None, source)`` with another
            (every server rebuilds its shard from the old parts it overlaps,
            in :func:`~hybridagg.ps.server.serve`, which alone knows the
            model's size), ``(None, None)`` for a fresh start.
        """
        server_max_sleep()  # a bad value: the same error on every rank, here
        if self.resume is None:
            return None, None
        topo, plan = self.topo, self.plan
        if plan.servers_changed:
            # the parts are read later; a missing one fails here, on every rank
            for s in range(plan.old.servers):
                rank = plan.old_server_rank(s)
                if not (self.resume / f"rank-{rank:05d}.pt").exists():
                    raise ValueError(
                        f"checkpoint {self.resume} has no part for server rank {rank}"
                    )
            return None, ShardSource(
                plan.old.servers, self._old_part, plan.groups_changed
            )
        state = self._old_part(topo.servers.index(topo.rank))
        state = {**state, **group_state(state, topo.num_groups, plan.groups_changed)}
        return state, None

    def run(self) -> None:
        """Serve until every group is done, then report (collective with the workers)."""
        cfg, topo, world = self.cfg, self.topo, self.topo.comms.world
        err, restore, reshard = None, None, None
        ck = Checkpointer(cfg.checkpoint, topo.rank) if cfg.checkpoint else None
        try:
            restore, reshard = self._restore()
        except ValueError as exc:
            err = exc
        world.check(err, what="set-up")  # phase 1: models, checkpoints
        world.check(None, what="data")  # phase 2: the workers' loader
        metrics = MetricsWriter(cfg.metrics, topo.rank)
        warm_up_optimizer(cfg)
        events = _ServerEvents(cfg, topo, ck, metrics)
        first = topo.servers[0] == topo.rank
        stats = serve(
            topo,
            checkpoint_every=cfg.checkpoint_every,
            on_snapshot=events.on_snapshot if ck else None,
            on_commit=events.on_commit if (ck and first) else None,
            stop_requested=self.stop.is_set,
            restore=restore,
            reshard=reshard,
            on_ready=events.on_ready,
            on_batch=events.on_batch,
        )
        metrics.close()
        report = {
            "role": "server",
            "version": stats.version,
            "max_staleness": stats.max_staleness,
            "busy_s": stats.busy_seconds,
        }
        world.allgather(report, what="run report")
        world.barrier(what="metrics written")
        topo.comms.free()
        return None
