"""The group leader's side of the parameter-server protocol (see ``server.py``)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..comm import Comm
from .compensation import Compensation
from .server import (
    BUF,
    DONE,
    FINAL,
    GRAD,
    HDR,
    INIT,
    PULL,
    PUSH,
    REPLY_BUF,
    REPLY_HDR,
    REPLY_LEN,
    REPLY_W,
)
from .shards import shard_ranges

__all__ = ["Exchange", "PSClient"]


@dataclass
class Exchange:
    """A push-and-pull (or pull) in flight."""

    requests: list
    replies: list[np.ndarray]
    keep: list  # buffers that must outlive the requests


class PSClient:
    """A group leader's connection to the sharded parameter server.

    Args:
        ps: Communicator of the leaders followed by the servers (dup'd by the
            caller, collectively with :func:`~hybridagg.ps.server.serve`).
        num_groups: Number of groups (= leaders).
        params: The model's parameters, model order (all one dtype).
        buffers: Floating buffers travelling with the weights (may be empty).
        optimizer: The user's optimizer (class and hyperparameters are sent).
        compensation: The learning-rate rule the servers apply.
        staleness_bound: SSP bound ``s`` in a group's own updates, or ``None``.
        max_updates: Server version at which leaders are told to stop.
    """

    def __init__(
        self,
        ps: Comm,
        num_groups: int,
        params: list[torch.Tensor],
        buffers: list[torch.Tensor],
        optimizer: torch.optim.Optimizer,
        compensation: Compensation,
        staleness_bound: int | None = None,
        max_updates: int | None = None,
    ) -> None:
        self.ps, self.G = ps, num_groups
        self.K = ps.size - num_groups
        dtypes = {p.dtype for p in params}
        if len(dtypes) != 1:
            raise ValueError(
                f"the parameter server needs one parameter dtype, got {dtypes}"
            )
        self.params, self.buffers = params, buffers
        numels = [p.numel() for p in params]
        self.ranges = shard_ranges(sum(numels), self.K)
        self.flat_weights = torch.cat([p.detach().reshape(-1) for p in params]).cpu()
        self.flat_grad = torch.zeros_like(self.flat_weights)
        nbuf = sum(b.numel() for b in buffers)
        self.flat_buffers = torch.zeros(nbuf, dtype=torch.float64) if nbuf else None
        self.versions = [0] * self.K
        self.header_len = 3 + len(optimizer.param_groups)
        if ps.rank == 0:
            self._send_init(
                numels, optimizer, compensation, staleness_bound, max_updates
            )

    def _send_init(self, numels, optimizer, compensation, bound, budget) -> None:
        group_of = {}
        for g, group in enumerate(optimizer.param_groups):
            for p in group["params"]:
                group_of[id(p)] = g
        missing = [i for i, p in enumerate(self.params) if id(p) not in group_of]
        if missing:
            raise ValueError(f"parameters {missing} are not in the optimizer")
        hyper = [
            {k: v for k, v in group.items() if k != "params"}
            for group in optimizer.param_groups
        ]
        pending = []
        for s, (lo, hi) in enumerate(self.ranges):
            spec = {
                "optimizer": type(optimizer),
                "defaults": dict(optimizer.defaults),
                "hyper": hyper,
                "group_of": [group_of[id(p)] for p in self.params],
                "numels": numels,
                "range": (lo, hi),
                "shard": self.flat_weights[lo:hi].numpy().copy(),
                "buffers": self._pack_buffers().numpy().copy()
                if s == 0 and self.buffers
                else None,
                "compensation": compensation,
                "staleness_bound": bound,
                "max_updates": budget,
            }
            pending.append(self.ps.isend_obj(spec, self.G + s, INIT))
        self.ps.wait([req for req, _ in pending], "parameter-server start-up")

    def _pack_buffers(self) -> torch.Tensor:
        return torch.cat([b.detach().reshape(-1).double().cpu() for b in self.buffers])

    # --- exchanges -------------------------------------------------------------
    def _post_replies(self) -> tuple[list, list[np.ndarray]]:
        reqs, replies = [], []
        for s, (lo, hi) in enumerate(self.ranges):
            head = np.zeros(REPLY_LEN, dtype=np.float64)
            reqs.append(self.ps.mpi.Irecv(head, self.G + s, REPLY_HDR))
            reqs.append(self.ps.irecv(self.flat_weights[lo:hi], self.G + s, REPLY_W))
            replies.append(head)
        if self.flat_buffers is not None:
            reqs.append(self.ps.irecv(self.flat_buffers, self.G, REPLY_BUF))
        return reqs, replies

    def push(
        self,
        grads: list[torch.Tensor | None],
        samples: float,
        lrs: list[float],
        versions: list[int],
    ) -> Exchange:
        """Post a push of the group gradient and the pull of fresh weights.

        Args:
            grads: The group-averaged gradient of each parameter (``None``:
                zero), or ``self.flat_grad`` itself, already filled.
            samples: The group's samples in this update.
            lrs: Current ``lr`` of each of the user's parameter groups.
            versions: Per shard, the version the gradient was computed from.
        """
        if grads is not self.flat_grad:  # else the caller filled it in place
            offset = 0
            for p, g in zip(self.params, grads, strict=True):
                n = p.numel()
                view = self.flat_grad[offset : offset + n]
                if g is None:
                    view.zero_()
                else:
                    view.copy_(g.reshape(-1))
                offset += n
        reqs, replies = self._post_replies()
        keep = []
        for s, (lo, hi) in enumerate(self.ranges):
            head = np.array([PUSH, versions[s], samples, *lrs], dtype=np.float64)
            keep.append(head)
            reqs.append(self.ps.mpi.Isend(head, self.G + s, HDR))
            reqs.append(self.ps.isend(self.flat_grad[lo:hi], self.G + s, GRAD))
        if self.flat_buffers is not None:
            packed = self._pack_buffers()
            keep.append(packed)
            reqs.append(self.ps.isend(packed, self.G, BUF))
        return Exchange(reqs, replies, keep)

    def pull(self) -> Exchange:
        """Post a pull of the current weights without an update."""
        reqs, replies = self._post_replies()
        keep = []
        for s in range(self.K):
            head = np.zeros(self.header_len, dtype=np.float64)
            head[0] = PULL
            keep.append(head)
            reqs.append(self.ps.mpi.Isend(head, self.G + s, HDR))
        return Exchange(reqs, replies, keep)

    def complete(self, exchange: Exchange) -> dict:
        """Wait for an exchange; ``flat_weights`` then holds the servers' weights.

        Returns:
            ``versions`` per shard, ``stop``, max ``staleness`` and ``lr_scale``
            (as applied by server 0).
        """
        self.ps.wait(exchange.requests, "push/pull with the parameter servers")
        heads = exchange.replies
        self.versions = [int(h[0]) for h in heads]
        return {
            "versions": list(self.versions),
            "stop": bool(max(h[1] for h in heads)),
            "staleness": int(max(h[2] for h in heads)),
            "lr_scale": float(heads[0][3]),
        }

    def unpack_into_model(self) -> None:
        """Copy ``flat_weights`` (and buffers) into the model's tensors."""
        offset = 0
        with torch.no_grad():
            for p in self.params:
                n = p.numel()
                p.copy_(self.flat_weights[offset : offset + n].view_as(p))
                offset += n
            if self.flat_buffers is not None:
                offset = 0
                for b in self.buffers:
                    n = b.numel()
                    b.copy_(self.flat_buffers[offset : offset + n].view_as(b))
                    offset += n

    def done(self) -> None:
        """Tell every server this leader is finished."""
        keep, reqs = [], []
        for s in range(self.K):
            head = np.zeros(self.header_len, dtype=np.float64)
            head[0] = DONE
            keep.append(head)
            reqs.append(self.ps.mpi.Isend(head, self.G + s, HDR))
        self.ps.wait(reqs, "done message to the parameter servers")

    def receive_final(self, timeout: float | None = None) -> int:
        """On leader 0: receive every server's final shard; returns the version."""
        reqs, heads = [], []
        for s, (lo, hi) in enumerate(self.ranges):
            head = np.zeros(1, dtype=np.float64)
            heads.append(head)
            reqs.append(self.ps.mpi.Irecv(head, self.G + s, FINAL))
            reqs.append(self.ps.irecv(self.flat_weights[lo:hi], self.G + s, FINAL))
        if self.flat_buffers is not None:
            reqs.append(self.ps.irecv(self.flat_buffers, self.G, FINAL))
        self.ps.wait(reqs, "final weights from the parameter servers", timeout)
        return int(max(h[0] for h in heads))
