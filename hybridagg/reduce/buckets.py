"""Gradient buckets: which parameters share one flat buffer, and its state in a step."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

__all__ = ["DEFAULT_BUCKET_BYTES", "Bucket", "assign_buckets"]

DEFAULT_BUCKET_BYTES = 25 * 1024 * 1024


@dataclass
class Bucket:
    """One flat buffer of gradients and how far its reduction has come."""

    index: int
    params: list[int]
    """Indices into the reducer's parameter list."""
    offsets: list[int]
    """Where each parameter's gradient starts in :attr:`flat`."""
    flat: torch.Tensor
    ready: list[bool] = field(default_factory=list)
    """Per parameter: its gradient is in the bucket."""
    stage_done: int = 0
    """Stages of the reduction completed this step."""
    test: Callable[[], bool] | None = None
    """The stage in flight, if any."""
    posted_at: float | None = None
    completed_at: float | None = None
    final: bool = False
    """Reduced and divided by the step's total (the gradient as applied)."""

    @property
    def nbytes(self) -> int:
        return self.flat.numel() * self.flat.element_size()

    def reset(self) -> None:
        """Forget this step's progress."""
        self.ready = [False] * len(self.params)
        self.stage_done = 0
        self.test = None
        self.final = False


def assign_buckets(params: list[torch.Tensor], bucket_bytes: int) -> list[list[int]]:
    """Indices of ``params`` per bucket, reverse order, split by dtype and device.

    Reverse registration order, because backward produces the last layers'
    gradients first; the same on every rank, so every rank posts the same
    sequence of collectives.
    """
    buckets: list[list[int]] = []
    current: list[int] = []
    size = 0
    key = None
    for i in reversed(range(len(params))):
        p = params[i]
        nbytes = p.numel() * p.element_size()
        pkey = (p.dtype, p.device)
        if current and (pkey != key or size + nbytes > bucket_bytes):
            buckets.append(current)
            current, size = [], 0
        current.append(i)
        size += nbytes
        key = pkey
    if current:
        buckets.append(current)
    return buckets
