"""Heterogeneity: its emulation and the adaptive batch sizes that answer it (pure logic)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ...slowdown import Slowdown, parse_slowdown
from .fields import Concern, option

__all__ = ["AdaptiveOptions", "EmulationOptions"]


@dataclass(frozen=True, kw_only=True)
class EmulationOptions(Concern):
    """Emulated heterogeneity: how much slower each rank computes."""

    help_group: ClassVar[str] = "heterogeneity emulation"

    slowdown: str | None = None
    """per-rank factors, e.g. '0-1:1,2-3:4' or '0-1:1,2-3:4@0;0-1:3,2-3:1@30'
    (changes at 30 s)"""

    sample_ms: float = option(0.0, at_least=0)
    """base compute milliseconds per sample; steps sleep to MS x batch x factor"""

    def _check(self) -> None:
        self.parsed_slowdown()  # raises on a malformed spec

    def parsed_slowdown(self) -> Slowdown:
        """The ``--slowdown`` schedule."""
        return parse_slowdown(self.slowdown)


@dataclass(frozen=True, kw_only=True)
class AdaptiveOptions(Concern):
    """Adaptive batch sizes (OmniLearn's controller, :mod:`hybridagg.batching`)."""

    help_group: ClassVar[str] = "adaptive batch sizes (OmniLearn's controller)"

    adaptive_batch: bool = False
    """move batch from slow workers to fast ones (sync: all workers, global batch
    kept; hybrid: inside groups and across groups by server 0; async: server 0
    sizes each worker's batch)"""

    adaptive_groups: bool = False
    """hybrid: server 0 also sizes each group's total batch so groups reach the
    server at similar rates"""

    batch_deadband: float = 0.2
    """act only when some batch changes by more than this fraction"""

    batch_window: int = option(5, at_least=1)
    """steps per measurement window (one decision per window)"""

    batch_first_window: int = option(2, at_least=1)
    """steps of the first window, before any speed is known"""

    batch_probe: int | None = option(None, at_least=0)
    """sync and hybrid: before the first step every worker times this many
    samples (a forward and backward on zeros, not trained on) and the batch is
    split by the result, so the run does not start at the slowest worker's pace
    (default: a quarter of --batch-size; 0: off)"""

    batch_smoothing: float = 0.5
    """weight of the newest window in the speed estimate"""

    batch_shift: float = option(0.5, at_least=0)
    """a worker whose step's seconds per sample depart from its estimate by more
    than this fraction (either way) has changed speed: the window closes at once
    and its estimate restarts from the new speed instead of being smoothed (0: off)"""

    batch_shift_steps: int = option(1, at_least=1)
    """steps in a row that must depart the same way before --batch-shift acts"""

    min_batch: int = option(1, at_least=1)
    """smallest batch of a worker"""

    max_batch: int | None = None
    """largest batch of a worker (memory)"""

    def _check(self) -> None:
        if not 0 <= self.batch_deadband < 1:
            raise ValueError(
                f"--batch-deadband must be in [0, 1), got {self.batch_deadband}"
            )
        if not 0 < self.batch_smoothing <= 1:
            raise ValueError(
                f"--batch-smoothing must be in (0, 1], got {self.batch_smoothing}"
            )
