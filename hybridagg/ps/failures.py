"""What a server raises when a group leader's traffic fails because it died."""

from __future__ import annotations

from mpi4py import MPI

from ..comm import Comm
from ..comm.ulfm import is_process_failure

__all__ = ["LeaderLost", "leader_lost"]


class LeaderLost(Exception):
    """Leader ``group`` (world rank ``rank``) died: found by a failed receive or send.

    Args:
        group: The group.
        rank: Its leader's world rank.
    """

    def __init__(self, group: int, rank: int) -> None:
        super().__init__(f"the leader of group {group} (world rank {rank}) died")
        self.group, self.rank = group, rank


def leader_lost(ps: Comm, g: int, exc: MPI.Exception) -> LeaderLost:
    """``exc`` (raised by traffic with leader ``g``) as :class:`LeaderLost`.

    Raises:
        MPI.Exception: ``exc`` itself, when it is not a peer's failure.
    """
    if not is_process_failure(exc):
        raise exc
    return LeaderLost(g, ps.world_rank_of(g))
