"""Hybrid and asynchronous modes: groups reduce inside, leaders meet the servers.

Each group all-reduces its gradients (weighted by sample counts), its
leader pushes the group's gradient to the sharded parameter servers and
pulls fresh weights, which it broadcasts in the group
(:class:`hybridagg.ps.exchange.GroupExchange`).
"""

from __future__ import annotations

import torch

from ..comm import Comm
from ..ps.exchange import ExchangeOptions, GroupExchange, group_name, streams
from ..ps.protocol import FLAG_STOP
from ..ps.streaming import bucket_ranges
from ..topology import Topology
from .base import DistributedOptimizer

__all__ = ["ServerOptimizer"]


class ServerOptimizer(DistributedOptimizer, modes=("hybrid", "async")):
    """``DistributedOptimizer(..., mode="hybrid" | "async")`` (see the base class)."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        named_parameters=None,
        topology: Topology | None = None,
        *,
        staleness_bound: int | None = None,
        max_updates: int | None = None,
        overlap: bool = False,
        stream_push: bool = False,
        server_batching: dict | None = None,
        **kwargs,
    ) -> None:
        _check_positive("staleness_bound", staleness_bound, low=0)
        _check_positive("max_updates", max_updates, low=1)
        if not isinstance(stream_push, bool):
            raise TypeError(f"stream_push must be a bool, got {stream_push!r}")
        self._stream_wanted = stream_push and not overlap
        super().__init__(optimizer, named_parameters, topology, **kwargs)
        self._exchange = GroupExchange(
            self.topology,
            list(self._reducer.params),
            self._buffers,
            optimizer,
            ExchangeOptions(
                compensation=self.compensation,
                staleness_bound=staleness_bound,
                max_updates=max_updates,
                overlap=overlap,
                stream=self._reducer.early_total,
                batching=server_batching,
                wire=self.wire,
            ),
        )
        if self._reducer.early_total and self.topology.is_leader:
            reducer = self._reducer
            self._exchange.buckets = bucket_ranges(
                [p.numel() for p in reducer.params],
                [b.params for b in reducer.buckets],
            )
            reducer.on_final = self._bucket_final
        elif self.topology.is_leader:
            self._exchange.client.prepare_flat_grad()

    _per_group = True

    def _early_total(self, named: list) -> bool:
        # (the same on every rank of the group: its settings, and whether
        # every rank of the group is on the CPU, as the backend plan agreed)
        return streams(self._stream_wanted, overlap=False, on_cpu=self._on_cpu)

    def _bucket_final(self, bucket) -> None:
        """The reducer finished a bucket before ``synchronize()``: push its parts."""
        if self._halted is None:
            lrs = [group["lr"] for group in self.param_groups]
            self._exchange.bucket_final(
                bucket.index, bucket.flat, self._reducer.known_total, lrs
            )

    def _check_loss_scaling(self) -> None:
        if self._reducer.early_total:
            # (the same on every rank of the group: its settings and devices)
            raise ValueError(
                "a loss scale needs stream_push=False: a streamed push sends "
                "each bucket to the servers as the group's reduction completes "
                "it, before the step knows whether any gradient overflowed"
            )

    def _scope(self, topo: Topology) -> Comm:
        return topo.comms.group

    def _where(self) -> str:
        return f"of {group_name(self.topology, self.topology.group)} "

    def halt(self, reason: str) -> None:
        super().halt(reason)
        self._exchange.halt()

    @property
    def nonfinite(self) -> str | None:
        if self._halted is not None:
            sent = self._exchange.cut_after
            if sent:
                return (
                    f"{self._halted}; its push was cut short after {sent} parts "
                    "(the servers applied those, and nothing after them)"
                )
            return f"{self._halted}; nothing was pushed"
        return self._exchange.halted_by_servers

    def _apply(self, total: float) -> None:
        if self._exchange.buckets is not None:  # streamed: from the buckets
            grads = [b.flat for b in self._reducer.buckets]
        else:
            grads = [p.grad for p in self._reducer.params]
        lrs = [group["lr"] for group in self.param_groups]
        self._exchange.step(grads, total, lrs)
        self.updates = self._exchange.updates

    def finish(self, timeout: float | None = None, final: bool = True) -> int | None:
        """End this rank's run; see :meth:`GroupExchange.finish` for ``final``."""
        super().finish(timeout)
        version = self._exchange.finish(timeout, final)
        self._holds_final = version is not None
        return version

    def receive_final(self, timeout: float | None = None) -> int:
        """On the leader the survivors chose: load the servers' final weights."""
        version = self._exchange.receive_final(timeout)
        self._holds_final = True
        return version

    def _check_holds_final(self) -> None:
        if not getattr(self, "_holds_final", False):
            raise ValueError(
                f"final_state_dict(): rank {self.topology.rank} does not hold the "
                "final weights; in hybrid and async mode the servers send them "
                "to rank 0 at finish() (with --on-group-failure continue: to the "
                "rank that writes the summary)"
            )

    def group_lost(self, dead_rank: int) -> None:
        """This rank's group lost a member: the leader tells the servers to drop it."""
        self._exchange.lost(dead_rank)

    def request_stop(self) -> None:
        self._exchange.stop_flags |= FLAG_STOP

    def report(self, seconds_per_sample: float) -> None:
        self._exchange.seconds_per_sample = float(seconds_per_sample)

    @property
    def server_version(self) -> int:
        return self._exchange.version

    @property
    def batch_advice(self) -> float:
        return self._exchange.advice

    @property
    def checkpoint_due(self) -> int:
        return self._exchange.checkpoint_due

    @property
    def should_stop(self) -> bool:
        return self._exchange.should_stop or self.nonfinite is not None

    @property
    def last_staleness(self) -> int:
        return self._exchange.last_staleness

    def checkpointed(self, number: int) -> None:
        self._exchange.checkpointed(number)

    def refresh_from_servers(self) -> None:
        self._exchange.refresh()
        self.updates = self._exchange.updates

    def pull_weights(self) -> torch.Tensor:
        return self._exchange.pull()

    def pull_state(
        self, out: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self._exchange.pull_state(out)


def _check_positive(name: str, value, *, low: int) -> None:
    if value is not None and (
        isinstance(value, bool) or not isinstance(value, int) or value < low
    ):
        kind = "a positive integer" if low == 1 else f"an integer >= {low}"
        raise ValueError(f"{name} must be {kind}, got {value!r}")
