"""How a worker computes its step: mixed precision and gradient accumulation (pure logic)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from .aggregation import HOW
from .fields import Concern, option

__all__ = ["AMP_MODES", "ComputeOptions"]

AMP_MODES = ("none", "bf16", "fp16")
"""``--amp``: no autocast, or the lower-precision type ``torch.autocast`` computes in."""


@dataclass(frozen=True, kw_only=True)
class ComputeOptions(Concern):
    """How each worker computes its step: the precision and the passes per update."""

    help_group: ClassVar[str] = HOW

    amp: str = option("none", choices=AMP_MODES)
    """mixed precision: forward and loss under torch.autocast in bf16 (CPU or
    CUDA) or fp16 (CUDA only, with a dynamic loss scale; a step whose
    gradient overflows is skipped on every rank of its reduction); weights,
    optimizer and servers stay fp32

    bf16 has float32's exponent range and needs no loss scale; fp16 does
    (as ``torch.amp.GradScaler``: 2**16 at first, halved at each overflow,
    doubled after 2000 steps without one). Validation runs in float32.
    """

    accumulate: int = option(1, at_least=1)
    """gradient accumulation: this many backward passes per update, each over
    an equal part of the worker's batch, exchanged once; the update equals
    one pass over the whole batch (--batch-size, --lr and adaptive batches
    keep their meaning), only activation memory shrinks

    The batch a worker is given (``--batch-size``, or the adaptive
    controller's) stays the update's batch, split into the passes: the lr
    rule (samples / --batch-size), the controller's step times, samples/s,
    data positions and checkpoints all count updates, so none of them
    changes with ``--accumulate``. Horovod's habit of a batch per pass
    (``batches_per_allreduce`` N) is ``--batch-size`` times N here. Models
    with BatchNorm see each pass's statistics, as with any accumulation.
    """
