"""Copies between a model's tensors and one flat vector, in model order.

The parameter-server traffic moves the model as one flat vector (weights,
gradients, floating buffers); these two loops are the only place that
knows how tensors lie in it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["flatten_into", "unflatten_from"]


def flatten_into(
    flat: torch.Tensor,
    tensors: Sequence[torch.Tensor | None],
    like: Sequence[torch.Tensor] | None = None,
) -> None:
    """Copy ``tensors`` into consecutive ranges of ``flat``.

    Args:
        flat: The destination, at least as long as the tensors together.
        tensors: The tensors, in order; with ``like``, ``None`` stands for
            zeros (a parameter without a gradient).
        like: Tensors of the sizes of ``tensors`` (needed when one is ``None``).
    """
    offset = 0
    sizes = tensors if like is None else like
    for t, shape in zip(tensors, sizes, strict=True):
        n = shape.numel()
        view = flat[offset : offset + n]
        if t is None:
            view.zero_()
        else:
            view.copy_(t.detach().reshape(-1))
        offset += n


def unflatten_from(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    """Copy consecutive ranges of ``flat`` into ``tensors`` (in place, no autograd)."""
    offset = 0
    with torch.no_grad():
        for t in tensors:
            n = t.numel()
            t.copy_(flat[offset : offset + n].view_as(t))
            offset += n
