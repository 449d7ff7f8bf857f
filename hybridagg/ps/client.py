"""The group leader's side of the parameter-server protocol (see ``server.py``)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..comm import Comm, alloc
from . import protocol as P
from .compensation import Compensation
from .shards import part_ranges, shard_ranges
from .spec import server_specs

__all__ = ["DEFAULT_PART_BYTES", "Exchange", "PSClient"]

DEFAULT_PART_BYTES = 4 * 2**20


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
        part_bytes: Messages are cut into parts of about this size, which
            the servers update and return one by one (the same on every
            leader; default ``HYBRIDAGG_PS_PART_BYTES``, 4 MiB).
        skip_update: Servers return the weights without applying the
            optimizer (to benchmark the transport alone).
        batching: Adaptive batching on server 0: ``initial`` (each group's
            batch), ``deadband``, ``smoothing``, ``window``, ``min_batch``,
            ``max_group_batch``; ``None``: off.
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
        part_bytes: int | None = None,
        skip_update: bool = False,
        batching: dict | None = None,
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
        if part_bytes is None:
            from ..runtime import envvars

            part_bytes = (
                envvars.get_int("HYBRIDAGG_PS_PART_BYTES") or DEFAULT_PART_BYTES
            )
        esize = params[0].element_size()
        self.part_elems = max(1, int(part_bytes) // esize)
        self.parts = [
            [(lo + a, lo + b) for a, b in part_ranges(hi - lo, self.part_elems)]
            for lo, hi in self.ranges
        ]
        self.skip_update = bool(skip_update)
        self.batching = batching
        dtype = params[0].dtype
        self.flat_weights = alloc(sum(numels), dtype, zero=False)
        torch.cat([p.detach().reshape(-1).cpu() for p in params], out=self.flat_weights)
        self.flat_grad = alloc(sum(numels), dtype)
        nbuf = sum(b.numel() for b in buffers)
        self.flat_buffers = alloc(nbuf, torch.float64) if nbuf else None
        self.versions = [0] * self.K
        self.header_len = P.request_len(len(optimizer.param_groups))
        if ps.rank == 0:
            self._send_init(
                numels, optimizer, compensation, staleness_bound, max_updates
            )

    def _send_init(self, numels, optimizer, compensation, bound, budget) -> None:
        specs = server_specs(
            self.params,
            optimizer,
            self.flat_weights,
            self._pack_buffers() if self.buffers else None,
            self.ranges,
            compensation=compensation,
            staleness_bound=bound,
            max_updates=budget,
            part_elems=self.part_elems,
            skip_update=self.skip_update,
            batching=self.batching,
        )
        pending = [
            self.ps.isend(spec, P.server_rank(self.G, s), P.INIT)
            for s, spec in enumerate(specs)
        ]
        self.ps.wait([req for req, _ in pending], "parameter-server start-up")

    def _pack_buffers(self) -> torch.Tensor:
        return torch.cat([b.detach().reshape(-1).double().cpu() for b in self.buffers])

    # --- exchanges -------------------------------------------------------------
    def _post_replies(self) -> tuple[list, list[np.ndarray]]:
        reqs, replies = [], []
        for s in range(self.K):
            head = np.zeros(P.REPLY_LEN, dtype=np.float64)
            reqs.append(self.ps.mpi.Irecv(head, self.G + s, P.REPLY_HDR))
            for lo, hi in self.parts[s]:
                reqs.append(
                    self.ps.Irecv(self.flat_weights[lo:hi], self.G + s, P.REPLY_W)
                )
            replies.append(head)
        if self.flat_buffers is not None:
            reqs.append(self.ps.Irecv(self.flat_buffers, self.G, P.REPLY_BUF))
        return reqs, replies

    def _header(
        self,
        kind: float,
        arg: float = 0.0,
        samples: float = 0.0,
        flags: int = 0,
        info: float = 0.0,
        lrs=(),
    ) -> np.ndarray:
        head = np.zeros(self.header_len, dtype=np.float64)
        head[: P.REQUEST_FIELDS] = (kind, arg, samples, flags, info, 0.0)
        head[P.REQUEST_FIELDS : P.REQUEST_FIELDS + len(lrs)] = lrs
        return head

    def push(
        self,
        grads: list[torch.Tensor | None],
        samples: float,
        lrs: list[float],
        versions: list[int],
        *,
        flags: int = 0,
        info: float = 0.0,
    ) -> Exchange:
        """Post a push of the group gradient and the pull of fresh weights.

        Args:
            grads: The group-averaged gradient of each parameter (``None``:
                zero), or ``self.flat_grad`` itself, already filled.
            samples: The group's samples in this update.
            lrs: Current ``lr`` of each of the user's parameter groups.
            versions: Per shard, the version the gradient was computed from.
            flags: :data:`~hybridagg.ps.protocol.FLAG_STOP` to stop every group.
            info: The group's compute seconds per sample (adaptive batching).
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
        for s in range(self.K):
            head = self._header(P.PUSH, versions[s], samples, flags, info, lrs)
            keep.append(head)
            reqs.append(self.ps.mpi.Isend(head, self.G + s, P.HDR))
            for lo, hi in self.parts[s]:
                reqs.append(self.ps.Isend(self.flat_grad[lo:hi], self.G + s, P.GRAD))
        if self.flat_buffers is not None:
            packed = self._pack_buffers()
            keep.append(packed)
            reqs.append(self.ps.Isend(packed, self.G, P.BUF))
        return Exchange(reqs, replies, keep)

    def pull(self) -> Exchange:
        """Post a pull of the current weights without an update."""
        reqs, replies = self._post_replies()
        keep = []
        for s in range(self.K):
            head = self._header(P.PULL)
            keep.append(head)
            reqs.append(self.ps.mpi.Isend(head, self.G + s, P.HDR))
        return Exchange(reqs, replies, keep)

    def complete(self, exchange: Exchange) -> dict:
        """Wait for an exchange; ``flat_weights`` then holds the servers' weights.

        Returns:
            ``versions`` per shard, ``stop``, max ``staleness``, and from
            server 0 ``lr_scale``, the requested ``checkpoint`` and ``advice``.
        """
        self.ps.wait(exchange.requests, "push/pull with the parameter servers")
        heads = exchange.replies
        self.versions = [int(h[0]) for h in heads]
        return {
            "versions": list(self.versions),
            "stop": bool(max(h[1] for h in heads)),
            "staleness": int(max(h[2] for h in heads)),
            "lr_scale": float(heads[0][3]),
            "checkpoint": int(heads[0][4]),
            "advice": float(heads[0][5]),
        }

    def checkpointed(self, number: int) -> None:
        """Tell every server this group has saved its part of checkpoint ``number``."""
        keep = [self._header(P.CKPT, number) for _ in range(self.K)]
        reqs = [self.ps.mpi.Isend(h, self.G + s, P.HDR) for s, h in enumerate(keep)]
        self.ps.wait(reqs, f"checkpoint {number} report to the parameter servers")

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
        keep = [self._header(P.DONE) for _ in range(self.K)]
        reqs = [self.ps.mpi.Isend(h, self.G + s, P.HDR) for s, h in enumerate(keep)]
        self.ps.wait(reqs, "done message to the parameter servers")

    def receive_final(self, timeout: float | None = None) -> int:
        """On leader 0: receive every server's final shard; returns the version."""
        reqs, heads = [], []
        for s in range(self.K):
            head = np.zeros(1, dtype=np.float64)
            heads.append(head)
            reqs.append(self.ps.mpi.Irecv(head, self.G + s, P.FINAL))
            for lo, hi in self.parts[s]:
                reqs.append(
                    self.ps.Irecv(self.flat_weights[lo:hi], self.G + s, P.FINAL)
                )
        if self.flat_buffers is not None:
            reqs.append(self.ps.Irecv(self.flat_buffers, self.G, P.FINAL))
        self.ps.wait(reqs, "final weights from the parameter servers", timeout)
        return int(max(h[0] for h in heads))
