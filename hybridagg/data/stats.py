"""Stall statistics: where a worker's time went on data."""

from __future__ import annotations

from dataclasses import asdict, dataclass

__all__ = ["LoaderStats"]


@dataclass
class LoaderStats:
    """Where a worker's time went on data (cumulative over epochs).

    The training loop's side (the waits) is recorded by
    :meth:`record_batch`; the reader's side (bytes, read time, windows) by the
    reader thread itself, so the two halves never write the same field.

    Attributes:
        wait_seconds: Total time ``next()`` waited for a batch (the stall).
        last_wait: Wait of the most recent ``next()``.
        max_wait: Longest single wait.
        batches: Batches returned.
        samples: Samples returned.
        bytes_read: Bytes read from the files.
        read_seconds: Time the reader spent in HDF5 reads.
        windows: Windows (dynamic chunks) read.
    """

    wait_seconds: float = 0.0
    last_wait: float = 0.0
    max_wait: float = 0.0
    batches: int = 0
    samples: int = 0
    bytes_read: int = 0
    read_seconds: float = 0.0
    windows: int = 0

    def record_batch(self, wait: float, samples: int) -> None:
        """Count a batch of ``samples`` the loop waited ``wait`` seconds for."""
        self.wait_seconds += wait
        self.last_wait = wait
        self.max_wait = max(self.max_wait, wait)
        self.batches += 1
        self.samples += samples

    def stall_fraction(self, elapsed: float) -> float:
        """Share of ``elapsed`` seconds spent waiting for data."""
        return self.wait_seconds / elapsed if elapsed > 0 else 0.0

    def as_dict(self) -> dict[str, float]:
        """The fields as a dict (for metrics records)."""
        return asdict(self)
