"""Emulated heterogeneity: per-rank slowdown factors that may change over time.

A spec gives each worker rank a factor, optionally as a schedule of phases
that start at given seconds since the start of training::

    0-1:1,2-3:4                    ranks 2 and 3 are four times slower
    0-1:1,2-3:4@0;0-1:3,2-3:1@30   ... and from 30 s on, ranks 0-1 are 3x slower

Ranks a phase does not name run at factor 1. Emulation sleeps instead of
spinning, so a small machine running more ranks than cores still measures
the coordination honestly. This module is pure logic; the speed probe of the
topology and the training driver both use it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = [
    "Slowdown",
    "fastest_ranks",
    "format_slowdown",
    "parse_rank_ranges",
    "parse_rank_values",
    "parse_slowdown",
]


def parse_rank_ranges(text: str, what: str = "rank range") -> list[int]:
    """Parse ``"0-3"`` or ``"5"`` or ``"0-1+4"`` into a sorted list of ranks.

    Raises:
        ValueError: Malformed text, a negative rank or a reversed range.
    """
    ranks: list[int] = []
    for part in text.split("+"):
        part = part.strip()
        if not part:
            raise ValueError(f"empty {what} in {text!r}")
        lo, sep, hi = part.partition("-")
        try:
            first = int(lo)
            last = int(hi) if sep else first
        except ValueError:
            raise ValueError(f"{what} {part!r} is not N or N-M") from None
        if first < 0 or last < first:
            raise ValueError(f"{what} {part!r} must be N-M with 0 <= N <= M")
        ranks.extend(range(first, last + 1))
    return sorted(ranks)


def parse_rank_values(
    text: str, what: str, value: str, *, positive: bool = True, where: str = ""
) -> dict[int, float]:
    """Parse ``RANKS:VALUE`` items separated by commas (``"0-1:4,2:3.5"``).

    Args:
        text: The items.
        what: The option, for messages (``"slowdown"``).
        value: What the number is, for messages (``"factor"``).
        positive: Require values above 0 (else at or above 0).
        where: Appended to the message of a rank named twice.

    Raises:
        ValueError: An item that is not ``RANKS:VALUE``, a value that is not
            a finite number in range, or a rank named twice.
    """
    out: dict[int, float] = {}
    for item in text.split(","):
        ranks_text, colon, value_text = item.strip().partition(":")
        if not colon:
            raise ValueError(f"{what} item {item!r} is not RANKS:{value.upper()}")
        try:
            number = float(value_text)
        except ValueError:
            raise ValueError(f"{what} {value} {value_text!r} is not a number") from None
        if not (math.isfinite(number) and (number > 0 if positive else number >= 0)):
            want = "positive" if positive else "non-negative"
            raise ValueError(f"{what} {value} {number} must be a finite {want} number")
        for rank in parse_rank_ranges(ranks_text, f"{what} rank range"):
            if rank in out:
                raise ValueError(f"{what} names rank {rank} twice{where}")
            out[rank] = number
    return out


@dataclass(frozen=True)
class Slowdown:
    """A validated slowdown schedule.

    Attributes:
        phases: ``(start_seconds, {rank: factor})`` pairs sorted by start.
    """

    phases: tuple[tuple[float, dict[int, float]], ...] = ()

    def factor(self, rank: int, elapsed: float = 0.0) -> float:
        """Return ``rank``'s factor ``elapsed`` seconds after training started."""
        current: dict[int, float] = {}
        for start, factors in self.phases:
            if elapsed >= start:
                current = factors
            else:
                break
        return current.get(rank, 1.0)

    def ranks(self) -> set[int]:
        """Every rank the schedule names."""
        return {r for _, factors in self.phases for r in factors}

    def validate_workers(self, num_workers: int) -> None:
        """Raise ``ValueError`` if the spec names a rank that is not a worker."""
        extra = sorted(r for r in self.ranks() if r >= num_workers)
        if extra:
            raise ValueError(
                f"slowdown names ranks {extra}, but the workers are 0-{num_workers - 1}"
            )

    @property
    def changes(self) -> bool:
        """Whether the factors change during the run."""
        return len(self.phases) > 1

    def __bool__(self) -> bool:
        return any(f != 1.0 for _, fs in self.phases for f in fs.values())


def parse_slowdown(spec: str | None) -> Slowdown:
    """Parse a slowdown spec (see the module docstring); ``None``/``""`` is none.

    Raises:
        ValueError: Malformed spec, a factor that is not a finite positive
            number, a rank named twice in one phase, a start time that is
            negative, not finite or repeated.
    """
    if spec is None or not spec.strip():
        return Slowdown()
    phases: list[tuple[float, dict[int, float]]] = []
    for phase_text in spec.split(";"):
        phase_text = phase_text.strip()
        body, at, start_text = phase_text.partition("@")
        try:
            start = float(start_text) if at else 0.0
        except ValueError:
            raise ValueError(
                f"slowdown start time {start_text!r} is not a number"
            ) from None
        if not math.isfinite(start) or start < 0:
            raise ValueError(
                f"slowdown start time {start} must be a finite number >= 0"
            )
        factors = parse_rank_values(body, "slowdown", "factor", where=" in one phase")
        phases.append((start, factors))
    phases.sort(key=lambda p: p[0])
    starts = [p[0] for p in phases]
    if len(set(starts)) != len(starts):
        raise ValueError(f"slowdown has two phases starting at the same time: {spec!r}")
    return Slowdown(tuple(phases))


def fastest_ranks(slowdown: Slowdown, workers: int, count: int) -> list[int]:
    """The ``count`` fastest of ``workers`` ranks under a fixed slowdown, ascending.

    Lower factors first, then lower ranks.

    Raises:
        ValueError: ``count`` is not in 1..``workers``, or the factors change
            during the run (which ranks are fastest then depends on when).
    """
    if slowdown.changes:
        raise ValueError("the fastest ranks of a changing slowdown depend on the time")
    if not 1 <= count <= workers:
        raise ValueError(f"count {count} must be within 1 and the {workers} workers")
    order = sorted(range(workers), key=lambda r: (slowdown.factor(r), r))
    return sorted(order[:count])


def format_slowdown(factors: dict[int, float]) -> str:
    """A fixed slowdown spec for ``{rank: factor}`` (consecutive ranks of one
    factor as a range), which :func:`parse_slowdown` reads back; ``""`` for none.
    """
    items: list[str] = []
    run: list[int] = []

    def close() -> None:
        first, last = run[0], run[-1]
        ranks = f"{first}" if first == last else f"{first}-{last}"
        value = float(factors[first])
        items.append(f"{ranks}:{int(value) if value.is_integer() else repr(value)}")

    for rank in sorted(factors):
        if run and (rank != run[-1] + 1 or factors[rank] != factors[run[0]]):
            close()
            run = []
        run.append(rank)
    if run:
        close()
    return ",".join(items)
