"""The stop signal during training: SIGTERM or SIGUSR1 (a batch system's warning)."""

from __future__ import annotations

import threading

from ...optimizer import DistributedOptimizer
from .step import STOP

__all__ = ["StopSignal"]


class StopSignal:
    """Owns what a stop request does: it travels with the step and stops after a checkpoint.

    A signal sets this rank's flag; every step shares the flag with the
    reduction. In sync mode every worker sees it at the same update, takes the
    checkpoint that update triggers and stops there. In hybrid and async mode
    the group's leader asks the servers to stop, and they stop every group
    after a checkpoint.

    Args:
        flag: The process's stop flag (:func:`hybridagg.runtime.signals.stop_flag`).
        opt: The distributed optimizer.
        sync: Whether the mode is sync.
        is_leader: Whether this worker leads its group.
    """

    def __init__(
        self,
        flag: threading.Event,
        opt: DistributedOptimizer,
        *,
        sync: bool,
        is_leader: bool,
    ) -> None:
        self.flag, self.opt, self.sync, self.is_leader = flag, opt, sync, is_leader

    def local(self) -> float:
        """This rank's flag, as the value it shares (1.0: a signal arrived)."""
        return float(self.flag.is_set())

    def seen(self) -> bool:
        """Whether any worker of the last update's reduction had a signal."""
        return bool(self.opt.shared[:, STOP].max() > 0)

    def stop_here(self) -> bool:
        """Act on a signal seen, after the update's checkpoint; whether to stop now."""
        if self.sync:
            return True  # every worker saw it at this update (and checkpointed)
        if self.is_leader:
            self.opt.request_stop()  # the servers stop every group after a checkpoint
        return False
