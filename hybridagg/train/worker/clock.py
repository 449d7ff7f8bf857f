"""The training clock: seconds since the start, and training time for the record."""

from __future__ import annotations

import time

__all__ = ["TrainClock"]


class TrainClock:
    """Owns the run's time: wall time since the start barrier, and training time.

    Training time is what a resumed run had already trained plus the wall
    time since the start, less the time spent validating; it goes into
    checkpoints, validation records and the time to the target accuracy.

    Args:
        start: ``time.perf_counter()`` at the start barrier.
        offset: Training seconds of the run this one resumes.
    """

    def __init__(self, start: float, offset: float = 0.0) -> None:
        self.start = start
        self.offset = offset
        self.eval_seconds = 0.0
        """Seconds spent validating in this run."""

    def since_start(self) -> float:
        """Wall seconds since the start barrier (the ``t`` of metrics records)."""
        return time.perf_counter() - self.start

    def train_time(self) -> float:
        """Training seconds so far, over every run of a resumed job."""
        return self.offset + time.perf_counter() - self.start - self.eval_seconds
