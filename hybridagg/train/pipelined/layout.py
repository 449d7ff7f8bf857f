"""Where a job with pipelined groups puts its stages and parameters (pure logic).

Every group is a pipeline: a group named by ``--pipeline-groups`` cuts one
replica over its ranks; any other group must be one rank, a pipeline of one
stage holding the whole replica. Every group's stages then share one flat
layout of the parameters (layer order), so each stage owns a contiguous
range of it, which is what it exchanges with the servers
(:mod:`hybridagg.ps.owners`) or sums with the other groups.

The servers' communicator lists the leaders (group order), then the
servers, then every other stage (world order): :func:`ps_order`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate

from ...pipeline.groups import layout_conflicts

__all__ = ["PipelineLayout", "flat_owners", "ps_order"]


@dataclass(frozen=True)
class PipelineLayout:
    """The groups of a job with pipelined groups, and which are pipelines.

    Args:
        groups: Each group's world ranks, ascending (stage ``i`` is the
            ``i``-th rank).
        pipelined: The groups named by ``--pipeline-groups``.

    Raises:
        ValueError: A group not named that has several ranks (its ranks
            would hold whole replicas and all-reduce, which a job of
            pipelines does not do), or a named group of one rank.
    """

    groups: tuple[tuple[int, ...], ...]
    pipelined: tuple[int, ...]

    def __post_init__(self) -> None:
        lone, wide = layout_conflicts(self.groups, self.pipelined)
        if lone:
            raise ValueError(
                f"--pipeline-groups names group(s) {lone} of one rank: a "
                "pipeline needs at least two ranks"
            )
        if wide:
            raise ValueError(
                f"group(s) {wide} have several ranks but are not in "
                "--pipeline-groups: in a job with pipelined groups every other "
                "group is one rank holding a whole replica (name them in "
                "--pipeline-groups, or split them with --groups)"
            )

    def group_of(self, rank: int) -> int:
        """The group of world rank ``rank`` (a worker)."""
        for g, ranks in enumerate(self.groups):
            if rank in ranks:
                return g
        raise ValueError(f"rank {rank} is in no group")

    def stage_of(self, rank: int) -> int:
        """The stage world rank ``rank`` holds in its group."""
        return self.groups[self.group_of(rank)].index(rank)

    @property
    def readers(self) -> tuple[int, ...]:
        """The ranks that read training data: every group's first stage."""
        return tuple(ranks[0] for ranks in self.groups)


def ps_order(groups: Sequence[Sequence[int]], servers: Sequence[int]) -> list[int]:
    """World ranks in the order of the servers' communicator.

    Leaders first (rank ``g`` is group ``g``'s leader, as the protocol
    addresses them), then the servers, then every other stage.
    """
    leaders = [ranks[0] for ranks in groups]
    others = sorted(r for ranks in groups for r in ranks[1:])
    return [*leaders, *servers, *others]


def flat_owners(
    groups: Sequence[Sequence[int]],
    group_bounds: Sequence[Sequence[int]],
    layer_numels: Sequence[int],
    order: Sequence[int],
) -> dict[int, list[tuple[int, int, int]]]:
    """Each group's stages' ranges of the flat model and their servers' ranks.

    Args:
        groups: Each group's world ranks, in stage order.
        group_bounds: Each group's stage bounds over the layers.
        layer_numels: Parameters of each layer.
        order: :func:`ps_order` (a world rank's index is its rank there).

    Returns:
        ``{group: [(lo, hi, ps_rank), ...]}`` in stage order.

    Raises:
        ValueError: A stage without parameters (it would own an empty range).
    """
    offsets = [0, *accumulate(layer_numels)]
    index = {r: i for i, r in enumerate(order)}
    owners = {}
    for g, (ranks, bounds) in enumerate(zip(groups, group_bounds, strict=True)):
        stages = []
        for k, rank in enumerate(ranks):
            lo, hi = offsets[bounds[k]], offsets[bounds[k + 1]]
            if hi <= lo:
                raise ValueError(
                    f"stage {k} of group {g} (layers {bounds[k]}-"
                    f"{bounds[k + 1] - 1}) holds no parameters; a stage must "
                    "own a part of the model"
                )
            stages.append((lo, hi, index[rank]))
        owners[g] = stages
    return owners
