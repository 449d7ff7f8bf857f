"""The end of a run that may have lost groups (``--on-group-failure continue``).

What happens when a rank dies, by role (ULFM: an operation that involves a
dead process fails with ``MPI_ERR_PROC_FAILED`` instead of hanging):

* **A non-leader worker**: its group's next collective fails on the other
  members. The first member that sees it revokes every communicator of the
  group (:meth:`hybridagg.comm.Comm.revoke`), so the others' pending and
  future group operations fail too (``MPI_ERR_REVOKED``); the leader sends
  ``LOST`` to every server, which drops the group; the members stop
  training with status ``GROUP_LOST`` (exit 6).
* **A leader**: the servers' receive of its next request fails: they drop
  its group. Its members see the failure in their group collectives, as
  above (they have no leader to tell the servers, who know already).
* **Rank 0**: as any leader or worker; what rank 0 does at the end (receive
  the final weights, validate, merge the metrics, write the summary) is
  done by the *reporter*: the lowest rank of a group that was not lost
  (:func:`settle`), which is rank 0 when group 0 survives. Periodic
  validation stays with rank 0 and stops when it dies.
* **A server**: its shard is gone, so the job cannot go on (no shard is
  recovered from a checkpoint): every survivor exits 5 (``ABORTED``) with a
  message naming the server; resume from the last checkpoint.

At the end every surviving rank, the members of dropped groups included
(they wait: a rank that leaves early with a non-zero exit code makes Open
MPI's launcher end the whole job), meets the others in :func:`end_of_run`:
a fault-tolerant agreement over the world (``MPI_Comm_iagree``, polled,
after acknowledging the failures) on whether the job can finish (no server
lost), then ``MPI_Comm_shrink`` to a communicator of the survivors, over
which their reports are gathered. Every rank then knows the same verdict
(:class:`Verdict`): the outcome, the lost groups and the reporter.

The dead workers' share of the epoch is recorded as lost, not re-issued:
the windows a dead group had drawn and not trained are skipped for that
epoch (later epochs are shared by the surviving groups as usual); the
summary's ``samples_unaccounted`` counts the samples of the finished epochs
that no surviving rank reports having trained.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
from mpi4py import MPI

from ..comm import Comm
from ..comm.ulfm import failed_world_ranks, is_process_failure
from ..runtime import envvars
from ..runtime.outcomes import ExitCode
from ..topology import Topology

__all__ = [
    "Ending",
    "RankStatus",
    "Verdict",
    "end_of_run",
    "settle",
    "status_line",
]

OK, GROUP_LOST, FATAL = "ok", "group_lost", "fatal"
"""A rank's own view at the end: trained to the end (or served), its group was
dropped, or it saw a loss the job cannot survive (a server)."""

_AGREE_RETRIES = 8


@dataclass(frozen=True)
class Ending:
    """One rank's record at the end, gathered over the survivors.

    Attributes:
        rank: World rank.
        role: ``"worker"`` or ``"server"``.
        state: :data:`OK`, :data:`GROUP_LOST` or :data:`FATAL`.
        message: What this rank saw (a dead rank, a dead server).
        dead: World ranks this rank knows to be dead.
        report: Its run report (as without losses), or ``None``.
        lost_groups: A server's dropped groups: group -> (seconds since
            the start of training, world rank found dead).
    """

    rank: int
    role: str
    state: str = OK
    message: str = ""
    dead: tuple[int, ...] = ()
    report: dict | None = None
    lost_groups: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Verdict:
    """What every survivor agrees on at the end.

    Attributes:
        outcome: ``"finished"``, ``"finished_with_losses"`` or ``"aborted"``.
        lost_groups: One entry per lost group: ``group``, ``ranks``,
            ``dead_ranks``, ``t`` (seconds into training when the servers
            dropped it, ``None`` if they never did), ``survivors``.
        dead: World ranks that died.
        survivors: World ranks that reached the end.
        reporter: The world rank that receives the final weights, validates
            and writes the summary (``None`` when no group is left).
        message: Why the job was aborted (empty otherwise).
    """

    outcome: str
    lost_groups: list[dict]
    dead: tuple[int, ...]
    survivors: tuple[int, ...]
    reporter: int | None
    message: str = ""

    def status_of(self, ending: Ending) -> RankStatus:
        """The exit status of the rank that sent ``ending``."""
        if self.outcome == "aborted":
            return RankStatus(ExitCode.ABORTED, self.message)
        if ending.state == GROUP_LOST:
            return RankStatus(ExitCode.GROUP_LOST, ending.message)
        if self.outcome == "finished_with_losses":
            groups = ", ".join(str(g["group"]) for g in self.lost_groups)
            return RankStatus(ExitCode.FINISHED_WITH_LOSSES, f"lost group(s) {groups}")
        return RankStatus(ExitCode.FINISHED, "")


@dataclass(frozen=True)
class RankStatus:
    """How one rank ends: its exit code and a one-line reason."""

    code: ExitCode
    message: str = ""

    @property
    def word(self) -> str:
        """The status as a word: ``finished``, ``group_lost``, ..."""
        return self.code.name.lower()


def status_line(rank: int, status: RankStatus) -> str:
    """The final status line a rank prints on stderr (one line, parseable).

    ``hybridagg train: rank R: <status> (code N)[: reason]``, where ``N`` is
    the :class:`~hybridagg.runtime.outcomes.ExitCode` (the process exits with
    it only with ``HYBRIDAGG_EXIT_CODES=1``, see ``hybridagg env``).
    """
    line = f"hybridagg train: rank {rank}: {status.word} (code {int(status.code)})"
    if status.message:
        line += ": " + " ".join(status.message.split())
    return line


def settle(
    topo: Topology, endings: Sequence[Ending], can_finish: bool, message: str = ""
) -> Verdict:
    """The verdict every survivor computes from the same gathered endings (pure).

    A group is lost when one of its ranks did not reach the end, or reported
    its group lost, or a server dropped it. The reporter is the lowest
    surviving worker of a group that was not lost (its group's leader).

    Args:
        topo: The topology.
        endings: Every survivor's :class:`Ending`.
        can_finish: The agreement's answer: no survivor saw a fatal loss.
        message: This rank's own fatal message (used when no survivor said
            why).
    """
    survivors = tuple(sorted(e.rank for e in endings))
    dead = tuple(r for r in range(topo.world_size) if r not in survivors)
    dropped: dict[int, float] = {}
    for e in endings:
        for g, (t, _) in e.lost_groups.items():
            g = int(g)
            dropped[g] = min(dropped.get(g, t), t)
    lost_states = {topo.group_of(e.rank) for e in endings if e.state == GROUP_LOST}
    lost = []
    for g, ranks in enumerate(topo.groups):
        gone = [r for r in ranks if r in dead]
        if gone or g in dropped or g in lost_states:
            lost.append(
                {
                    "group": g,
                    "ranks": list(ranks),
                    "dead_ranks": gone,
                    "t": dropped.get(g),
                    "survivors": [r for r in ranks if r in survivors],
                }
            )
    lost_ids = {entry["group"] for entry in lost}
    live = [r for r in survivors if topo.group_of(r) not in (None, *lost_ids)]
    reporter = live[0] if live else None
    dead_servers = [r for r in dead if r in topo.servers]
    fatal = [e for e in endings if e.state == FATAL]
    if dead_servers or not can_finish or reporter is None:
        if dead_servers:
            names = ", ".join(str(r) for r in dead_servers)
            why = (
                f"parameter server rank {names} died; its shard of the model is "
                "lost (resume from the last checkpoint)"
            )
        elif fatal:
            why = fatal[0].message
        elif reporter is None:
            why = "every group was lost"
        else:
            why = message or "a rank saw a loss the job cannot survive"
        return Verdict("aborted", lost, dead, survivors, None, why)
    outcome = "finished_with_losses" if lost else "finished"
    return Verdict(outcome, lost, dead, survivors, reporter)


def _wait_agree(
    world: Comm, ok: bool, timeout: float, poll: Callable[[], object] | None
) -> bool:
    """Polled ``MPI_Comm_iagree`` over the world; true when every survivor passed ``ok``."""
    for _ in range(_AGREE_RETRIES):
        failed_world_ranks(world.mpi)  # acknowledge what is known
        flag = np.array([1 if ok else 0], dtype=np.intc)
        req = world.mpi.Iagree(flag)

        def done(req=req) -> bool:
            if poll is not None:
                poll()
            return req.Test()

        try:
            world.wait_for(done, "the end-of-run agreement of the survivors", timeout)
        except MPI.Exception as exc:
            # a failure not yet acknowledged: the agreement is uniform, so
            # every survivor sees this error and tries again
            if not is_process_failure(exc):
                raise
            continue
        return bool(flag[0] & 1)
    raise RuntimeError("the survivors could not agree at the end of the run")


def end_of_run(
    topo: Topology,
    mine: Ending,
    *,
    poll: Callable[[], object] | None = None,
    lost: bool = False,
) -> tuple[Comm, list[Ending], Verdict]:
    """Meet the other survivors; agree on how the run ends (every surviving rank).

    Args:
        topo: The topology.
        mine: This rank's record.
        poll: Called while waiting (server 0 keeps serving chunk numbers to
            readers that are still asking).
        lost: This rank's group was dropped: it may wait for the rest of the
            run (``HYBRIDAGG_SURVIVOR_WAIT``), not just ``HYBRIDAGG_TIMEOUT``.

    Returns:
        A communicator of the survivors, their endings (in rank order) and
        the verdict.
    """
    world = topo.comms.world
    timeout = envvars.get_float("HYBRIDAGG_SURVIVOR_WAIT") if lost else world.timeout
    if not timeout > 0:
        raise ValueError(f"HYBRIDAGG_SURVIVOR_WAIT must be positive, got {timeout}")
    can_finish = _wait_agree(world, mine.state != FATAL, timeout, poll)
    shrunk = world.mpi.Shrink()
    survivors = Comm(shrunk, name="survivors", dup=False, timeout=world.timeout)
    endings = survivors.allgather(mine, what="end-of-run records of the survivors")
    verdict = settle(topo, endings, can_finish, mine.message)
    return survivors, endings, verdict


def dead_ranks_now(world: Comm, patience: float = 1.0) -> tuple[int, ...]:
    """World ranks known dead, waiting up to ``patience`` seconds for the news.

    A rank that learns of a failure from a revoked communicator may not yet
    know who died: the news comes with MPI progress.
    """
    end = time.perf_counter() + patience
    while True:
        dead = failed_world_ranks(world.mpi)
        if dead or time.perf_counter() >= end:
            return dead
        time.sleep(0.01)
