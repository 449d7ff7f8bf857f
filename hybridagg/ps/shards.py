"""How the flat model is cut into server shards (pure logic).

The parameters, flattened in model order, form one vector. It is cut into
``K`` contiguous shards of equal size to within one element, so every server
holds the same number of bytes, even when one tensor dominates the model. A
shard may therefore hold a piece of a tensor; the server's optimizer then
updates that piece as a tensor of its own, which is exact for element-wise
optimizers (SGD with momentum and weight decay, Adam, AdamW, RMSprop,
Adagrad, ...). Optimizers that compute per-tensor statistics (LAMB, LARS,
Adafactor) would see pieces: use one server for them.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import pairwise

from ..collectives.partition import even_bounds

__all__ = ["Piece", "optimizer_order", "part_ranges", "pieces_of", "shard_ranges"]


def shard_ranges(total: int, shards: int) -> list[tuple[int, int]]:
    """Cut ``range(total)`` into ``shards`` contiguous, equal-size ranges.

    Raises:
        ValueError: ``shards`` is not positive or exceeds ``total``.
    """
    if shards < 1:
        raise ValueError(f"need at least one shard, got {shards}")
    if total < shards:
        raise ValueError(f"{shards} shards cannot split a model of {total} elements")
    # The larger shards come first, not where even_bounds puts them: a
    # checkpointed shard is restored only into a shard of its own size, so
    # this cut is part of the checkpoint format.
    base, extra = divmod(total, shards)
    ranges, start = [], 0
    for s in range(shards):
        stop = start + base + (1 if s < extra else 0)
        ranges.append((start, stop))
        start = stop
    return ranges


@dataclass(frozen=True)
class Piece:
    """The part of one parameter that lies in one shard.

    Attributes:
        param: Index of the parameter (model order).
        start: First element of the piece within the parameter (flattened).
        stop: One past its last element.
        offset: Where the piece starts within the shard.
    """

    param: int
    start: int
    stop: int
    offset: int

    @property
    def numel(self) -> int:
        return self.stop - self.start


def pieces_of(numels: list[int], lo: int, hi: int) -> list[Piece]:
    """The pieces of parameters (of sizes ``numels``) inside ``[lo, hi)`` of the flat vector."""
    pieces, base = [], 0
    for index, n in enumerate(numels):
        a, b = max(lo, base), min(hi, base + n)
        if a < b:
            pieces.append(Piece(index, a - base, b - base, a - lo))
        base += n
    return pieces


def part_ranges(
    length: int, part_elems: int, cuts: tuple[int, ...] | list[int] = ()
) -> list[tuple[int, int]]:
    """Cut a shard of ``length`` elements into parts of at most ``part_elems``.

    Parts are the unit of the pipelined push, update and reply; the cut is
    even (sizes differ by at most one element). An empty shard has no parts.

    Args:
        length: The shard's elements.
        part_elems: The largest part.
        cuts: Offsets in the shard where a part must also end (a pipelined
            group's stage boundaries: each part then belongs to one stage,
            which alone sends and receives it). Offsets outside ``(0,
            length)`` are ignored; without cuts the parts are as before.

    Raises:
        ValueError: ``part_elems`` is not positive.
    """
    if part_elems < 1:
        raise ValueError(f"part size must be positive, got {part_elems}")
    if length == 0:
        return []
    edges = [0, *sorted({int(c) for c in cuts if 0 < int(c) < length}), length]
    parts = []
    for lo, hi in pairwise(edges):
        bounds = even_bounds(hi - lo, -(-(hi - lo) // part_elems))
        parts += [(lo + a, lo + b) for a, b in pairwise(bounds)]
    return parts


def optimizer_order(
    numels: list[int], group_of: list[int], lo: int, hi: int
) -> list[tuple[int, list[tuple[int, int]]]]:
    """How the optimizer of the flat range ``[lo, hi)`` sees its pieces.

    A server part's optimizer has one parameter group per user group that
    has a piece in the range, in increasing group order, each holding its
    pieces in model order; its ``state_dict`` numbers the pieces in that
    order. The store builds its optimizers from this, and resharding reads
    saved optimizer states by it, so both agree on which state is whose.

    Args:
        numels: Elements of each parameter (model order).
        group_of: The user's parameter group of each parameter.
        lo: First element of the range in the flat model.
        hi: One past its last element.

    Returns:
        ``[(user group, [(start, stop) of each piece in the flat model]), ...]``.
    """
    by_group: dict[int, list[tuple[int, int]]] = {}
    base = 0
    starts = []
    for n in numels:
        starts.append(base)
        base += n
    for piece in pieces_of(numels, lo, hi):
        start = starts[piece.param] + piece.start
        by_group.setdefault(group_of[piece.param], []).append(
            (start, start + piece.numel)
        )
    return [(g, by_group[g]) for g in sorted(by_group)]
