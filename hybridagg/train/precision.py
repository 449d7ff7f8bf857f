"""Mixed precision (``--amp``): autocast for the forward pass, a loss scale for fp16.

The forward pass and the loss run under ``torch.autocast`` in bf16 or fp16;
the parameters, their gradients, the optimizer and the parameter servers
stay float32 (the master weights), as with ``torch.amp``.

fp16's range is small (gradients below 6e-8 vanish), so with fp16 the loss
is multiplied by a *loss scale* before backward, and each gradient is
divided by it again as it enters the reduction
(:meth:`~hybridagg.optimizer.DistributedOptimizer.set_loss_scale`): every
rank contributes, and every server receives, true float32 gradients. A
scale too high overflows: the reduced gradient is then not finite. The
reduced gradient is the same on every rank of the reduction (all workers
in sync mode, the group in hybrid and async), so every rank skips that step
and lowers its scale alike, with no message of its own, and a leader never
pushes the overflow to the servers.

:class:`LossScale` is ``torch.amp.GradScaler``'s rule (its defaults, the
same sequence of scales; a test runs the two side by side) fed that agreed
verdict. ``GradScaler`` itself cannot be: its verdict comes from
``unscale_`` on the local gradients, which must all exist first (no
reduction could overlap backward), differs from rank to rank (a second
agreement), and would leave the reduction carrying scaled gradients.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from ..optimizer import DistributedOptimizer

__all__ = ["AUTOCAST_DTYPES", "LossScale", "Precision"]

AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
"""``--amp``'s names of the types autocast computes in."""

_FLOAT32_MAX = torch.finfo(torch.float32).max


@dataclass
class LossScale:
    """A dynamic loss scale: ``torch.amp.GradScaler``'s rule and defaults.

    Args:
        scale: The current scale.
        growth_factor: Multiplies the scale after ``growth_interval`` steps
            in a row without an overflow.
        backoff_factor: Multiplies the scale at each overflow.
        growth_interval: Steps without an overflow before the scale grows.
        good_steps: Steps without an overflow since the last change.

    Raises:
        ValueError: A value out of range.
    """

    scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    good_steps: int = 0

    def __post_init__(self) -> None:
        if not (0 < self.scale < math.inf):
            raise ValueError(
                f"loss scale must be positive and finite, got {self.scale}"
            )
        if not self.growth_factor > 1:
            raise ValueError(f"growth_factor must be > 1, got {self.growth_factor}")
        if not 0 < self.backoff_factor < 1:
            raise ValueError(
                f"backoff_factor must lie in (0, 1), got {self.backoff_factor}"
            )
        if self.growth_interval < 1:
            raise ValueError(
                f"growth_interval must be >= 1, got {self.growth_interval}"
            )

    def update(self, overflow: bool) -> None:
        """After a step: back off on an overflow, else count it and maybe grow."""
        if overflow:
            self.scale *= self.backoff_factor
            self.good_steps = 0
            return
        self.good_steps += 1
        if self.good_steps == self.growth_interval:
            grown = self.scale * self.growth_factor
            # (as GradScaler, whose scale is a float32: never to infinity)
            if grown <= _FLOAT32_MAX:
                self.scale = grown
            self.good_steps = 0

    def state_dict(self) -> dict:
        """The scale and its step count (a checkpoint's)."""
        return {"scale": self.scale, "good_steps": self.good_steps}

    def load_state_dict(self, state: dict) -> None:
        """Continue from :meth:`state_dict`'s values."""
        self.scale = float(state["scale"])
        self.good_steps = int(state["good_steps"])


class Precision:
    """One worker's numeric precision: autocast, and the loss scale of fp16.

    Args:
        amp: ``"none"``, ``"bf16"`` or ``"fp16"`` (``--amp``).
        device: The device this worker trains on.
        loss_scale: The loss scale (``None``: none). :meth:`for_run` gives
            fp16 one; a test may give one to any precision, so the scaling
            and skipping run on a CPU too.

    Raises:
        ValueError: An unknown ``amp``.
    """

    def __init__(
        self, amp: str, device: torch.device, loss_scale: LossScale | None = None
    ) -> None:
        if amp != "none" and amp not in AUTOCAST_DTYPES:
            raise ValueError(
                f"--amp must be one of none, {', '.join(AUTOCAST_DTYPES)}, got {amp!r}"
            )
        self.amp, self.device = amp, torch.device(device)
        self.dtype = AUTOCAST_DTYPES.get(amp)
        self.loss_scale = loss_scale
        self.skipped = 0
        """Steps skipped because the gradient overflowed the loss scale."""

    @classmethod
    def for_run(cls, amp: str, device: torch.device) -> Precision:
        """``hybridagg train``'s precision for ``--amp`` on ``device``.

        Raises:
            ValueError: fp16 on a device other than CUDA (naming ``--amp``
                and ``--device``).
        """
        device = torch.device(device)
        if amp == "fp16" and device.type != "cuda":
            raise ValueError(
                f"--amp fp16 needs a CUDA device, but this worker trains on "
                f"--device {device.type}: autocast on the CPU computes in bf16 "
                "(--amp bf16)"
            )
        return cls(amp, device, LossScale() if amp == "fp16" else None)

    @contextlib.contextmanager
    def autocast(self) -> Iterator[None]:
        """Run the enclosed forward pass and loss in the lower precision (if any)."""
        if self.dtype is None:
            yield
            return
        with torch.autocast(device_type=self.device.type, dtype=self.dtype):
            yield

    def begin(self, opt: DistributedOptimizer) -> None:
        """Before a step's backward passes: tell ``opt`` the loss scale (if any)."""
        opt.set_loss_scale(None if self.loss_scale is None else self.loss_scale.scale)

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` times the loss scale (the loss itself without one)."""
        return loss if self.loss_scale is None else loss * self.loss_scale.scale

    def end(self, overflowed: bool) -> None:
        """After the step: the loss scale learns whether the gradient overflowed."""
        if self.loss_scale is None:
            return
        self.loss_scale.update(overflowed)
        self.skipped += int(overflowed)

    def state_dict(self) -> dict:
        """What a checkpoint keeps: the loss scale's state (empty without one)."""
        return {} if self.loss_scale is None else self.loss_scale.state_dict()

    def load_state_dict(self, state: dict | None) -> None:
        """Continue a checkpoint's loss scale (nothing without one, or none saved)."""
        if self.loss_scale is not None and state:
            self.loss_scale.load_state_dict(state)
