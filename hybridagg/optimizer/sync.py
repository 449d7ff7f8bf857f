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

from ..comm import Comm
from ..topology import Topology
from .base import DistributedOptimizer

__all__ = ["SyncOptimizer"]


class SyncOptimizer(DistributedOptimizer, modes=("sync",)):
    """``DistributedOptimizer(..., mode="sync")`` (see the base class for the arguments)."""

    def _scope(self, topo: Topology) -> Comm:
        return topo.comms.workers

    def _hierarchical(self, topo: Topology) -> bool:
        return topo.num_groups > 1

    def _apply(self, total: float) -> None:
        if total <= 0:
            return
        scale = self.compensation.scale(total, self.updates, 0)
        if scale == 1.0:
            self.optimizer.step()
        else:
            saved = [group["lr"] for group in self.param_groups]
            for group in self.param_groups:
                group["lr"] = group["lr"] * scale
            try:
                self.optimizer.step()
            finally:
                for group, lr in zip(self.param_groups, saved, strict=True):
                    group["lr"] = lr
        self.updates += 1
