"""The training loss (``--loss``) and what it asks of the data and the model.

``cross-entropy`` trains a classifier on integer class labels: the model
outputs at least ``num_classes`` logits, validation reports accuracy and the
mean loss. ``mse`` trains a regression on float targets (``(N,)`` or
``(N, k)`` in the data file, ``hybridagg convert --targets float``): the
model outputs exactly ``k`` values per sample (1 for scalar targets),
validation reports the mean squared error, and there is no accuracy.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.nn import functional

from .config import LOSSES

__all__ = ["LOSSES", "check_task", "loss_function", "mse"]

Loss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def mse(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean squared error; scalar targets ``(B,)`` meet outputs ``(B, 1)``."""
    return functional.mse_loss(output, target.reshape(output.shape).to(output.dtype))


def loss_function(name: str) -> Loss:
    """The loss ``--loss name`` stands for: ``loss(output, labels) -> scalar``.

    Raises:
        ValueError: Not one of :data:`LOSSES`.
    """
    if name == "cross-entropy":
        return functional.cross_entropy
    if name == "mse":
        return mse
    raise ValueError(f"--loss must be one of {', '.join(LOSSES)}, got {name!r}")


def check_task(loss: str, regression: bool, data: str) -> None:
    """Check that the loss fits the data's labels (classes or float targets).

    Raises:
        ValueError: Classes with ``mse``, or float targets with ``cross-entropy``.
    """
    if loss == "mse" and not regression:
        raise ValueError(
            f"--loss mse needs float targets, but the labels of {data} are "
            "integer classes (use --loss cross-entropy, or convert regression "
            "targets with hybridagg convert --targets float)"
        )
    if loss != "mse" and regression:
        raise ValueError(
            f"the labels of {data} are float targets (a regression): train "
            "with --loss mse"
        )
