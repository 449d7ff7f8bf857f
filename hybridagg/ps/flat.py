"""Copies between a model's tensors and one flat vector, in model order.

The parameter-server traffic moves the model as one flat vector (weights,
gradients, floating buffers); these two loops are the only place that
knows how tensors lie in it.

A model on a GPU is staged through these copies: the flat vectors live in
host memory (pinned when the model is on a GPU, :func:`hybridagg.comm.alloc`),
every tensor is copied ``non_blocking`` and the device is synchronised
once at the end, so the copies of a whole model overlap instead of waiting
for each other, and MPI never reads or overwrites a host vector that a copy
still uses.
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
            view.copy_(t.detach().reshape(-1), non_blocking=True)
        offset += n
    _synchronize(tensors)


def unflatten_from(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    """Copy consecutive ranges of ``flat`` into ``tensors`` (in place, no autograd)."""
    offset = 0
    with torch.no_grad():
        for t in tensors:
            n = t.numel()
            t.copy_(flat[offset : offset + n].view_as(t), non_blocking=True)
            offset += n
    _synchronize(tensors)


def _synchronize(tensors: Sequence[torch.Tensor | None]) -> None:
    """Wait for the copies queued on the CUDA devices of ``tensors`` (once each)."""
    devices = {t.device for t in tensors if t is not None and t.device.type == "cuda"}
    for device in devices:
        torch.cuda.current_stream(device).synchronize()
