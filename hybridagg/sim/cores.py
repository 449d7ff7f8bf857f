"""A machine's cores shared by what runs on them at once (pure logic).

The processor sharing of SimGrid's CPU model (each work gets an equal
share of the cores, at most one core), in closed form: the calibration
solves the kernel's rate with it, and the analytic model times a ring's
phase on an emulated cluster's machine (:mod:`.calibrate`, :mod:`.analytic`).
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["shared_seconds"]


def shared_seconds(works: Iterable[float], spinners: int, cores: int) -> float:
    """Seconds until every work of ``works`` (seconds each on a core of its
    own) is done, all starting at once on ``cores`` cores beside
    ``spinners`` works that never end (ranks that poll while they wait).

    Raises:
        ValueError: A negative work or spinner count, or no core.
    """
    left = sorted(float(w) for w in works)
    if cores < 1 or spinners < 0 or any(w < 0 for w in left):
        raise ValueError(
            f"shared_seconds: needs works >= 0, spinners >= 0 and cores >= 1, "
            f"got {left}, {spinners}, {cores}"
        )
    seconds = done = 0.0
    for i, work in enumerate(left):
        # the works still running share the cores equally, at most one each
        rate = min(1.0, cores / (len(left) - i + spinners))
        seconds += (work - done) / rate
        done = work
    return seconds
