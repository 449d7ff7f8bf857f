"""What each step leaves behind: its metrics record, the run's counters, the progress bar."""

from __future__ import annotations

import time

from ...optimizer import DistributedOptimizer
from ...topology import Topology
from ..config import TrainConfig
from ..metrics import MetricsWriter
from ..usage import machine_usage
from .clock import TrainClock
from .step import StepResult

__all__ = ["ProgressBar", "StepLog"]


class StepLog:
    """Owns the per-step record (``step`` events) and the counters of the run's report.

    Args:
        topo: The topology (group, role, leadership).
        sync: Whether the mode is sync (no staleness to count).
        opt: The distributed optimizer (the version each record carries).
        metrics: Where records go.
        clock: The training clock.
        steps: Steps taken before (a resumed run's).
    """

    def __init__(
        self,
        topo: Topology,
        *,
        sync: bool,
        opt: DistributedOptimizer,
        metrics: MetricsWriter,
        clock: TrainClock,
        steps: int,
    ) -> None:
        self.topo, self.sync, self.opt = topo, sync, opt
        self.metrics, self.clock = metrics, clock
        self.steps = steps
        self.samples = 0
        self.busy = 0.0
        self.wait_total = 0.0
        self.stale_sum, self.stale_n = 0, 0
        self.skipped = 0
        # one rank per reduction counts its skipped steps (every rank of it
        # skipped the same ones): rank 0 in sync, each group's leader elsewhere
        self.counts_skips = topo.rank == 0 if sync else topo.is_leader
        self.cpu0 = time.process_time()

    def record(self, r: StepResult, epoch: int) -> None:
        """Count a step and write its record."""
        self.steps += 1
        self.samples += r.samples
        self.busy += r.compute_s + r.pace_s + r.comm_s + r.data_wait_s
        self.wait_total += r.data_wait_s
        self.skipped += int(r.skipped)
        if self.topo.is_leader and r.total_samples > 0 and not self.sync:
            self.stale_sum += r.staleness
            self.stale_n += 1
        self.metrics.write(
            "step",
            t=self.clock.since_start(),
            group=self.topo.group,
            role=self.topo.role,
            step=self.steps,
            version=self.opt.server_version,
            epoch=epoch,
            batch=r.samples,
            compute_s=r.compute_s,
            pace_s=r.pace_s,
            comm_s=r.comm_s,
            reduce_s=r.reduce_s,
            data_wait_s=r.data_wait_s,
            staleness=r.staleness,
            loss=r.loss,
            skipped=r.skipped,
        )

    def report(self, wall_s: float) -> dict:
        """This worker's part of the run report (gathered by rank 0)."""
        return {
            "role": "worker",
            "samples": self.samples,
            "busy_s": self.busy,
            "wait_s": self.wait_total,
            "wall_s": wall_s,
            "stale_sum": self.stale_sum,
            "stale_n": self.stale_n,
            "skipped_updates": self.skipped if self.counts_skips else 0,
            **machine_usage(self.cpu0),
        }


class ProgressBar:
    """Owns rank 0's progress bar: updates, batch, last loss, last accuracy.

    A no-op on other ranks and with ``--no-progress``.

    Args:
        cfg: The run's options.
        rank: This rank.
        version: The version training starts from.
    """

    def __init__(self, cfg: TrainConfig, rank: int, version: int) -> None:
        self.bar = None
        self.last_loss: str | None = None
        if rank != 0 or not cfg.progress:
            return
        from tqdm import tqdm  # only rank 0 draws

        self.bar = tqdm(
            total=cfg.steps,
            initial=version,
            unit="upd",
            mininterval=0.5,
            desc=f"hybridagg {cfg.mode}",
            dynamic_ncols=True,
        )

    def update(
        self, version: int, batch: int, loss: float | None, accuracy: str | None
    ) -> None:
        """Show the state after a step."""
        if self.bar is None:
            return
        self.bar.update(version - self.bar.n)
        if loss is not None:
            self.last_loss = f"{loss:.3f}"
        self.bar.set_postfix(
            batch=batch, loss=self.last_loss, acc=accuracy, refresh=False
        )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
