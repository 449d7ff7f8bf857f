"""Synchronous data parallelism: every worker's gradients averaged before each update.

Flat with one group; hierarchical (group, leaders, group) with several.
Gradient clipping: call ``opt.synchronize()``, clip, then ``opt.step()``
(which then does not reduce again), as with Horovod. LR schedulers work on
the wrapper as on any optimizer: it shares the inner optimizer's
``param_groups``. With ``model=`` given, floating-point buffers (BatchNorm
running statistics) are averaged over the workers after each reduction,
with equal weights.
"""

from __future__ import annotations

import torch

from ..comm import Comm
from ..topology import Topology
from .base import DistributedOptimizer

__all__ = ["SyncOptimizer", "step_scaled"]


class SyncOptimizer(DistributedOptimizer, modes=("sync",)):
    """``DistributedOptimizer(..., mode="sync")`` (see the base class for the arguments)."""

    def _scope(self, topo: Topology) -> Comm:
        return topo.comms.workers

    def _hierarchical(self, topo: Topology) -> bool:
        return topo.num_groups > 1

    def _apply(self, total: float) -> None:
        if total <= 0:
            return
        step_scaled(self.optimizer, self.compensation.scale(total, self.updates, 0))
        self.updates += 1


def step_scaled(optimizer: torch.optim.Optimizer, scale: float) -> None:
    """``optimizer.step()`` with every group's ``lr`` times ``scale`` for this step.

    The large-mini-batch rule of sync mode (:class:`~hybridagg.ps.Compensation`:
    the global batch over ``--batch-size``, warm-up), shared by the
    pipelined job's sync update.
    """
    if scale == 1.0:
        optimizer.step()
        return
    saved = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = group["lr"] * scale
    try:
        optimizer.step()
    finally:
        for group, lr in zip(optimizer.param_groups, saved, strict=True):
            group["lr"] = lr
