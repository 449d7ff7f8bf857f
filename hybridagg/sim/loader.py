"""A worker's loader under dynamic shares, as the simulator draws it (pure logic).

In a hybrid or async run of ``--epochs`` the workers take an epoch's
chunks (a loader window each) from a shared counter, so fast workers take
more of them (:mod:`hybridagg.data.shares`). A worker's loader draws ahead
of the batch it computes: its read-ahead thread cuts ``cut_ahead`` batches
into a queue (the queue's ``prefetch`` and the one the thread holds while
it is full), and its window reader draws ``windows_ahead`` windows beyond
the one being cut (two queued, one drawn and waiting for a free buffer).
Batches are cut across window boundaries; a pass ends with whatever partial
batch is left. What a worker has drawn is its own to compute, so a slow
worker's draws make the end of an epoch, and of the run, wait for it.

The counter runs on across epochs: a draw beyond the worker's epoch ends
its pass, and the chunk waits for the epoch it belongs to. An epoch ends
for a group when an update carries no samples: every member has read its
share (:class:`hybridagg.train.worker.epochs.Epochs`); its members then
begin the next epoch, whose chunks the faster groups may already have
taken. :class:`Chunks` is the counter; :class:`WorkerLoader` is one
worker's draws.
"""

from __future__ import annotations

from collections import deque

__all__ = ["Chunks", "WorkerLoader"]


class Chunks:
    """The run's shared chunk counter: chunk ``c`` is window ``c mod n`` of
    epoch ``c // n`` (``n`` windows an epoch, the last holding the rest).

    Args:
        epochs: Epochs in the run.
        samples: Samples of an epoch.
        chunk: Samples of a chunk (a window).

    Raises:
        ValueError: A count below 1.
    """

    def __init__(self, epochs: int, samples: int, chunk: int) -> None:
        for name, value in (("epochs", epochs), ("samples", samples), ("chunk", chunk)):
            if int(value) < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        self.epochs, self.samples, self.chunk = int(epochs), int(samples), int(chunk)
        self.per_epoch = -(-self.samples // self.chunk)
        self._next = 0

    def draw(self) -> int:
        """The next chunk number (the counter's ``fetch_add``)."""
        self._next += 1
        return self._next - 1

    @property
    def drawn(self) -> int:
        """Chunks drawn so far (the counter's value)."""
        return self._next

    def epoch_of(self, c: int) -> int:
        """The epoch chunk ``c`` belongs to."""
        return c // self.per_epoch

    def size(self, c: int) -> int:
        """Samples of chunk ``c``."""
        if c % self.per_epoch < self.per_epoch - 1:
            return self.chunk
        return self.samples - (self.per_epoch - 1) * self.chunk


class WorkerLoader:
    """One worker's loader: what it has drawn and cut, for the epoch it is in.

    A draw of a later epoch's chunk ends the pass's draws and is kept for
    that epoch; a draw of an earlier epoch's is skipped (as
    :func:`hybridagg.data.position._next_piece` does).

    Args:
        chunks: The run's counter.
        batch: The worker's batch size.
        cut_ahead: Batches cut beyond the one computed.
        windows_ahead: Chunks drawn beyond the one being cut.
    """

    def __init__(
        self, chunks: Chunks, batch: int, cut_ahead: int, windows_ahead: int
    ) -> None:
        self.chunks, self.batch = chunks, int(batch)
        self.cut_ahead, self.windows_ahead = int(cut_ahead), int(windows_ahead)
        self.epoch = 0
        self._stash: int | None = None  # a later epoch's chunk, drawn
        self._begin()

    def _begin(self) -> None:
        self._cut: deque[int] = deque()  # batches cut, not computed
        self._windows: deque[int] = deque()  # chunks drawn beyond the current
        self._current = 0  # samples left in the chunk being cut
        self._fill = 0  # samples of the batch being cut
        self._ended = False  # the pass draws no more

    def _draw(self) -> None:
        limit = self.windows_ahead + (0 if self._current else 1)
        while not self._ended and len(self._windows) < limit:
            c = self._stash if self._stash is not None else self.chunks.draw()
            self._stash = None
            epoch = self.chunks.epoch_of(c)
            if epoch > self.epoch:
                self._stash, self._ended = c, True
            elif epoch == self.epoch:
                self._windows.append(self.chunks.size(c))

    def next_batch(self) -> int:
        """The samples of this worker's next step (0: its share of the epoch
        is read), after drawing and cutting ahead as the loader does."""
        self._draw()
        while len(self._cut) < 1 + self.cut_ahead:
            if self._current == 0:
                self._draw()  # (a reader that was full draws again now)
                if not self._windows:
                    if self._fill:  # the pass's last, partial batch
                        self._cut.append(self._fill)
                        self._fill = 0
                    break
                self._current = self._windows.popleft()
                self._draw()
            take = min(self.batch - self._fill, self._current)
            self._fill += take
            self._current -= take
            if self._fill == self.batch:
                self._cut.append(self._fill)
                self._fill = 0
        return self._cut.popleft() if self._cut else 0

    def next_epoch(self) -> bool:
        """Begin the next epoch (its group's update carried no samples);
        whether the run's epochs are all done."""
        self.epoch += 1
        if self.epoch >= self.chunks.epochs:
            return True
        self._begin()
        return False
