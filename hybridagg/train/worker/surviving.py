"""A worker's run under ``--on-group-failure continue``: train, or lose the group; then end.

See :mod:`hybridagg.train.survival` for what happens when each kind of
rank dies. Here, a worker:

1. trains as usual; an MPI error that means a dead peer (ULFM) ends its
   training: it revokes its group's communicators (so every member learns),
   its leader tells the servers (``LOST``) unless a server is what died,
   and it stops reading;
2. otherwise finishes: stops reading (the chunk counter is served by server
   0, which must still be up), meets its group once (so nobody reads after
   its leader's ``DONE``), and its leader sends ``DONE`` without waiting for
   the final weights;
3. meets every survivor (:func:`~hybridagg.train.survival.end_of_run`); the
   reporter chosen there receives the final weights, validates them, writes
   ``--save-model``, merges the metrics and writes the summary.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from ...comm.ulfm import is_process_failure
from ...runtime.outcomes import ExitCode, PeerFailure
from ..evaluate import Evaluator
from ..metrics import merge_parts
from ..survival import (
    FATAL,
    GROUP_LOST,
    OK,
    Ending,
    RankStatus,
    Verdict,
    dead_ranks_now,
    end_of_run,
)
from .report import nonfinite_reason, publish, summarize
from .setup import Local

if TYPE_CHECKING:
    from .role import WorkerRole

__all__ = ["SurvivingWorker"]


class SurvivingWorker:
    """Runs one worker's training and end under ``--on-group-failure continue``.

    Args:
        role: The worker role, wired (:meth:`WorkerRole._wire` done).
    """

    def __init__(self, role: WorkerRole) -> None:
        self.role = role
        self.train_samples = role.loader.total  # (read before the loader closes)

    def run(self, local: Local) -> dict | None:
        """Train (or lose the group), then end with the survivors.

        Returns:
            The summary on the reporter, ``None`` elsewhere; the rank's status
            is in ``role.status``.
        """
        role, topo = self.role, self.role.topo
        state, message, dead = OK, "", ()
        try:
            if not local.done_already:
                role._train()
            self._finish()
        except Exception as exc:
            if not (is_process_failure(exc) or isinstance(exc, PeerFailure)):
                raise
            role.end = time.perf_counter()
            state, message, dead = self._after_failure(exc)
        report = role.nonfinite_report(role.log.report(role.end - role.clock.start))
        mine = Ending(topo.rank, "worker", state, message, dead, report)
        survivors, endings, verdict = end_of_run(topo, mine, lost=state == GROUP_LOST)
        role.status = verdict.status_of(mine)
        # a NaN or an infinity stopped the run: every survivor says so (code
        # 3), and, as without losses, no final validation or summary follows
        stopped = nonfinite_reason([e.report for e in endings if e.report])
        if stopped is not None:
            role.status = RankStatus(ExitCode.NON_FINITE, f"stopped: {stopped}")
        summary = None
        if verdict.reporter == topo.rank:
            role.final_version = role.opt.receive_final()
            if stopped is None:
                self._validate(local)
                role.save_model()  # (the servers' final weights, received here)
        role.board.close()
        role.metrics.close()
        survivors.barrier(what="metrics written")
        if verdict.reporter == topo.rank and stopped is None:
            summary = self._summary(endings, verdict)
        if role.validation.evaluator is not None:
            role.validation.evaluator.close()
        # nobody exits before the summary is written: under --with-ft ulfm a
        # rank that exits with a non-zero code while others still run makes
        # the launcher abort the job (and, seen with Open MPI 5.0, hang)
        survivors.barrier(what="end of the run")
        survivors.free()
        return summary

    def _finish(self) -> None:
        role = self.role
        role.checkpoints.write_last()
        role.end = time.perf_counter()
        # nobody of the group reads after its leader's DONE: server 0 serves
        # the chunk counter only until every group is done
        role.loader.close()
        role.topo.comms.group.barrier(what="end of the group's reading")
        role.final_version = role.opt.finish(final=False)

    def _after_failure(self, exc: Exception) -> tuple[str, str, tuple[int, ...]]:
        """This rank's group, or the job, lost a rank: what to tell the others."""
        role, topo = self.role, self.role.topo
        topo.comms.group.revoke()  # every member's group operations fail now
        dead = dead_ranks_now(role.world)
        servers = [r for r in dead if r in topo.servers]
        if isinstance(exc, PeerFailure) or servers:
            names = ", ".join(str(r) for r in servers) or "?"
            self._stop_reading()
            return FATAL, f"parameter server rank {names} died", dead
        gone = [r for r in dead if r in topo.group_ranks]
        try:
            role.opt.group_lost(gone[0] if gone else -1)
        except Exception as error:  # (the servers must be reachable)
            if not is_process_failure(error):
                raise
            self._stop_reading()
            dead = dead_ranks_now(role.world)
            return FATAL, f"the parameter servers are unreachable ({error})", dead
        self._stop_reading()
        who = ", ".join(str(r) for r in gone) if gone else "a member"
        role.metrics.write(
            "group_lost",
            t=time.perf_counter() - role.clock.start,
            group=topo.group,
            dead_ranks=gone,
        )
        return GROUP_LOST, f"group {topo.group} lost: rank {who} died", dead

    def _stop_reading(self) -> None:
        try:
            self.role.loader.close()
        except Exception as exc:  # (its communicator may hold the dead rank)
            if not is_process_failure(exc):
                raise

    def _validate(self, local: Local) -> None:
        """The reporter validates the final weights (building an evaluator if not rank 0)."""
        role = self.role
        if role.validation.evaluator is None:
            role.validation.evaluator = Evaluator(
                role.cfg,
                role.model,
                local.device,
                loss=role.cfg.loss,
                statistics=local.statistics,
            )
        role.validation.maybe_run(final=True, version=role.final_version)

    def _summary(self, endings: list[Ending], verdict: Verdict) -> dict:
        role, cfg, topo = self.role, self.role.cfg, self.role.topo
        if cfg.metrics:
            merge_parts(cfg.metrics, topo.world_size)
        reports = [e.report for e in endings if e.report is not None]
        summary = summarize(
            cfg,
            topo,
            reports,
            updates=role.final_version or 0,
            epochs=role.epochs.done,
            time_to_target_s=role.validation.first_target,
            updates_to_target=role.validation.first_target_update,
            final_accuracy=role.validation.final_accuracy,
            final_loss=role.validation.final_loss,
            accuracy_curve=role.validation.curve,
            accuracy_updates=role.validation.curve_updates,
            resumed_from=role.resume,
            run_id=role.start.run_id,
        )
        expected = None
        if cfg.steps is None and role.resume is None:
            expected = role.epochs.done * self.train_samples
        summary.update(
            outcome=verdict.outcome,
            on_group_failure=cfg.on_group_failure,
            lost_groups=verdict.lost_groups,
            dead_ranks=list(verdict.dead),
            reporter=topo.rank,
            samples_unaccounted=None
            if expected is None
            else max(0, expected - summary["samples"]),
        )
        publish(cfg, summary)
        return summary
