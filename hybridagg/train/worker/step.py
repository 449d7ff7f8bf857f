"""One worker step: a batch through forward and backward, paced, shared, applied."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ...optimizer import DistributedOptimizer
from ..emulation import Pacer
from ..pacing import LayerPacer
from .epochs import Epochs

if TYPE_CHECKING:  # stopping reads the STOP column from here
    from .stopping import StopSignal

__all__ = [
    "LOSS",
    "MORE",
    "SAMPLES",
    "SECONDS",
    "STOP",
    "StepResult",
    "Stepper",
    "loss_fn",
    "nonfinite_losses",
]

# Columns of the values every step shares (``opt.shared``: one row per worker
# of the reduction): the stop signal, the step's seconds, its samples,
# whether the worker has batches left in the epoch (0: none), and its loss
# (0 without a batch), so a NaN or infinite loss anywhere stops every worker
# of the reduction at the same step, at no extra collective.
STOP, SECONDS, SAMPLES, MORE, LOSS = range(5)

loss_fn = torch.nn.functional.cross_entropy
"""The default training loss (``--loss cross-entropy``; see :mod:`..losses`)."""


@dataclass(frozen=True)
class StepResult:
    """What one step did and how long its parts took."""

    samples: int
    """This worker's batch (0: it has none left in the epoch)."""
    loss: float | None
    """The batch's loss (``None`` without a batch)."""
    compute_s: float
    """Forward and backward."""
    pace_s: float
    """Slept to the emulated speed."""
    comm_s: float
    """The optimizer's step: the reduction or the exchange, and the update."""
    reduce_s: float
    """The reduction's communication alone."""
    data_wait_s: float
    """Waiting for the batch."""
    total_samples: int
    """Samples of the whole reduction (0: every worker in it ran out)."""
    staleness: int
    """Staleness of the update applied (0 in sync)."""
    nonfinite: str | None = None
    """What was not finite, if a loss or the reduced gradient was: no update
    was applied and training stops (the same on every rank of the reduction)."""


def nonfinite_losses(shared: torch.Tensor, ranks: list[int]) -> str | None:
    """Which ranks' losses in the shared values are NaN or infinite, as a phrase.

    Args:
        shared: The shared values of one reduction, a row per rank.
        ranks: The world rank of each row.

    Returns:
        ``"the loss of rank 1 is nan"`` (``None``: every loss is finite).
    """
    losses = shared[:, LOSS].tolist()
    bad = [(r, v) for r, v in zip(ranks, losses, strict=True) if not math.isfinite(v)]
    if not bad:
        return None
    if len(bad) == 1:
        return f"the loss of rank {bad[0][0]} is {bad[0][1]}"
    listed = ", ".join(f"rank {r}: {v}" for r, v in bad)
    return f"the losses of {len(bad)} ranks are not finite ({listed})"


class Stepper:
    """Owns the step itself: batch, forward and backward (paced inside), shared values, step.

    Args:
        model: The model being trained.
        opt: The distributed optimizer.
        loader: The training loader (for its wait statistics and what is left).
        pacer: Sleeps each step to the emulated speed.
        signal: The stop signal, shared with every step.
        ranks: The world rank of each worker of the reduction (the rows of
            the shared values), for messages.
        loss: The training loss, ``loss(output, labels)`` (``--loss``).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        opt: DistributedOptimizer,
        loader,
        pacer: Pacer,
        signal: StopSignal,
        ranks: list[int],
        loss=loss_fn,
    ) -> None:
        self.model, self.opt, self.loader = model, opt, loader
        self.loss = loss
        self.pacer, self.signal, self.ranks = pacer, signal, ranks
        self.layers: LayerPacer | None = None  # made at the first batch

    def _layers(self, sample: torch.Tensor) -> LayerPacer:
        """The pacer that spends the emulated time inside forward and backward."""
        if self.layers is None:
            self.layers = LayerPacer.for_model(
                self.model, self.pacer, sample, progress=self.opt.progress
            )
        return self.layers

    def step(self, epochs: Epochs) -> StepResult:
        """Take the epoch's next batch (or none) through one update."""
        opt, loader = self.opt, self.loader
        wait0 = loader.stats.wait_seconds
        batch = epochs.next_batch()
        waited = loader.stats.wait_seconds - wait0
        n = 0 if batch is None else len(batch[1])
        opt.set_samples(n)
        opt.zero_grad()
        loss_value = None
        compute = slept = 0.0
        if n:
            x, y = batch
            layers = self._layers(x[:1])
            layers.begin(n)
            loss = self.loss(self.model(x), y)
            loss.backward()
            loss_value = float(loss.detach())
            compute, slept = layers.end()
        # static shares know when this worker's epoch ends; None: unknown (dynamic)
        more = 0.0 if loader.batches_left == 0 else 1.0
        loss_out = 0.0 if loss_value is None else loss_value
        opt.share([self.signal.local(), compute + slept, float(n), more, loss_out])
        t1 = time.perf_counter()
        opt.synchronize()  # (checks the reduced gradient)
        bad_loss = nonfinite_losses(opt.shared, self.ranks)
        if bad_loss is not None:
            opt.halt(bad_loss)
        opt.step()  # (applies nothing once halted)
        comm_s = time.perf_counter() - t1
        return StepResult(
            samples=n,
            loss=loss_value,
            compute_s=compute,
            pace_s=slept,
            comm_s=comm_s,
            reduce_s=opt.reducer.last_comm_seconds,
            data_wait_s=waited,
            total_samples=opt.last_total_samples,
            staleness=opt.last_staleness,
            nonfinite=opt.nonfinite,
        )
