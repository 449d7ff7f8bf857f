"""The worker role of ``hybridagg train``: it wires the worker's parts together.

Set-up (:mod:`.setup`) passes two world-level agreements, so a bad model,
data file or checkpoint stops every rank with one message. Then each step
(:mod:`.step`) is recorded (:mod:`.progress`), feeds the adaptive batches,
validation (:mod:`.validation`), the epoch count (:mod:`.epochs`),
checkpoints (:mod:`.checkpoints`) and the stop signal (:mod:`.stopping`);
at the end rank 0 merges the metrics and writes the summary (:mod:`.report`).

A NaN or infinite loss or reduced gradient ends the step loop on every
worker of the reduction at the same step (in hybrid and async mode the
servers stop the other groups); the run then winds down as at its end, but
writes no checkpoint and no summary, and every rank, servers included,
raises the same :class:`~hybridagg.runtime.outcomes.NonFiniteError` after
the world's run report (which carries the reason to every rank).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch

from ...comm import Comm, solo
from ...optimizer import broadcast_parameters
from ...runtime.outcomes import NonFiniteError
from ...topology import Topology
from ..adaptive import AdaptiveBatches
from ..board import Board
from ..checkpoint import Checkpointer
from ..chunks import ChunkService
from ..common import rng_state
from ..config import TrainConfig
from ..elastic import ReshardPlan
from ..emulation import Pacer
from ..export import save_state_dict
from ..faults import at_step
from ..losses import loss_function
from ..metrics import MetricsWriter, merge_parts
from ..resume import RunStart
from ..survival import RankStatus
from .checkpoints import WorkerCheckpoints
from .clock import TrainClock
from .epochs import Epochs
from .progress import ProgressBar, StepLog
from .report import nonfinite_reason, publish, summarize
from .setup import Local, make_distributed_optimizer, make_loader, set_up_local
from .step import LOSS, MORE, SAMPLES, Stepper
from .stopping import StopSignal
from .surviving import SurvivingWorker
from .validation import Validation

__all__ = ["WorkerRole", "agreed", "raise_if_nonfinite"]

T = TypeVar("T")

log = logging.getLogger(__name__)


def agreed(world: Comm, what: str, build: Callable[[], T]) -> T:
    """Run a set-up phase; a failure on any rank is the same error on every rank."""
    err, value = None, None
    try:
        value = build()
    except (ValueError, TypeError, OSError) as exc:
        err = exc
    world.check(err, what=what)
    return value


def raise_if_nonfinite(reports: list[dict]) -> None:
    """Raise the run's :class:`NonFiniteError` if any rank's report names one.

    Every rank (workers and servers) calls it on the same gathered reports,
    so every rank raises the same error. A rank that found the NaN itself is
    preferred over one that was told of it.

    Raises:
        NonFiniteError: The first such reason, by rank.
    """
    reason = nonfinite_reason(reports)
    if reason is not None:
        raise NonFiniteError(reason)


class WorkerRole:
    """A worker rank's part of a training run.

    Args:
        cfg: The run's options.
        topo: The topology.
        start: How the run starts (its id, the checkpoint it resumes from:
            this worker's parts are already loaded, by the reshard plan).
        ck: Writes this rank's checkpoint parts (``None``: no checkpoints).
        stop: The process's stop flag.
        chunks: The chunk counter served by server 0, where it lives there
            (:func:`hybridagg.train.chunks.counter_home`; with
            ``--on-group-failure continue``, :mod:`.surviving` ends the run).

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
        self.resumed = start.resumed
        self.resume: Path | None = start.resumed.path if start.resumed else None
        self.plan: ReshardPlan | None = start.resumed.plan if start.resumed else None
        self.stop = stop
        self.rank = topo.rank
        self.world = topo.comms.world
        self.nonfinite: str | None = None
        """Why training stopped on a NaN or an infinity, naming the step."""
        self.nonfinite_own = False
        """Whether this worker's reduction found it (not told by the servers)."""
        self.chunks = chunks
        self.status: RankStatus | None = None

    def run(self) -> dict | None:
        """Train; returns the summary on rank 0, ``None`` elsewhere."""
        cfg, topo, world = self.cfg, self.topo, self.world
        local = agreed(world, "set-up", lambda: set_up_local(cfg, topo, self.resumed))
        self.model, self.optimizer = local.model, local.optimizer
        self.precision = local.precision
        counter = self.chunks.client if self.chunks is not None else None
        self.loader = agreed(
            world, "data", lambda: make_loader(cfg, topo, local, self.resumed, counter)
        )
        if local.part is None and not local.done_already:
            broadcast_parameters(self.model.state_dict(), 0, topo)
        self.metrics = MetricsWriter(cfg.metrics, self.rank)
        ck = self.ck
        self.opt = make_distributed_optimizer(cfg, topo, local)
        world.barrier(what="start of training")
        start = time.perf_counter()
        log.info(
            "hybridagg train: %s mode, %d workers in groups %s, %d servers; model "
            "%s, loss %s",
            cfg.mode,
            topo.num_workers,
            [list(g) for g in topo.groups],
            len(topo.servers),
            cfg.model,
            cfg.loss,
        )
        self.adaptive = AdaptiveBatches(
            cfg, topo, self.opt, self.loader, self.metrics, start
        )
        self._wire(local, ck, start)
        if self.rank == 0 and self.resharded is not None:
            self.metrics.write("reshard", t=0.0, **self.resharded)
        if cfg.survives_group_loss:
            return SurvivingWorker(self).run(local)
        if not local.done_already:
            self._train()
        self._finish()
        if self.chunks is not None:
            self.chunks.drain(world)
        if local.evaluator is not None:
            local.evaluator.close()
        return self._report()

    def _wire(self, local: Local, ck: Checkpointer | None, start: float) -> None:
        """Restore the resumed run's counters into the parts of the step loop."""
        cfg, topo, opt = self.cfg, self.topo, self.opt
        part = local.part or {}
        sync = cfg.mode == "sync"
        self.rows = (  # the world rank of each row of the shared values
            list(range(topo.num_workers)) if sync else sorted(topo.groups[topo.group])
        )
        self.board = Board(
            cfg.tensorboard,
            rank=self.rank,
            group=topo.group,
            is_leader=topo.is_leader,
            members=self.rows,
        )
        self.clock = TrainClock(start, float(part.get("train_time_s", 0.0)))
        if sync:
            opt.updates = int(part.get("updates", 0))
        elif self.resume is not None and not local.done_already:
            opt.refresh_from_servers()
        done = int(part.get("epochs_done", 0))
        if self.plan is not None and self.plan.workers_changed:
            # the position was divided anew: every worker is in the loader's epoch
            done = self.loader.epoch
        self.epochs = Epochs(self.loader, cfg.max_epochs, done)
        self.log = StepLog(
            topo,
            sync=sync,
            opt=opt,
            metrics=self.metrics,
            clock=self.clock,
            steps=int(part.get("step", 0)),
        )
        self.validation = Validation(
            cfg,
            sync=sync,
            evaluator=local.evaluator,
            model=self.model,
            opt=opt,
            metrics=self.metrics,
            clock=self.clock,
            first_target=part.get("time_to_target_s"),
            first_target_update=part.get("updates_to_target"),
            board=self.board,
        )
        self.signal = StopSignal(self.stop, opt, sync=sync, is_leader=topo.is_leader)
        self.checkpoints = WorkerCheckpoints(
            cfg,
            topo,
            ck,
            opt=opt,
            model=self.model,
            optimizer=self.optimizer,
            metrics=self.metrics,
            clock=self.clock,
            part_state=self._part_state,
            number=self.resumed.number if self.resumed else 0,
        )

    @property
    def resharded(self) -> dict | None:
        """The old and new sizes when this run resumed at another size, else ``None``."""
        return None if self.plan is None else self.plan.record()

    def _part_state(self, number: int) -> dict:
        """This worker's state in its part of checkpoint ``number``."""
        state = {
            "loader": self.loader.state_dict(),
            "rng": rng_state(),
            "step": self.log.steps,
            "epochs_done": self.epochs.done,
            "train_time_s": self.clock.train_time(),
            "time_to_target_s": self.validation.first_target,
            "updates_to_target": self.validation.first_target_update,
            # the sample order the saved position refers to
            "window_blocks": self.loader.window_blocks,
            # --amp fp16: the loss scale continues where it was
            "loss_scale": self.precision.state_dict(),
        }
        if self.loader.sample_log is not None:
            # every batch logged before this line is in the saved position
            self.loader.sample_log.mark(f"checkpoint {number}")
        return state

    def _budget_spent(self) -> bool:
        cfg, opt = self.cfg, self.opt
        if cfg.steps is not None and cfg.mode == "sync" and opt.updates >= cfg.steps:
            return True
        return opt.should_stop  # the servers' budget, or a stop after a signal

    def _train(self) -> None:
        cfg, opt = self.cfg, self.opt
        pacer = Pacer(cfg.parsed_slowdown(), self.rank, cfg.sample_ms, self.clock.start)
        bar = ProgressBar(cfg, self.rank, opt.server_version)
        loss = loss_function(cfg.loss)
        if cfg.adaptive_batch and self.resume is None:
            # (the probe's labels are class zeros; a regression's targets, zeros too)
            probe_loss = (
                loss
                if cfg.loss != "mse"
                else (lambda out, _y: loss(out, torch.zeros_like(out)))
            )
            self.adaptive.probe(
                self.model, probe_loss, pacer, autocast=self.precision.autocast
            )
        stepper = Stepper(
            self.model,
            opt,
            self.loader,
            pacer,
            self.signal,
            self.rows,
            loss=loss,
            precision=self.precision,
            accumulate=cfg.accumulate,
        )
        fault = at_step(self.rank)  # tests only: a death or a hang at a step
        self.epochs.begin()
        while not self._budget_spent():
            result = stepper.step(self.epochs)
            self.log.record(result, self.epochs.done)
            self.board.step(
                opt.server_version,
                opt.shared,
                SAMPLES,
                LOSS,
                result.staleness,
                result.compute_s + result.pace_s + result.comm_s + result.data_wait_s,
            )
            if result.nonfinite is not None:  # every rank of the reduction
                self.nonfinite = f"step {self.log.steps}: {result.nonfinite}"
                self.nonfinite_own = opt.nonfinite_here
                break
            if fault is not None:
                fault(self.log.steps)
            signalled = self.signal.seen()
            if cfg.adaptive_batch:
                self.adaptive.after_step()
            bar.update(
                opt.server_version,
                self.loader.batch_size,
                result.loss,
                self.validation.last_accuracy,
            )
            self.validation.maybe_run()
            if result.total_samples == 0:  # every worker in the reduction ran out
                if self.epochs.end():
                    break
                if cfg.mode != "sync":
                    # --overlap: this step took the last push's reply, which may
                    # ask for a checkpoint with a stop; save it before stopping
                    self.checkpoints.maybe_write(signalled)
                continue
            last = self.epochs.ended_with(opt.shared[:, MORE])
            self.checkpoints.maybe_write(signalled)
            if signalled and self.signal.stop_here():
                break
            if last:
                break
        bar.close()
        self.epochs.close()

    def _finish(self) -> None:
        halted = self.nonfinite is not None or self.opt.nonfinite is not None
        if not halted:  # (the last checkpoint stays the one to resume from)
            self.checkpoints.write_last()
        self.end = time.perf_counter()
        self.final_version = self.opt.finish()
        self.loader.close()
        if not halted:
            sync = self.cfg.mode == "sync"
            self.validation.maybe_run(
                final=True, version=None if sync else self.final_version
            )
            if self.rank == 0:
                self.save_model()
        self.board.close()

    def save_model(self) -> None:
        """``--save-model``: write the final model's ``state_dict`` (on the rank holding it).

        Sync: rank 0's model (every worker's is the same). Hybrid and async:
        the servers' final weights and floating buffers, which
        :meth:`~hybridagg.optimizer.DistributedOptimizer.finish` loaded
        into this rank's model.
        """
        if not self.cfg.save_model:
            return
        with solo("saving the model"):
            path = save_state_dict(self.opt.final_state_dict(), self.cfg.save_model)
        log.info(
            "hybridagg train: saved the model's state_dict (%s) to %s",
            "the servers' final weights" if self.cfg.mode != "sync" else "rank 0's",
            path,
        )

    def nonfinite_report(self, mine: dict) -> dict:
        """This worker's run report ``mine``, with why it stopped on a NaN (if so)."""
        if self.nonfinite is None and self.opt.nonfinite is not None:
            # told by the servers at the end (e.g. in the pending exchange)
            self.nonfinite = f"after step {self.log.steps}: {self.opt.nonfinite}"
        mine["nonfinite"] = self.nonfinite
        mine["nonfinite_own"] = self.nonfinite_own
        return mine

    def _report(self) -> dict | None:
        cfg, topo, world = self.cfg, self.topo, self.world
        mine = self.nonfinite_report(self.log.report(self.end - self.clock.start))
        reports = world.allgather(mine, what="run report")
        self.metrics.close()
        world.barrier(what="metrics written")
        topo.comms.free()
        if self.rank == 0 and cfg.metrics:
            with solo("the final metrics merge"):
                merge_parts(cfg.metrics, topo.world_size)
        raise_if_nonfinite(reports)  # (the same on every rank)
        if self.rank != 0:
            return None
        with solo("the summary"):
            sync = cfg.mode == "sync"
            summary = summarize(
                cfg,
                topo,
                reports,
                updates=self.opt.updates if sync else (self.final_version or 0),
                epochs=self.epochs.done,
                time_to_target_s=self.validation.first_target,
                updates_to_target=self.validation.first_target_update,
                final_accuracy=self.validation.final_accuracy,
                final_loss=self.validation.final_loss,
                accuracy_curve=self.validation.curve,
                accuracy_updates=self.validation.curve_updates,
                resumed_from=self.resume,
                run_id=self.start.run_id,
                resharded=self.resharded,
            )
            publish(cfg, summary)
        return summary
