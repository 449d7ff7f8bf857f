"""The parameter-server role of ``hybridagg train``: serve, checkpoint, report."""

from __future__ import annotations

import time

from ..ps.server import serve, server_max_sleep
from .checkpoint import Checkpointer, load_part
from .common import manifest, warm_up_optimizer
from .metrics import MetricsWriter

__all__ = ["ServerRole"]


class ServerRole:
    """A server rank's part of a training run."""

    def __init__(self, cfg, topo, resume, stop) -> None:
        self.cfg, self.topo, self.resume, self.stop = cfg, topo, resume, stop

    def run(self) -> None:
        cfg, topo, world = self.cfg, self.topo, self.topo.comms.world
        err, restore = None, None
        ck = Checkpointer(cfg.checkpoint, topo.rank) if cfg.checkpoint else None
        try:
            server_max_sleep()  # a bad value: the same error on every rank, here
            if self.resume is not None:
                part = load_part(self.resume, topo.rank)
                if part is None:
                    raise ValueError(
                        f"checkpoint {self.resume} has no part for server rank {topo.rank}"
                    )
                restore = part["server"]
        except ValueError as exc:
            err = exc
        world.check(err, what="set-up")  # phase 1: models, checkpoints
        world.check(None, what="data")  # phase 2: the workers' loader
        metrics = MetricsWriter(cfg.metrics, topo.rank)
        warm_up_optimizer(cfg)
        clock: dict = {}
        last: dict = {}

        def on_ready() -> None:
            world.barrier(what="start of training")
            clock["start"] = time.perf_counter()

        def on_snapshot(number: int, state: dict) -> None:
            t = time.perf_counter()
            ck.write(number, {"server": state})
            last["state"] = state
            metrics.write(
                "checkpoint",
                t=t - clock["start"],
                number=number,
                seconds=time.perf_counter() - t,
                version=state["version"],
            )

        def on_commit(number: int) -> None:
            state = last["state"]
            ck.commit(
                number,
                manifest(
                    cfg, topo, version=state["version"], done_groups=state["done"]
                ),
            )

        def on_batch(version: int, decision) -> None:
            metrics.write(
                "batch",
                t=time.perf_counter() - clock["start"],
                scope="server",
                version=version,
                old=decision.old,
                new=decision.new,
                seconds_per_sample=decision.seconds_per_sample,
            )

        first = topo.servers[0] == topo.rank
        stats = serve(
            topo,
            checkpoint_every=cfg.checkpoint_every,
            on_snapshot=on_snapshot if ck else None,
            on_commit=on_commit if (ck and first) else None,
            stop_requested=self.stop.is_set,
            restore=restore,
            on_ready=on_ready,
            on_batch=on_batch,
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
