"""The epoch bookkeeping of a worker: its batches of the epoch and the epochs done."""

from __future__ import annotations

from collections.abc import Iterator

import torch

__all__ = ["Epochs"]


class Epochs:
    """Owns the epoch in progress (the loader's iterator) and the count of finished ones.

    An epoch is over when every worker of a reduction has finished it, which
    a worker learns from an update: with static shares every worker's last
    batch of the epoch is in the same update (:meth:`ended_with`), with
    dynamic shares an update that carried no samples at all ends it.

    Args:
        loader: The training loader.
        max_epochs: Epochs to run (``None``: until the update budget).
        done: Epochs finished before (a resumed run's).
    """

    def __init__(self, loader, max_epochs: int | None, done: int) -> None:
        self.loader, self.max_epochs, self.done = loader, max_epochs, done
        self._batches: Iterator[tuple[torch.Tensor, torch.Tensor]] | None = None
        self._exhausted = False

    def begin(self) -> None:
        """Start iterating the next epoch (nothing is read until the first batch)."""
        self._batches, self._exhausted = iter(self.loader), False

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """This worker's next batch, ``None`` once its share of the epoch is read."""
        if self._exhausted:
            return None
        try:
            return next(self._batches)
        except StopIteration:
            self._exhausted = True
            return None

    def end(self) -> bool:
        """Count an epoch every worker finished and begin the next; whether training ends."""
        self.done += 1
        self.begin()
        return self.max_epochs is not None and self.done >= self.max_epochs

    def ended_with(self, more: torch.Tensor) -> bool:
        """After an update with samples: end the epoch if no worker has batches left.

        Static shares: every worker took its last batch of the epoch in this
        update, so the epoch ends here, without a round of an empty update to
        find out (a whole gradient all-reduce); a checkpoint taken next then
        holds the epoch counted and the loader between epochs.

        Args:
            more: Each worker's shared "batches left" value (0: none).

        Returns:
            Whether training ends with this update.
        """
        if more.max() != 0:
            return False
        if next(self._batches, None) is not None:
            raise RuntimeError("the loader gave a batch after its last one")
        return self.end()

    def close(self) -> None:
        """Drop the iterator: an epoch left unfinished ends now, before the loader closes."""
        self._batches = None
