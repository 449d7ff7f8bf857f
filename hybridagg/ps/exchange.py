"""What a worker does after its group's reduction in ``hybrid`` and ``async`` modes.

The leader pushes the group gradient to the servers and pulls fresh weights
(:class:`~hybridagg.ps.client.PSClient`), then broadcasts them in its group
with a small header (stop flag, whether new weights came, staleness). With
``overlap=True`` the leader posts the exchange and lets the group compute
the next step on the weights it has; the reply is applied one step later,
so each gradient is at least one version stale (counted as staleness).
"""

from __future__ import annotations

import torch

from ..comm import alloc
from ..topology import Topology
from .client import PSClient
from .compensation import Compensation

__all__ = ["GroupExchange"]

# The header a leader broadcasts in its own group (not a parameter-server
# message): stop, new weights, staleness, lr scale, requested checkpoint,
# batch advice, server version.
GROUP_HEAD_LEN = 7


class GroupExchange:
    """The hybrid/async step of one worker.

    Args:
        topology: From :func:`hybridagg.init` (with servers).
        params: The model's parameters (model order).
        buffers: Floating buffers that travel with the weights.
        optimizer: The user's optimizer (its class and settings go to the servers).
        compensation: Learning-rate rule applied by the servers.
        staleness_bound: SSP bound in a group's own updates (``None``: none).
        max_updates: Server version after which every group is told to stop.
        overlap: Overlap a leader's exchange with the group's next step.
        batching: Server-side adaptive batching options (see
            :class:`~hybridagg.ps.client.PSClient`).
    """

    def __init__(
        self,
        topology: Topology,
        params: list[torch.Tensor],
        buffers: list[torch.Tensor],
        optimizer: torch.optim.Optimizer,
        compensation: Compensation,
        staleness_bound: int | None,
        max_updates: int | None,
        overlap: bool,
        batching: dict | None = None,
    ) -> None:
        comms = topology.comms
        self.topology, self.params, self.buffers = topology, params, buffers
        self.is_leader, self.overlap = topology.is_leader, overlap
        self.group = comms.group.dup("group.weights") if comms.group.size > 1 else None
        self.client = None
        if self.is_leader:
            self.client = PSClient(
                comms.leaders.dup("ps"),
                topology.num_groups,
                params,
                buffers,
                optimizer,
                compensation,
                staleness_bound,
                max_updates,
                batching=batching,
            )
        numel = sum(p.numel() for p in params)
        self.wbuf = alloc(numel, params[0].dtype, zero=False)
        nbuf = sum(b.numel() for b in buffers)
        self.bbuf = alloc(nbuf, torch.float64, zero=False) if nbuf else None
        self.head = torch.zeros(GROUP_HEAD_LEN, dtype=torch.float64)
        self.pending = None
        self.unshared = False
        self.model_versions = [0] * (
            topology.comms.leaders.size - topology.num_groups if self.is_leader else 0
        )
        self.should_stop = False
        self.last_staleness = 0
        self.last_lr_scale = 1.0
        self.updates = 0
        self.version = 0  # newest server version this group has seen
        self.checkpoint_requested = 0
        self.checkpoint_done = 0
        self.advice = 0.0
        self.stop_flags = 0
        self.info = 0.0

    # --- leader ------------------------------------------------------------
    def _leader_step(self, grads, samples: float, lrs: list[float]) -> bool:
        """Returns whether the model holds weights the group has not been sent."""
        if self.overlap:
            # the gradient was computed on the weights of the versions held
            # before the pending reply is applied: that is its staleness
            computed_on = list(self.model_versions)
            if self.pending is not None:
                self._finish_pending()
            if samples > 0:
                self.pending = self._push(grads, samples, lrs, computed_on)
        elif samples > 0:
            self._apply(self.client.complete(self._push(grads, samples, lrs)))
        new, self.unshared = self.unshared, False
        return new

    def _push(self, grads, samples, lrs, versions=None):
        return self.client.push(
            grads,
            samples,
            lrs,
            self.model_versions if versions is None else versions,
            flags=self.stop_flags,
            info=self.info,
        )

    def _finish_pending(self) -> None:
        info = self.client.complete(self.pending)
        self.pending = None
        self._apply(info)

    def _apply(self, info: dict) -> None:
        self.client.unpack_into_model()
        self.unshared = True  # (also after a pending reply completed by pull())
        self.model_versions = info["versions"]
        self.should_stop = self.should_stop or info["stop"]
        self.last_staleness = info["staleness"]
        self.last_lr_scale = info["lr_scale"]
        self.checkpoint_requested = max(self.checkpoint_requested, info["checkpoint"])
        self.advice = info["advice"]
        self.version = max(self.version, max(info["versions"]))
        self.updates += 1

    # --- everyone ------------------------------------------------------------
    def step(self, grads, samples: float, lrs: list[float]) -> None:
        """After the group reduction: exchange (leader) and share the weights."""
        new = self._leader_step(grads, samples, lrs) if self.is_leader else False
        if self.group is None:
            return
        if self.is_leader:
            self.head[:] = torch.tensor(
                [
                    float(self.should_stop),
                    float(new),
                    self.last_staleness,
                    self.last_lr_scale,
                    self.checkpoint_requested,
                    self.advice,
                    self.version,
                ],
                dtype=torch.float64,
            )
            if new:
                self._pack()
        group = self.group
        group.Bcast(self.head, 0, what="weights header from the group leader")
        if self.head[1] > 0:
            reqs = [group.Ibcast(self.wbuf, 0)]
            if self.bbuf is not None:
                reqs.append(group.Ibcast(self.bbuf, 0))
            group.wait(reqs, "weights from the group leader")
            if not self.is_leader:
                self._unpack()
                self.updates += 1
        if not self.is_leader:
            self.should_stop = bool(self.head[0])
            self.last_staleness = int(self.head[2])
            self.last_lr_scale = float(self.head[3])
            self.checkpoint_requested = int(self.head[4])
            self.advice = float(self.head[5])
            self.version = int(self.head[6])

    @property
    def checkpoint_due(self) -> int:
        """The checkpoint this group must save now (0: none); same in the group."""
        c = self.checkpoint_requested
        return c if c > self.checkpoint_done else 0

    def checkpointed(self, number: int) -> None:
        """After every member saved its part of ``number``: tell the servers.

        Call on every member of the group (the leader sends ``CKPT``); the
        servers then hold this group's next push until the snapshot is whole.
        """
        self.checkpoint_done = max(self.checkpoint_done, number)
        if self.is_leader:
            self.client.checkpointed(number)

    def refresh(self) -> None:
        """Load the servers' current weights into every member's model (collective).

        Used when training resumes from a checkpoint: the servers hold the
        authoritative model.
        """
        if self.is_leader:
            if self.pending is not None:
                self._finish_pending()
            info = self.client.complete(self.client.pull())
            self.client.unpack_into_model()
            self.model_versions = info["versions"]
            self.version = max(info["versions"])
            self.checkpoint_requested = max(
                self.checkpoint_requested, info["checkpoint"]
            )
            self.checkpoint_done = self.checkpoint_requested
            self._pack()
        if self.group is None:
            return
        self.head[:] = float(self.version)
        self.head[4] = self.checkpoint_done
        self.group.Bcast(self.head, 0, what="resume header from the group leader")
        reqs = [self.group.Ibcast(self.wbuf, 0)]
        if self.bbuf is not None:
            reqs.append(self.group.Ibcast(self.bbuf, 0))
        self.group.wait(reqs, "resumed weights from the group leader")
        if not self.is_leader:
            self._unpack()
            self.version = int(self.head[0])
            self.checkpoint_requested = self.checkpoint_done = int(self.head[4])

    def _pack(self) -> None:
        offset = 0
        for p in self.params:
            n = p.numel()
            self.wbuf[offset : offset + n].copy_(p.detach().reshape(-1))
            offset += n
        if self.bbuf is not None:
            offset = 0
            for b in self.buffers:
                n = b.numel()
                self.bbuf[offset : offset + n].copy_(b.detach().reshape(-1))
                offset += n

    def _unpack(self) -> None:
        offset = 0
        with torch.no_grad():
            for p in self.params:
                n = p.numel()
                p.copy_(self.wbuf[offset : offset + n].view_as(p))
                offset += n
            if self.bbuf is not None:
                offset = 0
                for b in self.buffers:
                    n = b.numel()
                    b.copy_(self.bbuf[offset : offset + n].view_as(b))
                    offset += n

    def pull_state(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """On a leader: the servers' weights and buffers, flat (copies).

        Does not change the model.
        """
        weights = self.pull()
        buffers = self.client.flat_buffers
        return weights, None if buffers is None else buffers.clone()

    def pull(self) -> torch.Tensor:
        """On a leader: the servers' current weights as one flat tensor (a copy).

        Does not change the model. In overlap mode a pending exchange is
        completed (and applied) first.
        """
        if not self.is_leader:
            raise ValueError("only a group leader can pull from the parameter servers")
        if self.pending is not None:
            self._finish_pending()
        saved = self.client.flat_weights.clone()
        self.client.complete(self.client.pull())
        fresh = self.client.flat_weights.clone()
        self.client.flat_weights.copy_(saved)
        return fresh

    def finish(self, timeout: float | None = None) -> int | None:
        """End this group's run (call on every worker, after the last step).

        The leader completes any pending exchange, tells the servers it is
        done; leader 0 then receives the final weights of every shard (once
        every group is done) and loads them into its model.

        Returns:
            On leader 0 the final server version, else ``None``.
        """
        if not self.is_leader:
            return None
        if self.pending is not None:
            self._finish_pending()
        self.client.done()
        if self.client.ps.rank != 0:
            return None
        version = self.client.receive_final(timeout)
        self.client.unpack_into_model()
        return version
