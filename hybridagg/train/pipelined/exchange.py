"""How a pipelined job's stages combine their gradients across groups.

The factory (:func:`make_stage_update`) picks by mode, as
:class:`~hybridagg.optimizer.DistributedOptimizer` does for whole replicas:

* sync: :class:`SyncStageUpdate` sums each layer's gradient over the groups
  that hold it, weighted by each group's share of the global batch
  (:class:`~hybridagg.pipeline.CrossGroupReducer`), and every stage applies
  the user's optimizer to its own layers: the update of one replica on the
  global batch.
* hybrid, async: :class:`ServerStageUpdate` pushes each stage's own parts to
  the servers and receives its own layers' new weights
  (:class:`~hybridagg.ps.stage_client.StageClient`): no rank holds the whole
  model, and the servers count one update per group step.
"""

from __future__ import annotations

import torch

from ...comm import Comm
from ...optimizer.sync import step_scaled
from ...pipeline import CrossGroupReducer
from ...ps.compensation import Compensation
from ...ps.flat import flatten_into
from ...ps.stage_client import StageClient
from ..common import compensation_of
from ..config import TrainConfig
from .layout import PipelineLayout, flat_owners, ps_order
from .stages import StageBuild

__all__ = ["ServerStageUpdate", "SyncStageUpdate", "make_stage_update", "stage_ps_comm"]


class SyncStageUpdate:
    """Sync mode: the groups' gradients summed per layer, then the local step.

    Args:
        workers: Every worker (collective construction).
        layout: The job's groups.
        build: This rank's stage and every group's cut.
        optimizer: The user's optimizer over this stage's parameters.
        compensation: The large-mini-batch rule: the step's ``lr`` scaled
            by the global batch over ``--batch-size``, as sync mode does for
            whole replicas.
    """

    def __init__(
        self,
        workers: Comm,
        layout: PipelineLayout,
        build: StageBuild,
        optimizer: torch.optim.Optimizer,
        compensation: Compensation,
    ) -> None:
        self.optimizer, self.compensation = optimizer, compensation
        self.reducer = CrossGroupReducer(
            workers, layout.groups, build.group_bounds, build.units
        )
        self.version = 0

    def apply(self, samples: int, total: int) -> dict:
        """Sum the gradient over the groups and step (``samples`` of ``total``)."""
        self.reducer.allreduce(samples / total)
        step_scaled(self.optimizer, self.compensation.scale(total, self.version, 0))
        self.version += 1
        return {"version": self.version, "stop": False, "staleness": 0}

    def finish(self) -> int:
        """The updates taken (every rank took each one)."""
        return self.version

    def free(self) -> None:
        """Free the communicators of the sums."""
        self.reducer.free()


class ServerStageUpdate:
    """Hybrid and async: each stage exchanges its own parts with the servers.

    Args:
        ps: The servers' communicator (:func:`stage_ps_comm`), dup'd here.
        group: The group's communicator.
        layout: The job's groups.
        servers: The servers' world ranks.
        build: This rank's stage and every group's cut.
        optimizer: The user's optimizer over this stage's parameters (its
            settings go to the servers; its ``lr`` travels with each push).
        compensation: The servers' learning-rate rule.
        staleness_bound: SSP bound, or ``None``.
        max_updates: Version at which the servers stop every group.
    """

    def __init__(
        self,
        ps: Comm,
        group: Comm,
        layout: PipelineLayout,
        servers: tuple[int, ...],
        build: StageBuild,
        optimizer: torch.optim.Optimizer,
        *,
        group_index: int,
        compensation: Compensation,
        staleness_bound: int | None,
        max_updates: int | None,
    ) -> None:
        self.ps = ps.dup("ps")
        self.optimizer = optimizer
        self.params = list(build.module.parameters())
        order = ps_order(layout.groups, servers)
        owners = flat_owners(
            layout.groups, build.group_bounds, build.unit_numels, order
        )
        self.client = StageClient(
            self.ps,
            group,
            group_index=group_index,
            num_groups=len(layout.groups),
            num_servers=len(servers),
            params=self.params,
            optimizer=optimizer,
            owners=owners,
            compensation=compensation,
            staleness_bound=staleness_bound,
            max_updates=max_updates,
        )
        self.version = 0

    def apply(
        self, samples: int, _total: int = 0, *, flags: int = 0, seconds_per_sample=0.0
    ) -> dict:
        """Push this stage's gradient and take its layers' new weights."""
        flatten_into(
            self.client.flat_grad, [p.grad for p in self.params], like=self.params
        )
        lrs = [group["lr"] for group in self.optimizer.param_groups]
        trip = self.client.push(
            float(samples), lrs, flags=flags, seconds_per_sample=seconds_per_sample
        )
        reply = self.client.complete(trip)
        self.client.unpack_into_model()
        self.version = max(reply["versions"])
        reply["version"] = self.version
        return reply

    def done(self) -> None:
        """The group is finished (its leader tells the servers)."""
        self.client.done()

    def finish(self, receives_final: bool) -> int:
        """Group 0 takes its stages' final weights; returns the final version."""
        if receives_final:
            self.version = self.client.receive_final()
            self.client.unpack_into_model()
        return self.version

    def free(self) -> None:
        """Free the servers' communicator copy."""
        self.ps.free()


def make_stage_update(
    cfg: TrainConfig,
    *,
    workers: Comm,
    group: Comm,
    ps: Comm | None,
    layout: PipelineLayout,
    servers: tuple[int, ...],
    build: StageBuild,
    optimizer: torch.optim.Optimizer,
    group_index: int,
) -> SyncStageUpdate | ServerStageUpdate:
    """The update of ``cfg.mode`` (collective: over the workers, or with the servers)."""
    compensation = compensation_of(cfg)
    if cfg.mode == "sync":
        return SyncStageUpdate(workers, layout, build, optimizer, compensation)
    return ServerStageUpdate(
        ps,
        group,
        layout,
        servers,
        build,
        optimizer,
        group_index=group_index,
        compensation=compensation,
        staleness_bound=cfg.staleness_bound,
        max_updates=cfg.steps,
    )


def stage_ps_comm(world: Comm, groups, servers: tuple[int, ...]) -> Comm:
    """The servers' communicator of a pipelined job (collective over ``world``).

    Every worker and server is in it, ordered by :func:`ps_order`; the
    servers pass it to :func:`~hybridagg.ps.server.serve` and the stages to
    :class:`ServerStageUpdate`.
    """
    order = ps_order(groups, servers)
    return world.split(0, order.index(world.rank), name="stages+servers")
