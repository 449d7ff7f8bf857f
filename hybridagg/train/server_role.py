"""The parameter-server role of ``hybridagg train``: serve, checkpoint, report."""

from __future__ import annotations

import threading
import time

from ..comm import solo
from ..ps.server import serve, server_max_sleep
from ..topology import Topology
from .checkpoint import Checkpointer
from .common import manifest, warm_up_optimizer
from .config import TrainConfig
from .metrics import MetricsWriter
from .resume import RunStart
from .worker.role import raise_if_nonfinite

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
        # the leaders wait for this server meanwhile (servers are few, so
        # each one announcing its write costs little)
        with solo(f"writing its part of checkpoint {number}"):
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
        with solo(f"committing checkpoint {number}"):
            self.ck.commit(
                number,
                manifest(
                    self.cfg,
                    self.topo,
                    version=state["version"],
                    done_groups=state["done"],
                    # the flat model's size: a run with another number of
                    # servers reads only the old parts its shard overlaps
                    elements=state["shard"]["elements"],
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
        start: How the run starts (its id, the checkpoint it resumes from:
            the old server parts this server continues from are already
            loaded, by the reshard plan).
        ck: Writes this rank's checkpoint parts (``None``: no checkpoints).
        stop: The process's stop flag.
    """

    def __init__(
        self,
        cfg: TrainConfig,
        topo: Topology,
        start: RunStart,
        ck: Checkpointer | None,
        stop: threading.Event,
    ) -> None:
        self.cfg, self.topo, self.start, self.ck = cfg, topo, start, ck
        self.stop = stop

    def run(self) -> None:
        """Serve until every group is done, then report (collective with the workers)."""
        cfg, topo, world, ck = self.cfg, self.topo, self.topo.comms.world, self.ck
        err = None
        resumed = self.start.resumed
        restore, reshard = None, None
        if resumed is not None:
            # the checkpoint's number of servers: its own old part; another:
            # the old parts it overlaps, its shard rebuilt in serve()
            restore, reshard = resumed.server.state, resumed.server.shards
        try:
            server_max_sleep()  # a bad value: the same error on every rank, here
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
            "nonfinite": None
            if stats.nonfinite is None
            else (
                f"server rank {topo.rank} stopped every group at version "
                f"{stats.version}: group {stats.nonfinite}'s loss or gradient "
                "was not finite"
            ),
        }
        reports = world.allgather(report, what="run report")
        world.barrier(what="metrics written")
        topo.comms.free()
        raise_if_nonfinite(reports)  # (the same on every rank)
        return None
