"""Whether buffers hold only finite numbers, at the price of a sum.

The reduced gradient (every step, on every rank) and a pushed gradient (on
every server) are checked before they change the model. An exact check,
``torch.isfinite(x).all()``, builds a boolean tensor as large as ``x`` and
costs far more than the sum, which reads ``x`` once (bench/RESULTS.md,
"The non-finite check"). The sum is non-finite whenever an element is (a
NaN or an infinity propagates through every addition; ``inf + -inf`` is a
NaN). The converse fails only when huge finite elements overflow the sum,
so a non-finite sum is confirmed by the exact check: the answer is exact,
and the expensive path runs only when something is already wrong or about
to be.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

__all__ = ["all_finite"]


def all_finite(tensors: Iterable[torch.Tensor]) -> bool:
    """Whether every element of every tensor is finite (no NaN, no infinity).

    Args:
        tensors: Floating-point tensors (CPU or GPU; a GPU tensor costs one
            synchronisation for the sum's value).

    Returns:
        True when every element is finite; exact, also when finite elements
        overflow their sum.
    """
    for t in tensors:
        if t.numel() == 0:
            continue
        if math.isfinite(float(t.sum())):
            continue
        if not bool(torch.isfinite(t).all()):  # the sum may only have overflowed
            return False
    return True
