"""One pipelined stage's side of the parameter-server protocol.

A pipelined group (:mod:`hybridagg.pipeline`) has no rank holding its whole
replica, so no rank can push its gradient or receive its weights whole.
Each stage exchanges the parts of its own layers with the servers: the
servers cut their shards at every stage boundary (:mod:`.owners`), receive
each part from the stage holding it and send the updated part back to it.
Stage 0 is the group's leader on the protocol: it sends the request header
(one update per group step, counted once) and receives the reply header,
which it then shares with its stages, so every stage of the group learns
the version, the stop and the checkpoint at the same step.

A group of one rank is a pipeline of one stage: it holds every part, and
the exchange is the leader's usual one.
"""

from __future__ import annotations

import numpy as np
import torch

from ..comm import Comm
from . import protocol as P
from .client import check_part_tags, part_elements
from .compensation import Compensation
from .flat import unflatten_from
from .owners import Owners, check_owners, owner_cuts
from .shards import part_ranges, shard_ranges
from .spec import param_groups_of, specs_for

__all__ = ["StageClient", "StageTrip"]


class StageTrip:
    """A stage's push-and-pull in flight (see :meth:`StageClient.push`)."""

    def __init__(self, requests: list, replies: list[np.ndarray], keep: list) -> None:
        self.requests, self.replies, self.keep = requests, replies, keep


class StageClient:
    """A pipelined stage's connection to the sharded parameter server.

    Collective over ``group`` (the stages agree on the model's layout) and,
    with the servers' start, over ``ps``.

    Args:
        ps: The communicator of the leaders, then the servers, then the
            other stages (dup'd by the caller, collectively with
            :func:`~hybridagg.ps.server.serve`'s ``ps=``).
        group: The group's communicator, stage ``i`` its rank ``i``.
        group_index: This group's index (its leader is rank ``group_index``
            of ``ps``).
        num_groups: Groups of the job.
        num_servers: Servers of the job.
        params: This stage's parameters, model order (one dtype).
        optimizer: The stage's optimizer (its class and settings are sent).
        owners: Every group's stages' ``(lo, hi, ps_rank)``; the same on
            every rank.
        compensation: The learning-rate rule the servers apply.
        staleness_bound: SSP bound in a group's own updates, or ``None``.
        max_updates: Server version at which every group is told to stop.
        part_bytes: Parts of about this size (default
            ``HYBRIDAGG_PS_PART_BYTES``).

    Raises:
        ValueError: Owners that do not tile the model, a stage whose range
            is not its parameters' size, or parameters of several dtypes.
    """

    def __init__(
        self,
        ps: Comm,
        group: Comm,
        *,
        group_index: int,
        num_groups: int,
        num_servers: int,
        params: list[torch.Tensor],
        optimizer: torch.optim.Optimizer,
        owners: Owners,
        compensation: Compensation,
        staleness_bound: int | None = None,
        max_updates: int | None = None,
        part_bytes: int | None = None,
    ) -> None:
        self.ps, self.group = ps, group
        self.group_index, self.num_groups = group_index, num_groups
        self.num_servers = num_servers
        self.params = params
        self.is_leader = group.rank == 0
        # every stage's sizes and optimizer groups: the servers need the
        # whole model's layout, which no stage holds
        layout = group.allgather(
            (
                [p.numel() for p in params],
                param_groups_of(params, optimizer),
                sorted({str(p.dtype) for p in params}),
            ),
            what="the stages' parameter layout",
        )
        dtypes = {d for _, _, mine in layout for d in mine}
        if len(dtypes) != 1:  # (every stage sees every stage's: one verdict)
            raise ValueError(
                f"the parameter server needs one parameter dtype, got {sorted(dtypes)}"
            )
        numels = [n for mine, _, _ in layout for n in mine]
        group_of = [g for _, mine, _ in layout for g in mine]
        total = sum(numels)
        check_owners(owners, total, num_groups)
        mine = owners[group_index][group.rank]
        self.lo, self.hi = int(mine[0]), int(mine[1])
        own = sum(p.numel() for p in params)
        if own != self.hi - self.lo:
            raise ValueError(
                f"stage {group.rank} of group {group_index} holds {own} "
                f"parameters but owns [{self.lo}, {self.hi}) of the flat model"
            )
        part_elems = part_elements(part_bytes, params[0].element_size())
        self.ranges = shard_ranges(total, num_servers)
        cuts = owner_cuts(owners)
        # (server, index, lo, hi) of every part this stage holds
        self.parts: list[tuple[int, int, int, int]] = []
        most = 0
        for s, (lo, hi) in enumerate(self.ranges):
            shard_cuts = [c - lo for c in cuts]
            cut = part_ranges(hi - lo, part_elems, shard_cuts)
            most = max(most, len(cut))
            for i, (a, b) in enumerate(cut):
                if self.lo <= lo + a and lo + b <= self.hi:
                    self.parts.append((s, i, lo + a, lo + b))
        check_part_tags(ps, most)
        dtype = params[0].dtype
        self.flat_weights = torch.empty(own, dtype=dtype)
        torch.cat([p.detach().reshape(-1).cpu() for p in params], out=self.flat_weights)
        self.flat_grad = torch.zeros(own, dtype=dtype)
        self.versions = [0] * num_servers
        self.request_len = P.request_len(len(optimizer.param_groups))
        if ps.rank == 0:
            specs = specs_for(
                numels,
                group_of,
                optimizer,
                None,
                None,
                self.ranges,
                compensation=compensation,
                staleness_bound=staleness_bound,
                max_updates=max_updates,
                part_elems=part_elems,
                owners={int(g): list(r) for g, r in owners.items()},
                initial_from=group_index,
                dtype=str(self.flat_weights.numpy().dtype),
            )
            pending = [
                ps.isend(spec, self._server(s), P.INIT) for s, spec in enumerate(specs)
            ]
            ps.wait([req for req, _ in pending], "parameter-server start-up")
        if group_index == 0:
            # the initial weights, in pieces: no rank holds them whole
            reqs = []
            for s, (lo, hi) in enumerate(self.ranges):
                x, y = max(lo, self.lo), min(hi, self.hi)
                if x < y:
                    piece = self.flat_weights[x - self.lo : y - self.lo]
                    reqs.append(ps.Isend(piece, self._server(s), P.INIT))
            ps.wait(reqs, "initial weights to the parameter servers")

    def _server(self, s: int) -> int:
        """Server ``s``'s rank on the servers' communicator."""
        return P.server_rank(self.num_groups, s)

    def _local(self, a: int, b: int) -> slice:
        """Flat-model range ``[a, b)`` as a slice of this stage's own range."""
        return slice(a - self.lo, b - self.lo)

    def push(
        self,
        samples: float,
        lrs: list[float],
        *,
        flags: int = 0,
        seconds_per_sample: float = 0.0,
    ) -> StageTrip:
        """Post the push of ``flat_grad`` (this stage's parts) and the pull of its weights.

        Args:
            samples: The group's samples in this update.
            lrs: Current ``lr`` of each parameter group.
            flags: :data:`~hybridagg.ps.protocol.FLAG_STOP` to stop every group.
            seconds_per_sample: The group's compute time per sample.
        """
        reqs, replies, keep = [], [], []
        if self.is_leader:
            for s in range(self.num_servers):
                head = np.zeros(P.REPLY_LEN, dtype=np.float64)
                replies.append(head)
                reqs.append(self.ps.Irecv(head, self._server(s), P.REPLY_HDR))
        for s, i, a, b in self.parts:
            into = self.flat_weights[self._local(a, b)]
            reqs.append(self.ps.Irecv(into, self._server(s), P.part_tag(i)))
        if self.is_leader:
            for s in range(self.num_servers):
                head = P.Request(
                    P.PUSH,
                    self.versions[s],
                    samples,
                    flags,
                    seconds_per_sample,
                    tuple(lrs),
                ).encode(self.request_len)
                keep.append(head)
                reqs.append(self.ps.Isend(head, self._server(s), P.HDR))
        for s, i, a, b in self.parts:
            part = self.flat_grad[self._local(a, b)]
            reqs.append(self.ps.Isend(part, self._server(s), P.part_tag(i)))
        return StageTrip(reqs, replies, keep)

    def complete(self, trip: StageTrip) -> dict:
        """Wait for a push; ``flat_weights`` then holds this stage's new weights.

        Collective over the group: the leader's reply header reaches every
        stage.

        Returns:
            ``versions`` per shard, ``stop``, max ``staleness``, and from
            server 0 ``lr_scale`` and ``checkpoint``; ``nonfinite``: the
            group whose NaN or infinity stopped every group (``None``: none).
        """
        self.ps.wait(trip.requests, "push/pull of a stage with the parameter servers")
        reply = None
        if self.is_leader:
            decoded = [P.Reply.decode(h) for h in trip.replies]
            reply = {
                "versions": [r.version for r in decoded],
                "stop": any(r.stop for r in decoded),
                "staleness": max(r.staleness for r in decoded),
                "lr_scale": decoded[0].lr_scale,
                "checkpoint": decoded[0].checkpoint,
                "nonfinite": next(
                    (r.nonfinite for r in decoded if r.nonfinite is not None), None
                ),
            }
        reply = self.group.bcast(reply, 0, what="the servers' reply to the stages")
        self.versions = list(reply["versions"])
        return reply

    def unpack_into_model(self) -> None:
        """Copy ``flat_weights`` into this stage's parameters."""
        unflatten_from(self.flat_weights, self.params)

    def done(self, nonfinite: int | None = None) -> None:
        """The leader tells every server the group is finished (collective over the group).

        The server answers the header of a push as soon as it counts it, so
        the leader may have its whole reply while another stage's parts of
        that push are still on their way; a ``DONE`` sent then would end the
        server with the push half applied and that stage waiting for its
        reply. Every stage has its reply once the group meets here.
        """
        self.group.barrier(what="every stage's last reply, before done")
        if not self.is_leader:
            return
        request = (
            P.Request(P.DONE)
            if nonfinite is None
            else P.Request(P.DONE, nonfinite, flags=P.FLAG_NONFINITE)
        )
        heads = [request.encode(self.request_len) for _ in range(self.num_servers)]
        reqs = [self.ps.Isend(h, self._server(s), P.HDR) for s, h in enumerate(heads)]
        self.ps.wait(reqs, "done message to the parameter servers")

    def receive_final(self) -> int:
        """Group 0: every stage receives its parts of the final weights.

        Collective over the group. Returns the servers' final version.
        """
        reqs, heads = [], []
        if self.is_leader:
            for s in range(self.num_servers):
                head = np.zeros(1, dtype=np.float64)
                heads.append(head)
                reqs.append(self.ps.Irecv(head, self._server(s), P.FINAL))
        for s, _, a, b in self.parts:
            into = self.flat_weights[self._local(a, b)]
            reqs.append(self.ps.Irecv(into, self._server(s), P.FINAL))
        self.ps.wait(reqs, "final weights from the parameter servers")
        version = int(max(h[0] for h in heads)) if heads else None
        return int(self.group.bcast(version, 0, what="the final version"))
