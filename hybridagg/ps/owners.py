"""Which rank sends and receives each part of a pipelined group's push (pure logic).

A data-parallel group's leader holds the whole model and exchanges every
part with the servers. A pipelined group (:mod:`hybridagg.pipeline`) has
no such rank: each stage holds the parameters of its layers, a contiguous
range of the flat model, and exchanges exactly those parts itself. The
leader (stage 0) still sends the request header and receives the reply
header; the parts come from, and go back to, their stage.

Owners are given per group as ``(lo, hi, rank)`` triples over the flat
model, ``rank`` a rank of the parameter-server communicator; the ranges
must tile the model. Parts are cut at every owner boundary
(:func:`owner_cuts` feeds :func:`~hybridagg.ps.shards.part_ranges`), so
each part has exactly one owner.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

__all__ = ["Owners", "PartOwners", "check_owners", "owner_cuts"]

Owners = Mapping[int, Sequence[tuple[int, int, int]]]
"""Per pipelined group: ``(lo, hi, rank)`` of each stage's range of the flat model."""


def check_owners(owners: Owners, total: int, num_groups: int) -> None:
    """Check that each group's ranges tile ``[0, total)`` in order.

    Raises:
        ValueError: A group index outside the job, ranges that leave a gap,
            overlap or do not end at ``total``, or an empty range.
    """
    for g, ranges in owners.items():
        if not 0 <= g < num_groups:
            raise ValueError(f"owners name group {g}; the job has {num_groups}")
        at = 0
        for lo, hi, rank in ranges:
            if lo != at or hi <= lo:
                raise ValueError(
                    f"group {g}'s stage ranges must tile the flat model in "
                    f"order without empty ranges: got {list(ranges)} for "
                    f"{total} elements"
                )
            if rank < 0:
                raise ValueError(f"group {g}: owner rank {rank} is negative")
            at = hi
        if at != total:
            raise ValueError(
                f"group {g}'s stage ranges end at {at}, the flat model at {total}"
            )


def owner_cuts(owners: Owners) -> tuple[int, ...]:
    """Every stage boundary of every pipelined group, as flat offsets, sorted."""
    return tuple(
        sorted({lo for ranges in owners.values() for lo, _, _ in ranges} - {0})
    )


class PartOwners:
    """The rank that sends and receives each part of a server's shard, per group.

    Args:
        owners: Per pipelined group, its stages' ``(lo, hi, rank)``.
        shard_lo: Where the server's shard begins in the flat model.
        parts: The shard's parts, as ranges of the shard (cut at
            :func:`owner_cuts`).

    Raises:
        ValueError: A part that straddles a stage boundary (the parts were
            not cut at the owners' boundaries).
    """

    def __init__(
        self, owners: Owners, shard_lo: int, parts: Sequence[tuple[int, int]]
    ) -> None:
        self.table: dict[int, list[int]] = {}
        for g, ranges in owners.items():
            ranks = []
            for a, b in parts:
                lo, hi = shard_lo + a, shard_lo + b
                holder = [r for x, y, r in ranges if x <= lo and hi <= y]
                if not holder:
                    raise ValueError(
                        f"part [{lo}, {hi}) of the flat model straddles a stage "
                        f"boundary of group {g} ({list(ranges)})"
                    )
                ranks.append(holder[0])
            self.table[int(g)] = ranks

    def of(self, g: int, part: int) -> int:
        """The rank that sends group ``g``'s part ``part`` and receives its reply.

        A data-parallel group's leader is rank ``g`` of the communicator.
        """
        ranks = self.table.get(g)
        return g if ranks is None else ranks[part]
