"""A record of which samples a worker's loop received, for checking positions.

With :meth:`HDF5Loader.log_samples <hybridagg.data.HDF5Loader.log_samples>`
each batch handed to the training loop appends one line to a text file: the
epoch, then the sample ids (row in the split, counted across its files in
order). Markers (``# text``) record events such as a checkpoint, so that a
test can tell what was consumed before the position a checkpoint saved.
Lines are flushed as they are written: a killed run leaves whole lines.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

__all__ = ["LogEntry", "SampleLog", "read_sample_log"]


class SampleLog:
    """Appends the ids of the batches a worker's loop received to ``path``.

    Args:
        path: The file (created with its folder; appended to if it exists).
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # line-buffered; held open for the loader's life, closed by close()
        self._fh = open(self.path, "a", buffering=1)  # noqa: SIM115

    def record(self, epoch: int, ids: np.ndarray) -> None:
        """A batch of epoch ``epoch`` with these sample ids went to the loop."""
        if len(ids):
            self._fh.write(f"{int(epoch)} {' '.join(map(str, ids.tolist()))}\n")

    def mark(self, text: str) -> None:
        """Record an event (one line, ``# text``)."""
        self._fh.write(f"# {text}\n")

    def close(self) -> None:
        """Close the file (a second call does nothing)."""
        if not self._fh.closed:
            self._fh.close()


@dataclass(frozen=True)
class LogEntry:
    """One line of a sample log: a batch (``epoch``, ``ids``) or a marker (``mark``)."""

    epoch: int | None = None
    ids: tuple[int, ...] = ()
    mark: str | None = None


def read_sample_log(path: str | os.PathLike) -> Iterator[LogEntry]:
    """The entries of a sample log, in order."""
    for line in Path(path).read_text().splitlines():
        if line.startswith("# "):
            yield LogEntry(mark=line[2:])
        elif line:
            first, *rest = line.split()
            yield LogEntry(epoch=int(first), ids=tuple(int(v) for v in rest))
