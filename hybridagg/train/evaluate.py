"""Validation on rank 0: accuracy and loss of a model on the validation split."""

from __future__ import annotations

import copy

import h5py
import torch

from ..data import HDF5Loader
from .config import DataOptions
from .losses import loss_function

__all__ = ["Evaluator", "load_flat"]


def load_flat(
    model: torch.nn.Module, weights: torch.Tensor, buffers: torch.Tensor | None
) -> None:
    """Copy a flat parameter vector (and flat floating buffers) into ``model``.

    The order is the optimizer's: parameters that require a gradient in
    ``named_parameters()`` order, then floating buffers in ``buffers()`` order.
    """
    with torch.no_grad():
        offset = 0
        for p in (p for p in model.parameters() if p.requires_grad):
            n = p.numel()
            p.copy_(weights[offset : offset + n].view_as(p))
            offset += n
        if buffers is not None:
            offset = 0
            for b in (b for b in model.buffers() if b.is_floating_point()):
                n = b.numel()
                b.copy_(buffers[offset : offset + n].view_as(b))
                offset += n


class Evaluator:
    """Evaluates models on the ``val`` split (the ``train`` split if there is none).

    Args:
        cfg: The data options (``cfg.data``: the HDF5 file).
        model: The model to evaluate (unused; kept for the callers' signature).
        device: Where batches go.
        loss: ``--loss``: with ``"mse"`` there is no accuracy (``None``) and
            the loss is the mean squared error per sample.
    """

    def __init__(
        self,
        cfg: DataOptions,
        model: torch.nn.Module,
        device: torch.device,
        loss: str = "cross-entropy",
    ) -> None:
        self.classify = loss != "mse"
        self.loss_fn = loss_function(loss)
        with h5py.File(cfg.data, "r") as f:
            has_val = "val" in f and len(f["val"]["labels"]) > 0
            split = "val" if has_val else "train"
            size = len(f[split]["labels"])
        self.split = split
        self.loader = HDF5Loader(
            cfg.data,
            batch_size=max(1, min(512, size)),
            split=split,
            shuffle=False,
            normalize=True,
            prefetch=0,
            device=device,
        )
        self._scratch: torch.nn.Module | None = None

    def scratch(self, model: torch.nn.Module) -> torch.nn.Module:
        """A copy of ``model`` kept for loading other weights into."""
        if self._scratch is None:
            self._scratch = copy.deepcopy(model)
        return self._scratch

    @torch.no_grad()
    def evaluate(self, model: torch.nn.Module) -> tuple[float | None, float]:
        """``(accuracy, mean loss)`` over the whole split (accuracy ``None`` for mse).

        The mean loss is the training loss averaged over samples (for mse,
        over samples and target values: ``torch.nn.functional.mse_loss``).
        """
        was_training = model.training
        model.eval()
        correct, loss, total = 0, 0.0, 0
        try:
            for x, y in self.loader:
                out = model(x)
                # the batch mean times its size: the split's mean at the end
                loss += float(self.loss_fn(out, y)) * len(y)
                if self.classify:
                    correct += int((out.argmax(1) == y).sum())
                total += len(y)
        finally:
            model.train(was_training)
        accuracy = correct / max(1, total) if self.classify else None
        return accuracy, loss / max(1, total)

    def close(self) -> None:
        self.loader.close()
