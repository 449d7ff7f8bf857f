"""Emulated heterogeneity during training: pacing each step by sleeping.

With ``--sample-ms MS`` every sample has a base compute time: a step of ``b``
samples on a rank with slowdown factor ``f`` lasts ``MS x b x f``
milliseconds; the driver sleeps for what the real compute did not take, so a
smaller batch really takes less time, as on real hardware. Without a base
time, a factor ``f`` stretches the rank's real compute time ``f``-fold.
Sleeping (not spinning) keeps an oversubscribed machine honest: the ranks
that wait do not steal the cores of the ranks that compute.

The ideal throughput of a run, the yardstick of every benchmark, is the sum
over workers of each worker's throughput alone: under emulation
``sum_i 1000 / (MS x f_i)`` samples/s, averaged over a schedule's phases.
"""

from __future__ import annotations

import time

from ..slowdown import Slowdown

__all__ = ["Pacer", "ideal_samples_per_sec"]


class Pacer:
    """Stretches one rank's steps to its emulated speed.

    Args:
        slowdown: The schedule of factors.
        rank: This worker's world rank.
        sample_ms: Base compute milliseconds per sample (0: none).
        start: ``time.perf_counter()`` at the start of training (the same
            moment on every rank, so schedule changes hit every mode alike).
    """

    def __init__(
        self, slowdown: Slowdown, rank: int, sample_ms: float, start: float
    ) -> None:
        if sample_ms < 0:
            raise ValueError(f"sample_ms must be >= 0, got {sample_ms}")
        self.slowdown, self.rank, self.sample_ms, self.start = (
            slowdown,
            rank,
            sample_ms,
            start,
        )

    @property
    def emulating(self) -> bool:
        """Whether steps are paced at all: a base time per sample, or some
        phase gives this rank a factor other than 1."""
        return self.sample_ms > 0 or any(
            factors.get(self.rank, 1.0) != 1.0 for _, factors in self.slowdown.phases
        )

    def factor(self, now: float | None = None) -> float:
        """This rank's factor now."""
        now = time.perf_counter() if now is None else now
        return self.slowdown.factor(self.rank, now - self.start)

    def target(self, samples: int, compute_s: float) -> float:
        """How long a step of ``samples`` samples should take, in seconds."""
        f = self.factor()
        if self.sample_ms > 0:
            return self.sample_ms / 1000.0 * samples * f
        return compute_s * f

    def pace(self, samples: int, compute_s: float) -> float:
        """Sleep out the rest of the step; returns the seconds slept."""
        wait = self.target(samples, compute_s) - compute_s
        if wait <= 0:
            return 0.0
        time.sleep(wait)
        return wait


def ideal_samples_per_sec(
    slowdown: Slowdown, workers: int, sample_ms: float, wall_s: float
) -> float:
    """``sum_i 1000 / (MS x f_i)``, time-averaged over the run's ``wall_s`` seconds.

    Raises:
        ValueError: ``sample_ms`` is not positive (no emulated base time).
    """
    if sample_ms <= 0:
        raise ValueError("the analytic ideal needs sample_ms > 0")

    def rate(t: float) -> float:
        return sum(1000.0 / (sample_ms * slowdown.factor(r, t)) for r in range(workers))

    starts = sorted({0.0} | {s for s, _ in slowdown.phases if 0 < s < wall_s})
    if wall_s <= 0:
        return rate(0.0)
    total = 0.0
    for i, s in enumerate(starts):
        end = starts[i + 1] if i + 1 < len(starts) else wall_s
        total += rate(s) * (end - s)
    return total / wall_s
