"""Checkpoints of the servers while groups run asynchronously, and stop requests.

Server 0 requests checkpoint ``c`` (every ``checkpoint_every`` versions, at
the update budget, or when a stop is requested) through the ``checkpoint``
field of its replies. A leader whose group has saved its part sends
``CKPT c``; a server handles nothing more from that leader until every
running leader has done the same, then saves its own part (so the snapshot
holds exactly the pushes sent before each leader's ``CKPT``: one consistent
cut, although the groups run asynchronously) and continues. The other
servers report to server 0 when they have saved, and server 0 commits.

A stop (a signal: the job is to end and resume later) is taken with a
checkpoint of its own, requested with the stop in the same replies, so
every group that is told to stop saves its part of it and pushes nothing
after it. A stop requested while checkpoint ``c`` is pending waits for
``c``: a group that has already saved its part of ``c`` would otherwise
be told to stop only by its next push, applied after ``c``'s snapshot, and
the servers' last checkpoint at the end (taken when any update came
after the last one; meant for groups that all finished) would then hold
those updates, no part of any worker, and every group as finished, so a
resumed run would train nothing.

:class:`CheckpointSchedule` is the bookkeeping (pure logic);
:class:`CheckpointCoordinator` adds the callbacks and the reports.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from mpi4py import MPI

from ..comm import Comm
from . import protocol as P

__all__ = ["CheckpointCoordinator", "CheckpointSchedule"]


class CheckpointSchedule:
    """Which checkpoint is requested, saved and committed, and whether to stop.

    Args:
        every: Request a checkpoint every this many versions (``None``: only
            at the budget and on a stop request).
        enabled: Whether checkpoints are taken at all.
        version: The server's version at the start.
        restored: The checkpoint the run resumed from (0: none).
        budget: Version at which every group is told to stop (``None``: none).

    Attributes:
        requested: Newest checkpoint requested (server 0 decides; the
            others learn it when they save it).
        saved: Newest checkpoint this server saved.
        saved_version: The version it saved.
        committed: Newest checkpoint committed (server 0).
        stopping: A stop was requested (server 0).
        stop_checkpoint: The checkpoint the stop is taken with (``None``:
            no stop, or one waiting for the pending checkpoint; 0:
            checkpoints are off).
        paused: Leaders that sent ``CKPT``, and the checkpoint each reached.
        written: Server 0: the servers that saved each checkpoint.
    """

    def __init__(
        self,
        every: int | None,
        enabled: bool,
        version: int = 0,
        restored: int = 0,
        budget: int | None = None,
    ) -> None:
        self.every, self.enabled, self.budget = every, enabled, budget
        self.next_version = (version // every + 1) * every if every else None
        self.requested = self.saved = self.committed = restored
        self.saved_version = version
        self.stopping = False
        self.stop_checkpoint: int | None = None
        self.paused: dict[int, int] = {}
        self.written: dict[int, set[int]] = {}

    @property
    def pending(self) -> bool:
        """A checkpoint is requested and this server has not saved it yet."""
        return self.requested > self.saved

    def stop_flag(self, version: int) -> bool:
        """Whether replies tell every group to stop.

        A requested stop is told only with its own checkpoint (a stop that
        waits for the pending checkpoint is not told yet).
        """
        over = self.budget is not None and version >= self.budget
        return over or self.stop_checkpoint is not None

    def request_due(self, version: int) -> bool:
        """Server 0, after an update: request a checkpoint if one is due.

        Returns:
            Whether a new checkpoint was requested.
        """
        if not self.enabled:
            return False
        due = self.next_version is not None and version >= self.next_version
        at_budget = self.budget is not None and version == self.budget
        if not ((due or at_budget) and self.requested == self.saved):
            return False
        self.requested += 1
        while self.every and self.next_version <= version:
            self.next_version += self.every
        return True

    def request_stop(self) -> bool:
        """Server 0: stop every group, after a checkpoint if checkpointing.

        The stop's checkpoint is requested now, or, while another is pending,
        once that one is saved (:meth:`record_save`); groups are told to
        stop from then on, together with the checkpoint to save first.

        Returns:
            Whether this is the first stop request.
        """
        if self.stopping:
            return False
        self.stopping = True
        if not self.enabled:
            self.stop_checkpoint = 0
        elif not self.pending:
            self.requested += 1
            self.stop_checkpoint = self.requested
        return True

    def pause(self, leader: int, number: int) -> None:
        """``leader`` sent ``CKPT number``: hold its messages until the snapshot."""
        self.paused[leader] = number

    def ready(self, num_groups: int, done: set[int]) -> bool:
        """Whether every running leader has reached the newest paused-at checkpoint."""
        pending = max(self.paused.values(), default=0)
        if not pending:
            return False
        return all(
            g in done or self.paused.get(g) == pending for g in range(num_groups)
        )

    def snapshot_number(self) -> int:
        """The checkpoint a snapshot taken now belongs to."""
        return max(self.paused.values())

    def record_save(self, number: int, version: int) -> list[int]:
        """This server saved ``number`` at ``version``.

        Server 0, with a stop waiting for this checkpoint: requests the stop's
        own checkpoint, and the stop is told from now on.

        Returns:
            The leaders paused for it, now released.
        """
        self.saved_version = version
        self.saved = max(self.saved, number)
        self.requested = max(self.requested, number)
        if self.stopping and self.stop_checkpoint is None and not self.pending:
            # the stop waited for this one: now its own checkpoint, and the stop
            self.requested += 1
            self.stop_checkpoint = self.requested
        released = list(self.paused)
        self.paused.clear()
        return released

    def record_skip(self) -> list[int]:
        """The paused leaders, released without a save (a halted run saves nothing).

        Returns:
            The leaders paused, now released.
        """
        released = list(self.paused)
        self.paused.clear()
        return released

    def record_written(self, number: int, server: int) -> None:
        """Server 0: ``server`` has saved ``number``."""
        self.written.setdefault(number, set()).add(server)

    def take_commits(self, num_servers: int) -> list[int]:
        """Server 0: the checkpoints every server has saved, now committed, in order."""
        out = []
        for number in sorted(self.written):
            if len(self.written[number]) == num_servers and number > self.committed:
                out.append(number)
                self.committed = number
                del self.written[number]
        return out


class CheckpointCoordinator:
    """One server's checkpoints: the callbacks, the reports to server 0, stops.

    Args:
        ps: The leaders-and-servers communicator.
        num_groups: Number of groups ``G``.
        server: This server's index.
        schedule: The bookkeeping.
        on_snapshot: ``f(c, state)`` saves this server's part of checkpoint
            ``c``; ``None``: no checkpoints.
        on_commit: Server 0: ``f(c)`` once every server has saved ``c``.
        stop_requested: Server 0: polled; true requests a stop.
        num_servers: The servers (default: the ranks of ``ps`` after the
            leaders; a communicator that also holds pipelined stages says).

    Attributes:
        saves: Snapshots this server took.
    """

    def __init__(
        self,
        ps: Comm,
        num_groups: int,
        server: int,
        schedule: CheckpointSchedule,
        on_snapshot: Callable[[int, dict], None] | None,
        on_commit: Callable[[int], None] | None,
        stop_requested: Callable[[], bool] | None,
        num_servers: int | None = None,
    ) -> None:
        self.ps, self.num_groups, self.server = ps, num_groups, server
        # (a communicator with pipelined stages holds more than leaders and servers)
        self.num_servers = ps.size - num_groups if num_servers is None else num_servers
        self.schedule = schedule
        self.on_snapshot, self.on_commit = on_snapshot, on_commit
        self.stop_requested = stop_requested
        self.saves = 0
        # server 0: a receive per other server for its "saved c" reports
        self.reports: list[tuple[MPI.Request, np.ndarray]] = []
        if server == 0:
            for s in range(1, self.num_servers):
                self.reports.append(self._listen(s, np.zeros(1, dtype=np.float64)))

    def _listen(self, server: int, buf: np.ndarray) -> tuple[MPI.Request, np.ndarray]:
        source = P.server_rank(self.num_groups, server)
        return self.ps.Irecv(buf, source, P.WRITTEN), buf

    def stop_asked(self) -> bool:
        """Server 0: whether ``stop_requested`` says to stop now."""
        return self.stop_requested is not None and self.stop_requested()

    def save(self, number: int, state: dict, version: int) -> list[int]:
        """Save this server's part of checkpoint ``number`` and report it.

        Returns:
            The leaders that waited for it.
        """
        self.on_snapshot(number, state)
        released = self.schedule.record_save(number, version)
        self.saves += 1
        if self.server == 0:
            self.schedule.record_written(number, 0)
        else:
            msg = np.array([number], dtype=np.float64)
            dest = P.server_rank(self.num_groups, 0)
            self.ps.wait(self.ps.Isend(msg, dest, P.WRITTEN), "checkpoint report")
        return released

    def poll_reports(self) -> None:
        """Server 0: take in the other servers' reports; commit what all saved."""
        if not self.reports and self.on_commit is None:
            return
        for i, (req, buf) in enumerate(self.reports):
            if req.Test():
                self.schedule.record_written(int(buf[0]), i + 1)
                self.reports[i] = self._listen(i + 1, buf)
        for number in self.schedule.take_commits(self.num_servers):
            if self.on_commit is not None:
                self.on_commit(number)

    def wait_for_commits(self) -> None:
        """Server 0 at the end: wait until every saved checkpoint is committed."""
        if self.server != 0 or self.on_commit is None:
            return
        schedule = self.schedule
        self.ps.wait_for(
            lambda: (self.poll_reports(), schedule.committed >= schedule.saved)[1],
            "checkpoint reports from the other servers",
        )

    def cancel_reports(self) -> None:
        """Cancel the receives of further reports (complete with :meth:`wait_cancelled`)."""
        for req, _ in self.reports:
            req.Cancel()

    def wait_cancelled(self) -> None:
        """Complete the cancelled receives."""
        for req, _ in self.reports:
            self.ps.wait(req, "cancelled checkpoint report")
