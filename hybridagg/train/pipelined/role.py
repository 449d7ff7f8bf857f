"""The worker role of a ``hybridagg train`` job with pipelined groups.

Every worker of such a job holds one stage of its group's replica
(:mod:`.stages`): a group named by ``--pipeline-groups`` cuts the model
over its ranks, any other group is one rank holding it whole. Each group's
stage 0 reads the group's batches from the training split; the batch goes
through the stages in micro-batches (:class:`~hybridagg.pipeline.PipelineStage`)
and the gradients are combined across groups as the mode says
(:mod:`.exchange`). Group 0 validates its replica every ``--eval-every``
updates and at the end (:mod:`.validate`).

The role meets the servers' role at the same world-level steps as
:class:`~hybridagg.train.worker.WorkerRole` (two agreements, the servers'
communicator, the start, the run report), so servers serve a pipelined job
unchanged apart from where each part comes from.
"""

from __future__ import annotations

import logging
import math
import statistics
import threading
import time

import torch

from ...comm import Comm, solo
from ...control import ShareSolver
from ...data import HDF5Loader
from ...data.loader import load_split_info
from ...pipeline import Link, PipelineStage, StepTimes
from ...pipeline.probe import neighbour_links
from ...ps.client import part_elements
from ...ps.protocol import FLAG_STOP
from ...topology import Topology
from ...windows import window_blocks_for
from ..checkpoint import Checkpointer
from ..common import make_optimizer
from ..config import TrainConfig
from ..config.cost import rank_prices
from ..config.pipeline import parse_pipeline_groups
from ..evaluate import Evaluator
from ..losses import check_task, loss_function
from ..metrics import MetricsWriter, merge_parts
from ..models import build_model, check_fits
from ..resume import RunStart
from ..usage import machine_usage
from ..worker.epochs import Epochs
from ..worker.report import publish, summarize
from ..worker.role import agreed, raise_if_nonfinite
from ..worker.setup import training_statistics
from .cost import GroupCostControl
from .exchange import ServerStageUpdate, make_stage_update, stage_ps_comm
from .layout import PipelineLayout
from .stages import (
    StageBuild,
    UnitPlan,
    cut_stage,
    measure_model_seconds,
    partition_seconds,
    plan_units,
    times_the_model,
)
from .validate import PipelinedValidation

__all__ = ["PipelinedWorkerRole", "join_probe"]

log = logging.getLogger(__name__)


def join_probe(cfg: TrainConfig, world: Comm) -> None:
    """A server's part of the workers' start-up probe and cut agreement.

    The servers are in the world, so they take part in its collectives
    (with nothing to say) between the "set-up" and "data" agreements,
    where :meth:`PipelinedWorkerRole.run` probes the links and cuts.
    """
    if cfg.pipeline_partition == "auto":
        world.allgather(None, what="the groups' links")
    if times_the_model(cfg):
        world.allgather(None, what="the model's time")
    world.check(None, what="cut")


class PipelinedWorkerRole:
    """A worker's part of a job with pipelined groups.

    Args:
        cfg: The run's options (``cfg.pipelined``).
        topo: The topology.
        start: How the run starts (a pipelined job starts fresh).
        ck: Unused (a pipelined job takes no checkpoints yet; the
            configuration refuses ``--checkpoint``).
        stop: The process's stop flag (a signal stops every group).
        chunks: Unused (``--on-group-failure continue`` is refused).
    """

    status = None

    def __init__(
        self,
        cfg: TrainConfig,
        topo: Topology,
        start: RunStart,
        ck: Checkpointer | None,
        stop: threading.Event,
        chunks=None,
    ) -> None:
        self.cfg, self.topo, self.start, self.stop = cfg, topo, start, stop
        self.rank = topo.rank
        self.world: Comm = topo.comms.world

    # --- set-up ---------------------------------------------------------------
    def _set_up(self) -> None:
        """Layout, model, stage and optimizer (the world's "set-up" agreement)."""
        cfg, topo = self.cfg, self.topo
        self.layout = PipelineLayout(
            topo.groups, parse_pipeline_groups(cfg.pipeline_groups, topo.num_groups)
        )
        if topo.device != "cpu":
            # (a stage's activations travel through MPI from host memory; a
            # stage on a GPU would need them staged, which is not built yet)
            raise ValueError(
                f"--pipeline-groups trains on the CPU for now, but this rank's "
                f"device is {topo.device} (--device {cfg.device}); pass --device cpu"
            )
        self.g = self.layout.group_of(self.rank)
        self.k = self.layout.stage_of(self.rank)
        self.stages = len(self.layout.groups[self.g])
        self.first, self.last = self.k == 0, self.k == self.stages - 1
        torch.manual_seed(cfg.seed)  # every group starts from the same weights
        info = load_split_info([cfg.data], "train")[0]
        check_task(cfg.loss, info.regression, cfg.data)
        self.sample_shape = tuple(info.sample_shape)
        # windows as a data-parallel job of one worker per group reads them
        self.window_blocks = window_blocks_for(
            info.length, info.block_samples, topo.num_groups
        )
        # (meta: shapes and operations only; each rank makes its own units)
        device = torch.device("meta" if cfg.pipeline_init == "meta" else "cpu")
        with device:
            model = build_model(cfg.model, self.sample_shape, info.num_classes)
        check_fits(
            model, self.sample_shape, info.num_classes, cfg.model, device, cfg.loss
        )
        if cfg.mode != "sync":
            part_elements(None, 4)  # (a bad registry value: here, one verdict)
        self.plan: UnitPlan | None = plan_units(model, self.sample_shape)

    def _probe(self) -> None:
        """``--pipeline-partition auto``: measure every pipelined group's links
        and agree on the model's seconds per sample (collective over the world).

        Each group's neighbouring stages ping-pong (:func:`neighbour_links`);
        every rank then holds every group's links, so every rank computes
        the same cuts.
        """
        cfg, topo = self.cfg, self.topo
        self.links: dict[int, list[Link]] = {}
        self.seconds_per_sample: float | None = None
        if cfg.pipeline_partition != "auto":
            return
        group = topo.comms.group
        mine = []
        if group.size > 1:
            mine = [(x.latency_s, x.bandwidth_Bps) for x in neighbour_links(group)]
        seen = self.world.allgather(
            (self.g, mine) if group.rank == 0 and mine else None,
            what="the groups' links",
        )
        self.links = {g: [Link(*x) for x in ls] for g, ls in filter(None, seen)}
        measured = None
        if times_the_model(cfg):
            times = self.world.allgather(
                measure_model_seconds(self.plan.model, self.plan.sample),
                what="the model's time",
            )
            measured = statistics.median(t for t in times if t is not None)
        self.seconds_per_sample = partition_seconds(cfg, measured)

    def _cut(self) -> None:
        """Every group's cut, this rank's stage and its optimizer (the world's
        "cut" agreement)."""
        cfg, topo = self.cfg, self.topo
        self.build: StageBuild = cut_stage(
            cfg,
            self.layout,
            self.rank,
            self.plan,
            links=self.links,
            seconds_per_sample=self.seconds_per_sample,
        )
        self.plan = None  # (the whole model goes; this rank keeps its stage)
        self.optimizer = make_optimizer(cfg, self.build.module)
        self.group_prices = None
        if cfg.cost_budget is not None:  # (a bad --prices: here, one verdict)
            workers = list(topo.workers)
            price = dict(
                zip(workers, rank_prices(cfg.prices, len(workers)), strict=True)
            )
            self.group_prices = [
                sum(price[r] for r in ranks) for ranks in self.layout.groups
            ]

    def _data(self) -> None:
        """Stage 0's training loader (the world's "data" agreement)."""
        cfg = self.cfg
        self.loader = None
        self.evaluator = None
        if self.readers is None:
            return
        self.loader = HDF5Loader(
            cfg.data,
            batch_size=cfg.batch_size,
            comm=self.readers,
            shares="static" if cfg.mode == "sync" else "dynamic",
            seed=cfg.seed,
            window_blocks=self.window_blocks,
            normalize=cfg.normalize != "none",
            statistics=self.statistics,
        )
        if self.g == 0:
            self.evaluator = Evaluator(
                cfg,
                None,
                torch.device("cpu"),
                loss=cfg.loss,
                statistics=self.statistics,
            )

    # --- the run ----------------------------------------------------------------
    def run(self) -> dict | None:
        """Train; returns the summary on rank 0, ``None`` elsewhere."""
        cfg, topo = self.cfg, self.topo
        workers = topo.comms.workers
        # (collective over the workers before anyone may fail, as the whole
        # replica's set-up does)
        self.statistics = training_statistics(cfg, workers)
        agreed(self.world, "set-up", self._set_up)
        self._probe()
        agreed(self.world, "cut", self._cut)
        # the readers' communicator: every group's stage 0 (collective over
        # the workers)
        self.readers = workers.split(
            0 if self.first else None, self.rank, name="readers"
        )
        agreed(self.world, "data", self._data)
        group = topo.comms.group
        loss = loss_function(cfg.loss)
        sample = torch.zeros((1, *self.sample_shape)) if self.first else None
        # (a stage's error is the same on its group's stages already; the
        # world's agreement tells the other groups and the servers, which
        # would otherwise wait for this group until their timeout)
        self.stage = agreed(
            self.world,
            "the stages",
            lambda: PipelineStage(
                self.build.module,
                group,
                sample=sample,
                loss=loss if self.last else None,
                schedule=cfg.pipeline_schedule,
                pace=self.build.pace,
            ),
        )
        ps = None
        if cfg.mode != "sync":
            ps = stage_ps_comm(self.world, self.layout.groups, topo.servers)
        self.update = make_stage_update(
            cfg,
            workers=workers,
            group=group,
            ps=ps,
            layout=self.layout,
            servers=topo.servers,
            build=self.build,
            optimizer=self.optimizer,
            group_index=self.g,
        )
        self.validation = (
            PipelinedValidation(
                self.stage,
                group,
                self.evaluator,
                loss,
                classify=cfg.loss != "mse",
                micro_batches=cfg.micro_batches,
            )
            if self.g == 0
            else None
        )
        self.metrics = MetricsWriter(cfg.metrics, self.rank)
        self.world.barrier(what="start of training")
        self.t0 = time.perf_counter()
        self.cpu0 = time.process_time()
        if self.rank == 0:
            log.info(
                "hybridagg train: %s mode, pipelined groups %s of %s, stage bounds "
                "over %d units %s, %d servers; model %s",
                cfg.mode,
                list(self.layout.pipelined),
                [list(r) for r in self.layout.groups],
                len(self.build.units),
                [list(b) for b in self.build.group_bounds],
                len(topo.servers),
                cfg.model,
            )
        self.samples = self.steps = self.version = 0
        self.costs: GroupCostControl | None = None  # --cost-budget (sync)
        self.nonfinite: str | None = None  # why training stopped on a NaN or an inf
        self.nonfinite_own = False
        self.busy = self.wait = 0.0
        self.stale_sum = 0
        self.curve: list[tuple[float, float]] = []
        self.curve_updates: list[int] = []  # the version of each curve point
        self.first_target: float | None = None
        self.first_target_update: int | None = None
        self.last_eval = 0
        self.final = (None, None)
        self.epochs = Epochs(self.loader, cfg.max_epochs, 0) if self.first else None
        if self.epochs is not None:
            self.epochs.begin()
        if cfg.mode == "sync":
            self._train_sync(workers)
        else:
            self._train_servers(group)
        return self._finish(group, ps)

    def _read(self):
        """Stage 0: the epoch's next batch (``None`` at its end) and the seconds
        waited for the loader."""
        before = self.loader.stats.wait_seconds
        batch = self.epochs.next_batch()
        waited = self.loader.stats.wait_seconds - before
        self.wait += waited
        return batch, waited

    def _step(self, batch) -> tuple[float | None, StepTimes]:
        """The batch through the pipeline; returns its loss (last stage) and times."""
        if self.first and batch is None:  # (sync: this group has none this step)
            batch = (
                torch.zeros((0, *self.sample_shape)),
                torch.zeros(0, dtype=torch.int64),
            )
        self.optimizer.zero_grad()
        loss, _, times = self.stage.step(batch, self.cfg.micro_batches)
        self.busy += times.wall_s
        return loss, times

    def _fetch(self):
        """Stage 0, hybrid: the group's next batch, going on to the next epoch at
        an epoch's end (``None`` when training ends there), whether it ended,
        and the seconds waited for the loader."""
        batch, waited = self._read()
        while batch is None:  # an epoch ended: the next one, unless the last
            if self.epochs.end():
                return None, True, waited
            batch, more = self._read()
            waited += more
        return batch, False, waited

    def _train_servers(self, group: Comm) -> None:
        """Hybrid, async: each group steps alone and meets the servers."""
        update: ServerStageUpdate = self.update  # type: ignore[assignment]
        while True:
            batch, end, waited = (None, False, 0.0)
            if self.first:
                batch, end, waited = self._fetch()
            n = 0 if batch is None else len(batch[1])
            signalled = self.stop.is_set()
            n, end, signalled = group.bcast(
                (n, end, signalled) if self.first else None, 0, what="the group's batch"
            )
            if end:
                break
            loss, times = self._step(batch)
            t1 = time.perf_counter()
            reply = update.apply(
                n,
                flags=FLAG_STOP if signalled else 0,
                seconds_per_sample=times.wall_s / n,
            )
            comm = time.perf_counter() - t1
            if reply.get("nonfinite") is not None:
                # a server found a NaN or an infinity in a pushed part (or
                # a group said so) and stopped every group; it names the group
                self.nonfinite = (
                    f"step {self.steps + 1}: the servers stopped every group: "
                    f"group {reply['nonfinite']}'s loss or gradient was not finite"
                )
            self._after_update(n, loss, reply, times, comm, waited)
            if reply["stop"] or self.nonfinite is not None:
                break
        update.done()

    def _train_sync(self, workers: Comm) -> None:
        """Sync: every group steps together; the gradients are summed per layer.

        With ``--adaptive-batch`` each group's share of the global batch
        (``--batch-size`` per group) is solved again from the groups'
        measured batch times (Ling et al.'s linear solve, :class:`ShareSolver`:
        the adaptive-batch controller's windows and dead-band, with an
        intercept for a pipeline's fill and drain); every rank adds the same
        measurements, so every reader takes the same decision.
        """
        cfg = self.cfg
        groups = len(self.layout.groups)
        solver = None
        if cfg.adaptive_batch:
            solver = ShareSolver(
                groups,
                window=cfg.batch_window,
                deadband=cfg.batch_deadband,
                low=cfg.min_batch,
                high=cfg.max_batch,
                shares=[cfg.batch_size] * groups,
            )
        self.shares = [cfg.batch_size] * groups
        if self.group_prices is not None:
            self.costs = GroupCostControl(cfg, solver, self.group_prices, self.shares)
        last = (0, 0.0)  # this group's last batch and its seconds (stage 0)
        tick = None  # when this rank last met the others here
        while True:
            batch, waited = self._read() if self.first else (None, 0.0)
            n = 0 if batch is None else len(batch[1])
            now = time.perf_counter()
            period, tick = (0.0 if tick is None else now - tick), now
            seen = workers.allgather(
                (n, self.stop.is_set(), *last, period) if self.first else None,
                what="the groups' batches",
            )
            counts = [s for s in seen if s is not None]
            total = sum(c[0] for c in counts)
            if any(c[1] for c in counts):
                break
            if self.costs is not None:
                self._charge(solver, counts)
            elif solver is not None:
                self._reshare(solver, counts)
            if total == 0:  # every group finished the epoch
                ended = self.epochs.end() if self.first else None
                ended = workers.allgather(ended, what="the epoch's end")
                if any(e for e in ended if e is not None):
                    break
                last = (0, 0.0)  # (measured once, in the round that saw it)
                continue
            loss, times = self._step(batch)
            last = (n, times.wall_s) if n else (0, 0.0)
            if self._nonfinite_anywhere(workers, loss):
                break  # (no update applied, on every rank)
            t1 = time.perf_counter()
            reply = self.update.apply(counts[self.g][0], total)
            comm = time.perf_counter() - t1
            self._after_update(counts[self.g][0], loss, reply, times, comm, waited)
            if cfg.steps is not None and reply["version"] >= cfg.steps:
                break
        if self.costs is not None:
            # (the rounds up to the last meeting: every rank's account alike)
            self.cost_account = self.costs.finish()

    def _nonfinite_anywhere(self, workers: Comm, loss: float | None) -> bool:
        """Sync: whether any group's loss or this rank's gradient is not finite.

        Checked on every worker before the sum, so every rank skips the
        update and stops at the same step (the whole replica's sync mode
        does the same).
        """
        bad = loss is not None and not math.isfinite(loss)
        grads = [p.grad for p in self.build.module.parameters() if p.grad is not None]
        bad = bad or any(not bool(torch.isfinite(g).all()) for g in grads)
        flags = workers.allgather(bad, what="the step's finiteness")
        if not any(flags):
            return False
        ranks = [r for r, f in enumerate(flags) if f]
        self.nonfinite = f"step {self.steps + 1}: the loss or gradient of rank(s) {ranks} is not finite"
        self.nonfinite_own = bad
        return True

    def _measure(self, solver: ShareSolver, counts: list[tuple]) -> None:
        """Feed every group's last batch time to the solver."""
        for g, (_, _, samples, seconds, _) in enumerate(counts):
            if samples > 0 and seconds > 0:
                solver.add(g, samples, seconds)

    def _reshare(self, solver: ShareSolver, counts: list[tuple]) -> None:
        """Feed every group's last batch time to the solver; apply its decision."""
        self._measure(solver, counts)
        new = solver.decide(sum(self.shares))
        if new is not None:
            self._set_shares(new)

    def _charge(self, solver: ShareSolver, counts: list[tuple]) -> None:
        """``--cost-budget``: count the last round (the slowest group's
        seconds between two meetings); at a slot's end, charge it and run
        the controller's choice of groups and shares."""
        self._measure(solver, counts)
        if self.steps == 0:
            return  # (the first meeting ends no round)
        record = self.costs.round(max(c[4] for c in counts))
        if record is None:
            return
        choice = self.costs.choice
        if self.rank == 0:  # (one decision, taken alike everywhere: one record)
            self.metrics.write(
                "cost",
                t=time.perf_counter() - self.t0,
                version=self.version,
                active=list(record.choice.active),
                rounds=record.steps,
                seconds=record.seconds,
                cost_per_hour=record.cost_per_hour,
                batch_time_s=record.batch_time_s,
                predicted_s=record.predicted_s,
                queue=record.queue,
                next_active=list(choice.active),
            )
        if choice.active != record.choice.active and self.rank == 0:
            log.info(
                "cost control: %s parked, %s training (queue %.3g, budget %.3g/h)",
                list(choice.parked) or "none",
                list(choice.active),
                record.queue,
                self.cfg.cost_budget,
            )
        if list(choice.shares) != self.shares:
            self._set_shares(list(choice.shares))

    def _set_shares(self, new: list[int]) -> None:
        """Run ``new`` shares from the next step on (collective over the readers)."""
        old, self.shares = self.shares, new
        if self.loader is not None:  # collective over the readers, all alike
            self.loader.set_batch_sizes(new)
        self.metrics.write(
            "batch",
            t=time.perf_counter() - self.t0,
            scope="groups",
            version=self.version,
            old=old,
            new=new,
        )

    def _after_update(
        self,
        n: int,
        loss: float | None,
        reply: dict,
        times: StepTimes,
        comm_s: float,
        waited: float,
    ) -> None:
        """Count the step, log it (the fields a whole replica's step has, and
        the pipeline's own), and validate when due (group 0)."""
        cfg = self.cfg
        version, stale = reply["version"], reply.get("staleness", 0)
        self.steps += 1
        self.version = version
        self.busy += comm_s
        if self.first:
            self.samples += n
            self.stale_sum += stale
        self.metrics.write(
            "step",
            t=time.perf_counter() - self.t0,
            group=self.g,
            role=f"stage {self.k}",
            step=self.steps,
            version=version,
            epoch=self.epochs.done if self.epochs is not None else None,
            batch=n,
            compute_s=times.compute_s,
            pace_s=times.pace_s,
            comm_s=comm_s,
            reduce_s=0.0,
            data_wait_s=waited,
            # the pipeline's own: waiting for a neighbour, emulated links
            stage_wait_s=times.wait_s,
            link_s=times.link_s,
            staleness=stale,
            loss=loss,
        )
        due = version // cfg.eval_every > self.last_eval
        if self.validation is not None and due and self.nonfinite is None:
            self.last_eval = version // cfg.eval_every
            self._validate(version)

    def _validate(self, version: int) -> tuple[float | None, float]:
        """Group 0 scores its replica; rank 0 records the curve and the target."""
        accuracy, loss = self.validation.run()
        t = time.perf_counter() - self.t0
        if self.rank == 0:
            self.metrics.write(
                "validation", t=t, version=version, accuracy=accuracy, loss=loss
            )
            if accuracy is not None:
                self.curve.append((t, accuracy))
                self.curve_updates.append(int(version))
                target = self.cfg.target_accuracy
                if (
                    target is not None
                    and self.first_target is None
                    and accuracy >= target
                ):
                    self.first_target, self.first_target_update = t, version
        return accuracy, loss

    # --- the end ---------------------------------------------------------------
    def _finish(self, group: Comm, ps: Comm | None) -> dict | None:
        cfg, topo = self.cfg, self.topo
        wall = time.perf_counter() - self.t0
        if cfg.mode == "sync":
            final_version = self.update.finish()
        else:
            final_version = self.update.finish(receives_final=self.g == 0)
        if self.validation is not None:
            # the whole group knows: a halt comes with a step every stage took
            if self.nonfinite is None:
                self.final = self._validate(final_version)
            self.validation.close()
        if self.epochs is not None:
            self.epochs.close()
        if self.loader is not None:
            self.loader.close()
        report = {
            "role": "worker",
            "samples": self.samples,
            "busy_s": self.busy,
            "wait_s": self.wait,
            "wall_s": wall,
            "stale_sum": self.stale_sum,
            "stale_n": self.steps if self.first else 0,
            "nonfinite": self.nonfinite,
            "nonfinite_own": self.nonfinite_own,
            **machine_usage(self.cpu0),
        }
        reports = self.world.allgather(report, what="run report")
        self.metrics.close()
        self.world.barrier(what="metrics written")
        self.update.free()
        if ps is not None:
            ps.free()
        if self.readers is not None:
            self.readers.free()
        topo.comms.free()
        if self.rank == 0 and cfg.metrics:
            with solo("the final metrics merge"):
                merge_parts(cfg.metrics, topo.world_size)
        raise_if_nonfinite(reports)
        if self.rank != 0:
            return None
        accuracy, loss = self.final
        summary = summarize(
            cfg,
            topo,
            reports,
            updates=final_version,
            epochs=self.epochs.done if self.epochs is not None else 0,
            time_to_target_s=self.first_target,
            updates_to_target=self.first_target_update,
            final_accuracy=accuracy,
            final_loss=loss,
            accuracy_curve=self.curve,
            accuracy_updates=self.curve_updates,
            resumed_from=None,
            run_id=self.start.run_id,
            resharded=None,
        )
        summary["pipeline"] = {
            "groups": list(self.layout.pipelined),
            "units": len(self.build.units),
            "bounds": [list(b) for b in self.build.group_bounds],
            "micro_batches": cfg.micro_batches,
            "schedule": cfg.pipeline_schedule,
            "partition": cfg.pipeline_partition,
            # each pipelined group's measured links: [latency s, bytes/s]
            # (None: too fast to tell from the latency)
            "links": {
                str(g): [
                    [
                        x.latency_s,
                        x.bandwidth_Bps if math.isfinite(x.bandwidth_Bps) else None,
                    ]
                    for x in ls
                ]
                for g, ls in self.links.items()
            },
        }
        if cfg.mode == "sync":
            summary["pipeline"]["shares"] = list(self.shares)
        if self.costs is not None:
            summary["cost"] = self.cost_account
        publish(cfg, summary)
        return summary
