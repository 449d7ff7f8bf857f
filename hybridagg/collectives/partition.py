"""How a buffer or a set of ranks is cut into parts: written once, used everywhere."""

from __future__ import annotations

__all__ = ["even_bounds", "ring_neighbours"]


def even_bounds(total: int, parts: int) -> list[int]:
    """Cut points of ``total`` items into ``parts`` contiguous, near-equal parts.

    Part ``i`` is ``[bounds[i], bounds[i + 1])``; sizes differ by at most one,
    the larger parts last.

    Raises:
        ValueError: ``parts`` is below 1 or ``total`` negative.
    """
    if parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts}")
    if total < 0:
        raise ValueError(f"total must be >= 0, got {total}")
    return [total * i // parts for i in range(parts + 1)]


def ring_neighbours(rank: int, size: int) -> tuple[int, int]:
    """``(left, right)``: the ranks ``rank`` receives from and sends to in a ring."""
    if not 0 <= rank < size:
        raise ValueError(f"rank {rank} is not in a ring of {size}")
    return (rank - 1) % size, (rank + 1) % size
