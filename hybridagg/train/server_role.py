"""The parameter-server role of ``hybridagg train``: serve, checkpoint, report."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from ..comm import solo
from ..ps.server import ServerStats, serve, server_max_sleep
from ..runtime.outcomes import ExitCode, PeerFailure
from ..topology import Topology
from .checkpoint import Checkpointer
from .chunks import ChunkService
from .common import manifest, warm_up_optimizer
from .config import TrainConfig
from .faults import kill_at
from .metrics import MetricsWriter
from .pipelined.exchange import stage_ps_comm
from .pipelined.role import join_probe
from .resume import RunStart
from .survival import FATAL, OK, Ending, RankStatus, end_of_run
from .usage import machine_usage
from .worker.report import nonfinite_reason
from .worker.role import raise_if_nonfinite

__all__ = ["ServerRole"]


class _ServerEvents:
    """What the server loop reports: the start, checkpoints, batch decisions.

    Args:
        cfg: The run's options.
        topo: The topology.
        ck: Writes this rank's checkpoint parts (``None``: no checkpoints).
        metrics: Where ``checkpoint`` and ``batch`` records go.
        poll: Server 0's chunk counter, answered while it waits at the start
            (``None``: no counter here).
    """

    def __init__(
        self,
        cfg: TrainConfig,
        topo: Topology,
        ck: Checkpointer | None,
        metrics: MetricsWriter,
        poll: Callable[[], object] | None = None,
    ) -> None:
        self.cfg, self.topo, self.ck, self.metrics = cfg, topo, ck, metrics
        self.poll = poll
        self.start = 0.0
        self.cpu0 = time.process_time()  # reset at the start of training
        self._last: dict = {}

    def on_ready(self) -> None:
        """The shards are in place: start the clock with the workers."""
        # (server 0 answers chunk draws meanwhile: the workers' loaders
        # read ahead from before the barrier)
        self.topo.comms.world.barrier(what="start of training", poll=self.poll)
        self.start = time.perf_counter()
        self.cpu0 = time.process_time()

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

    def on_drop(self, group: int, dead_rank: int) -> None:
        """A group was dropped after one of its ranks died (``continue``)."""
        self.metrics.write(
            "group_lost",
            t=time.perf_counter() - self.start,
            group=group,
            ranks=list(self.topo.groups[group]),
            dead_rank=dead_rank,
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


def _server_report(stats: ServerStats, rank: int, cpu0: float) -> dict:
    """A server's run report (gathered by every rank at the end)."""
    return {
        **machine_usage(cpu0),
        "role": "server",
        "version": stats.version,
        "max_staleness": stats.max_staleness,
        "busy_s": stats.busy_seconds,
        "nonfinite": None
        if stats.nonfinite is None
        else (
            f"server rank {rank} stopped every group at version "
            f"{stats.version}: group {stats.nonfinite}'s loss or gradient "
            "was not finite"
        ),
    }


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
        chunks: The chunk counter, where server 0 holds it
            (:func:`hybridagg.train.chunks.counter_home`).

    Attributes:
        status: With ``continue``, how this rank ends (set by :meth:`run`).
    """

    def __init__(
        self,
        cfg: TrainConfig,
        topo: Topology,
        start: RunStart,
        ck: Checkpointer | None,
        stop: threading.Event,
        chunks: ChunkService | None = None,
    ) -> None:
        self.cfg, self.topo, self.start, self.ck = cfg, topo, start, ck
        self.stop = stop
        self.chunks = chunks
        self.status: RankStatus | None = None

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
        if cfg.pipelined:  # the stages' links and cut
            join_probe(cfg, world)
        # phase 2: the workers' loader (which may draw chunks from server 0)
        world.check(None, what="data", poll=self.chunks.poll if self.chunks else None)
        if cfg.pipelined:
            world.check(None, what="the stages")
        metrics = MetricsWriter(cfg.metrics, topo.rank)
        warm_up_optimizer(cfg)
        events = _ServerEvents(
            cfg, topo, ck, metrics, self.chunks.poll if self.chunks else None
        )
        first = topo.servers[0] == topo.rank
        common = {  # what serve() takes whether or not groups may be lost
            "checkpoint_every": cfg.checkpoint_every,
            "on_snapshot": events.on_snapshot if ck else None,
            "on_commit": events.on_commit if (ck and first) else None,
            "stop_requested": self.stop.is_set,
            "restore": restore,
            "reshard": reshard,
            "on_ready": events.on_ready,
            "on_batch": events.on_batch,
        }
        if cfg.survives_group_loss:
            return self._serve_surviving(events, metrics, common)
        ps = None
        if cfg.pipelined:  # the stages send and receive their own parts
            ps = stage_ps_comm(world, topo.groups, topo.servers)
        chunks = self.chunks
        stats = serve(topo, **common, ps=ps, poll=chunks.poll if chunks else None)
        if ps is not None:
            ps.free()
        if chunks is not None:
            chunks.drain(world)
            chunks.close()
        metrics.close()
        report = _server_report(stats, topo.rank, events.cpu0)
        reports = world.allgather(report, what="run report")
        world.barrier(what="metrics written")
        topo.comms.free()
        raise_if_nonfinite(reports)  # (the same on every rank)
        return None

    # --- --on-group-failure continue ------------------------------------------
    def _serve_surviving(
        self,
        events: _ServerEvents,
        metrics: MetricsWriter,
        common: dict,
    ) -> None:
        """Serve, dropping lost groups; then end with the other survivors.

        ``common`` holds :func:`serve`'s arguments shared with the plain run.
        """
        topo, chunks = self.topo, self.chunks
        box: dict = {}

        def final_to(stats: ServerStats) -> int | None:
            lost = {
                g: (t - events.start, dead)
                for g, (t, dead) in stats.lost_groups.items()
            }
            mine = Ending(
                topo.rank,
                "server",
                OK,
                report=_server_report(stats, topo.rank, events.cpu0),
                lost_groups=lost,
            )
            box["end"] = end_of_run(topo, mine, poll=chunks.poll)
            box["mine"] = mine
            verdict = box["end"][2]
            if verdict.reporter is None:
                return None
            return topo.group_of(verdict.reporter)  # its leader's rank on ps

        try:
            serve(
                topo,
                **common,
                drop_lost=True,
                on_drop=events.on_drop,
                poll=chunks.poll,
                final_to=final_to,
                fault=lambda version: kill_at(topo.rank, version),
            )
        except PeerFailure as exc:
            if "end" in box:  # (a failure after the agreement: nothing to redo)
                raise
            mine = Ending(topo.rank, "server", FATAL, str(exc), exc.ranks)
            box["end"] = end_of_run(topo, mine, poll=chunks.poll)
            box["mine"] = mine
        chunks.close()
        metrics.close()
        survivors, endings, verdict = box["end"]
        self.status = verdict.status_of(box["mine"])
        stopped = nonfinite_reason([e.report for e in endings if e.report])
        if stopped is not None:  # (every survivor says so, code 3)
            self.status = RankStatus(ExitCode.NON_FINITE, f"stopped: {stopped}")
        survivors.barrier(what="metrics written")
        survivors.barrier(what="end of the run")  # (the summary is written)
        survivors.free()
        return None
