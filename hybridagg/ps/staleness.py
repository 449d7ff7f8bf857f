"""The groups' progress as a server sees it, and the staleness bound (pure logic).

Bounded staleness (SSP, ``staleness_bound = s``): server 0 holds the reply
to a leader that is more than ``s`` of its own updates ahead of the slowest
group still running, and releases it when that group catches up; the
leader waits for server 0's reply, so it cannot run further ahead. The unit
is a group's own updates; while one gradient is in flight the other
``G - 1`` groups can apply at most about ``s + 1`` updates each, so the
version staleness an update sees is at most about ``(G - 1)(s + 1)``. While
a checkpoint is pending no reply is held (the held group must reach the
snapshot), so around a checkpoint a group may get one update further ahead.

A group dropped after one of its ranks died (``--on-group-failure
continue``, :meth:`GroupBook.drop`) counts as finished: the bound stops
waiting for it, and a reply held for it is discarded.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["GroupBook", "HeldReply"]


@dataclass(frozen=True)
class HeldReply:
    """What a held reply to a push will carry once released."""

    group: int
    staleness: int
    lr_scale: float


class GroupBook:
    """Each group's updates, which groups are done, and the replies held back.

    Args:
        num_groups: Number of groups ``G``.
        bound: SSP bound ``s`` in a group's own updates; ``None``: no bound
            (only server 0 enforces one: the others get ``None``).
        updates: Updates of each group so far (a resumed run's counts).

    Attributes:
        updates: Updates applied for each group.
        done: Groups whose leader has finished, or that were dropped.
        lost: Groups dropped after a rank died: the time each was dropped
            and the world rank found dead (-1: unknown).
        held: Replies held back, by group.
        held_count: Replies held back so far.
        max_staleness: Largest staleness of an update so far.
    """

    def __init__(
        self, num_groups: int, bound: int | None, updates: list[int] | None = None
    ) -> None:
        self.num_groups = num_groups
        self.bound = bound
        self.updates = [0] * num_groups if updates is None else list(updates)
        self.done: set[int] = set()
        self.lost: dict[int, tuple[float, int]] = {}
        self.held: dict[int, HeldReply] = {}
        self.held_count = 0
        self.max_staleness = 0

    @property
    def all_done(self) -> bool:
        """Whether every group's leader has finished."""
        return len(self.done) == self.num_groups

    def record(self, group: int, staleness: int) -> None:
        """Count an update of ``group`` with this staleness."""
        self.updates[group] += 1
        self.max_staleness = max(self.max_staleness, staleness)

    def finish(self, group: int) -> None:
        """``group``'s leader is done."""
        self.done.add(group)

    def drop(self, group: int, when: float, dead_rank: int = -1) -> bool:
        """Drop ``group`` (one of its ranks died): it counts as done from now on.

        Its held reply, if any, is discarded (nobody will receive it), and
        the staleness bound no longer waits for it.

        Args:
            group: The group.
            when: When it was dropped (the caller's clock).
            dead_rank: The world rank found dead (-1: unknown).

        Returns:
            Whether the group was running (a second drop, or a drop of a
            group that finished, changes nothing).
        """
        if group in self.done:
            return False
        self.done.add(group)
        self.lost[group] = (float(when), int(dead_rank))
        self.held.pop(group, None)
        return True

    def too_far_ahead(self, group: int, checkpoint_pending: bool = False) -> bool:
        """Whether ``group`` is more than the bound ahead of the slowest running group.

        Args:
            group: The group.
            checkpoint_pending: A checkpoint is requested and not yet saved:
                nobody waits then, since every group must reach it.
        """
        if self.bound is None or checkpoint_pending:
            return False
        running = [
            self.updates[h] for h in range(self.num_groups) if h not in self.done
        ]
        return bool(running) and self.updates[group] - min(running) > self.bound

    def hold(self, reply: HeldReply) -> None:
        """Hold back the reply to a push until :meth:`release` lets it go."""
        self.held[reply.group] = reply
        self.held_count += 1

    def release(
        self, everyone: bool = False, checkpoint_pending: bool = False
    ) -> list[HeldReply]:
        """Take the held replies that may go now (``everyone``: all), by group.

        Args:
            everyone: Release every held reply.
            checkpoint_pending: See :meth:`too_far_ahead`.
        """
        out = []
        for group in sorted(self.held):
            if everyone or not self.too_far_ahead(group, checkpoint_pending):
                out.append(self.held.pop(group))
        return out
