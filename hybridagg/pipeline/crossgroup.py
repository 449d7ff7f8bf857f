"""Synchronous data parallelism across pipelined groups whose cuts differ.

Each group of a job holds one model replica cut into stages at its own
bounds (communication-aware partitioning gives a group of a fast and a slow
rank other cuts than a group of equals), so the rank that holds a layer
differs from group to group. The cut points of all groups together divide
the layers into *segments*; inside a segment every group has exactly one
holder. :class:`CrossGroupReducer` makes one communicator per segment (its
holders, one per group) and sums the segment's gradients there: every
gradient is reduced exactly once, among exactly the ranks that need it, and
no rank holds more of the model than its stage.

Each group's gradient is the mean over its share ``b_g`` of the global batch
``B``; weighting it by ``b_g / B`` before the sum gives the global batch's
mean gradient, what one process computes on the whole batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import pairwise

import torch
from torch import nn

from ..comm import Comm
from .partition import _check_bounds

__all__ = ["CrossGroupReducer", "holders", "segments"]


def segments(group_bounds: Sequence[Sequence[int]]) -> list[tuple[int, int]]:
    """The layer ranges inside which no group cuts: the union of all cut points.

    Raises:
        ValueError: No groups, or groups that cut models of different depths.
    """
    if not group_bounds:
        raise ValueError("segments of no groups")
    ends = {b[-1] for b in group_bounds}
    if len(ends) != 1:
        raise ValueError(f"groups cut models of different depths: {sorted(ends)}")
    cuts = sorted({c for b in group_bounds for c in b})
    return list(pairwise(cuts))


def holders(
    groups: Sequence[Sequence[int]],
    group_bounds: Sequence[Sequence[int]],
    segment: tuple[int, int],
) -> list[int]:
    """The world rank of each group that holds ``segment``, in group order."""
    out = []
    for ranks, bounds in zip(groups, group_bounds, strict=True):
        for k, (lo, hi) in enumerate(pairwise(bounds)):
            if lo <= segment[0] and segment[1] <= hi:
                out.append(ranks[k])
                break
    return out


class CrossGroupReducer:
    """Sums each segment's gradient over the groups (collective set-up).

    Construction and :meth:`free` are collective over ``world``; a rank
    that holds no layer (a parked rank) takes part in them and in nothing
    else.

    Args:
        world: Every rank of the job.
        groups: Each group's world ranks, in stage order.
        group_bounds: Each group's stage bounds over ``layers``.
        layers: The model's layers (:func:`~hybridagg.pipeline.model_layers`);
            this rank reduces the gradients of the layers it holds.
    """

    def __init__(
        self,
        world: Comm,
        groups: Sequence[Sequence[int]],
        group_bounds: Sequence[Sequence[int]],
        layers: Sequence[nn.Module],
    ) -> None:
        if len(groups) != len(group_bounds):
            raise ValueError(
                f"{len(groups)} groups but {len(group_bounds)} sets of stage bounds"
            )
        listed = [r for ranks in groups for r in ranks]
        if len(set(listed)) != len(listed) or not all(
            0 <= r < world.size for r in listed
        ):
            raise ValueError(
                f"groups {[list(g) for g in groups]} must name distinct ranks of "
                f"0..{world.size - 1}"
            )
        for ranks, bounds in zip(groups, group_bounds, strict=True):
            _check_bounds(list(bounds), len(layers), len(ranks))
        self.segments = segments(group_bounds)
        self.mine: list[tuple[Comm, list[torch.nn.Parameter]]] = []
        for index, seg in enumerate(self.segments):
            ranks = holders(groups, group_bounds, seg)
            held = world.rank in ranks
            comm = world.split(
                index if held else None,
                ranks.index(world.rank) if held else 0,
                name=f"layers {seg[0]}..{seg[1] - 1} across groups",
            )
            if comm is not None:
                params = [
                    p for layer in layers[seg[0] : seg[1]] for p in layer.parameters()
                ]
                self.mine.append((comm, params))

    def allreduce(self, weight: float) -> None:
        """Replace this rank's gradients by the groups' weighted sum.

        Args:
            weight: This group's share of the global batch, ``b_g / B``.
        """
        posted = []
        for comm, params in self.mine:
            if not params:
                continue
            flat = torch.cat(
                [
                    (p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                    for p in params
                ]
            )
            flat.mul_(weight)
            posted.append((comm, params, flat, comm.Iallreduce(flat)))
        for comm, params, flat, req in posted:
            comm.wait(req, "the gradient sum across groups")
            offset = 0
            for p in params:
                n = p.numel()
                summed = flat[offset : offset + n].view_as(p)
                if p.grad is None:
                    p.grad = summed.clone()
                else:
                    p.grad.copy_(summed)
                offset += n

    def free(self) -> None:
        """Free the segments' communicators."""
        for comm, _ in self.mine:
            comm.free()
        self.mine = []
