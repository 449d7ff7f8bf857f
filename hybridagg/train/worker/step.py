"""One worker step: a batch through forward and backward, paced, shared, applied.

With ``--accumulate N`` the batch goes through N backward passes of about
batch/N samples (:func:`pass_sizes`). Each pass's loss is weighted by its
share of the batch, so the passes' gradients sum to the whole batch's mean
gradient; the passes before the last run under ``opt.no_sync()`` (the
gradients accumulate in the reduction's buckets, nothing is sent) and the
last one reduces as a single pass would, overlapped with its backward. The
update is the one a single pass over the batch gives, up to rounding.

With ``--amp`` each pass's forward and loss run under autocast
(:class:`~hybridagg.train.precision.Precision`); with a loss scale (fp16)
a step whose reduced gradient overflowed applies nothing on any rank of
the reduction (:attr:`StepResult.skipped`) and the scale is lowered.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ...optimizer import DistributedOptimizer
from ..emulation import Pacer
from ..pacing import LayerPacer
from ..precision import Precision
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
    "pass_sizes",
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
    skipped: bool = False
    """The reduced gradient overflowed the loss scale (fp16): no update was
    applied, on every rank of the reduction, and training goes on."""


def pass_sizes(samples: int, passes: int) -> list[int]:
    """How ``samples`` samples split into at most ``passes`` backward passes.

    As ``torch.tensor_split``: sizes differ by at most one, larger first;
    never an empty pass (a batch smaller than ``passes`` takes one pass per
    sample).

    Args:
        samples: The batch (0: no pass).
        passes: ``--accumulate``.
    """
    k = min(samples, passes)
    if k == 0:
        return []
    base, extra = divmod(samples, k)
    return [base + 1] * extra + [base] * (k - extra)


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
        precision: Autocast and the loss scale (``--amp``; default float32).
        accumulate: Backward passes per update (``--accumulate``).
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
        precision: Precision | None = None,
        accumulate: int = 1,
    ) -> None:
        if isinstance(accumulate, bool) or not isinstance(accumulate, int):
            raise TypeError(f"accumulate must be an int, got {accumulate!r}")
        if accumulate < 1:
            raise ValueError(f"--accumulate must be >= 1, got {accumulate}")
        self.model, self.opt, self.loader = model, opt, loader
        self.loss = loss
        self.pacer, self.signal, self.ranks = pacer, signal, ranks
        self.precision = precision or Precision("none", torch.device("cpu"))
        self.accumulate = accumulate
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
        self.precision.begin(opt)
        loss_value = None
        compute = slept = 0.0
        if n:
            loss_value, compute, slept = self._passes(*batch)
        # static shares know when this worker's epoch ends; None: unknown (dynamic)
        more = 0.0 if loader.batches_left == 0 else 1.0
        loss_out = 0.0 if loss_value is None else loss_value
        opt.share([self.signal.local(), compute + slept, float(n), more, loss_out])
        t1 = time.perf_counter()
        opt.synchronize()  # (checks the reduced gradient)
        bad_loss = nonfinite_losses(opt.shared, self.ranks)
        if bad_loss is not None:
            opt.halt(bad_loss)
        opt.step()  # (applies nothing once halted, or after an overflow)
        comm_s = time.perf_counter() - t1
        self.precision.end(opt.overflowed)
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
            skipped=opt.overflowed,
        )

    def _passes(self, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float, float]:
        """Forward and backward of the batch ``(x, y)`` in ``--accumulate`` passes.

        Each pass is paced on its own samples (the emulated compute of a
        pass of ``m`` samples), so the step's emulated time is the batch's.

        Returns:
            ``(loss, compute_s, slept_s)``: the batch's mean loss, and the
            passes' real compute and sleeps.
        """
        n = len(y)
        sizes = pass_sizes(n, self.accumulate)
        layers = self._layers(x[:1])
        total = None
        compute = slept = 0.0
        for k, (xk, yk) in enumerate(zip(x.split(sizes), y.split(sizes), strict=True)):
            last = k == len(sizes) - 1
            # the passes before the last accumulate locally; the last reduces
            held = contextlib.nullcontext() if last else self.opt.no_sync()
            with held:
                layers.begin(len(yk))
                with self.precision.autocast():
                    loss = self.loss(self.model(xk), yk)
                # weighted by the pass's share: the passes' gradients sum to
                # the batch's mean gradient (mean losses; one pass: weight 1)
                if len(sizes) > 1:
                    loss = loss * (len(yk) / n)
                self.precision.scale(loss).backward()
                c, s = layers.end()
            compute, slept = compute + c, slept + s
            # (at least float32: a float64 model's loss keeps its precision)
            part = loss.detach()
            part = part.to(torch.promote_types(part.dtype, torch.float32))
            total = part if total is None else total + part
        return float(total), compute, slept
