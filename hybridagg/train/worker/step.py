"""One worker step: a batch through forward and backward, paced, shared, applied."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ...optimizer import DistributedOptimizer
from ..emulation import Pacer
from .epochs import Epochs

if TYPE_CHECKING:  # stopping reads the STOP column from here
    from .stopping import StopSignal

__all__ = ["MORE", "SAMPLES", "SECONDS", "STOP", "StepResult", "Stepper", "loss_fn"]

# Columns of the values every step shares (``opt.shared``: one row per worker
# of the reduction): the stop signal, the step's seconds, its samples, and
# whether the worker has batches left in the epoch (0: none).
STOP, SECONDS, SAMPLES, MORE = range(4)

loss_fn = torch.nn.functional.cross_entropy
"""The training loss (also the batch probe's)."""


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


class Stepper:
    """Owns the step itself: batch, forward and backward, pacing, shared values, step.

    Args:
        model: The model being trained.
        opt: The distributed optimizer.
        loader: The training loader (for its wait statistics and what is left).
        pacer: Sleeps each step to the emulated speed.
        signal: The stop signal, shared with every step.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        opt: DistributedOptimizer,
        loader,
        pacer: Pacer,
        signal: StopSignal,
    ) -> None:
        self.model, self.opt, self.loader = model, opt, loader
        self.pacer, self.signal = pacer, signal

    def step(self, epochs: Epochs) -> StepResult:
        """Take the epoch's next batch (or none) through one update."""
        opt, loader = self.opt, self.loader
        wait0 = loader.stats.wait_seconds
        batch = epochs.next_batch()
        waited = loader.stats.wait_seconds - wait0
        n = 0 if batch is None else len(batch[1])
        opt.set_samples(n)
        opt.zero_grad()
        t0 = time.perf_counter()
        loss_value = None
        if n:
            x, y = batch
            loss = loss_fn(self.model(x), y)
            loss.backward()
            loss_value = float(loss.detach())
        compute = time.perf_counter() - t0
        slept = self.pacer.pace(n, compute)
        # static shares know when this worker's epoch ends; None: unknown (dynamic)
        more = 0.0 if loader.batches_left == 0 else 1.0
        opt.share([self.signal.local(), compute + slept, float(n), more])
        t1 = time.perf_counter()
        opt.step()
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
        )
