"""A worker's checkpoints: when one is due, what goes into its part, the sync commit."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable

import torch

from ...comm import solo
from ...optimizer import DistributedOptimizer
from ...topology import Topology
from ..checkpoint import Checkpointer
from ..common import manifest
from ..config import TrainConfig
from ..metrics import MetricsWriter
from .clock import TrainClock

__all__ = ["WorkerCheckpoints"]


class WorkerCheckpoints:
    """Owns this worker's checkpoints (a no-op without ``--checkpoint``).

    Sync: every worker writes its part every ``--checkpoint-every`` updates
    and when a stop signal was seen (rank 0's part also holds the model and
    the optimizer), and rank 0 commits; a last one at the end holds the
    updates since. Hybrid and async: the servers decide
    (``opt.checkpoint_due``); each worker writes its part, its group waits
    for every part, and the leader tells the servers, which commit.

    Args:
        cfg: The run's options (the manifest records them).
        topo: The topology.
        checkpointer: Writes this rank's parts (``None``: no checkpoints).
        opt: The distributed optimizer.
        model: The model (rank 0's sync part).
        optimizer: The local optimizer (rank 0's sync part).
        metrics: Where ``checkpoint`` records go.
        clock: The training clock.
        part_state: This worker's state for its part of checkpoint ``c``
            (loader, RNG, counters): ``part_state(c)``.
        number: The number of the last checkpoint (the one resumed from, or 0).
    """

    def __init__(
        self,
        cfg: TrainConfig,
        topo: Topology,
        checkpointer: Checkpointer | None,
        *,
        opt: DistributedOptimizer,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        metrics: MetricsWriter,
        clock: TrainClock,
        part_state: Callable[[int], dict],
        number: int,
    ) -> None:
        self.cfg, self.topo, self.ck = cfg, topo, checkpointer
        self.opt, self.model, self.optimizer = opt, model, optimizer
        self.metrics, self.clock, self.part_state = metrics, clock, part_state
        self.number = number
        self.last_update = opt.updates  # the update the last checkpoint holds

    def maybe_write(self, signalled: bool) -> None:
        """After an update: write a checkpoint if one is due (or a stop signal was seen)."""
        cfg, opt = self.cfg, self.opt
        if self.ck is None:
            return
        if cfg.mode != "sync":
            number = opt.checkpoint_due
            if not number:
                return
            t0 = time.perf_counter()
            with self._solo(f"writing its part of checkpoint {number}"):
                self.ck.write(number, self.part_state(number))
            self.topo.comms.group.barrier(what=f"group's parts of checkpoint {number}")
            opt.checkpointed(number)
            self._log(number, t0, opt.server_version)
            return
        due = cfg.checkpoint_every and opt.updates % cfg.checkpoint_every == 0
        if not (due or signalled) or opt.updates == self.last_update:
            return
        self._write_sync()

    def write_last(self) -> None:
        """At the end of training (sync): a checkpoint of the updates since the last."""
        if (
            self.cfg.mode == "sync"
            and self.ck is not None
            and self.opt.updates != self.last_update
        ):
            self._write_sync()

    def _write_sync(self) -> None:
        opt = self.opt
        self.number += 1
        number = self.number
        t0 = time.perf_counter()
        state = self.part_state(number)
        state["updates"] = opt.updates
        if self.topo.rank == 0:
            state["model"] = self.model.state_dict()
            state["optimizer"] = self.optimizer.state_dict()
        with self._solo(f"writing its part of checkpoint {number}"):
            self.ck.write(number, state)
        self.topo.comms.workers.barrier(what=f"parts of checkpoint {number}")
        if self.topo.rank == 0:
            with solo(f"committing checkpoint {number}"):
                self.ck.commit(
                    number, manifest(self.cfg, self.topo, updates=opt.updates)
                )
        self.last_update = opt.updates
        self._log(number, t0, opt.updates)

    def _solo(self, name: str) -> contextlib.AbstractContextManager:
        """Rank 0's part (the model and optimizer in sync mode) is the large
        one the others wait for; the other workers' parts are small, and
        announcing every rank's write to every rank would cost N^2 messages."""
        return solo(name) if self.topo.rank == 0 else contextlib.nullcontext()

    def _log(self, number: int, t0: float, version: int) -> None:
        self.metrics.write(
            "checkpoint",
            t=t0 - self.clock.start,
            number=number,
            seconds=time.perf_counter() - t0,
            version=version,
        )
