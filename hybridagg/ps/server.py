"""The parameter-server rank: holds a shard of the model and its optimizer state.

Wire protocol, on a communicator of the group leaders followed by the servers
(leader ``g`` is rank ``g``, server ``s`` is rank ``G + s``):

* ``INIT`` (leader 0 -> each server, pickled once at start): optimizer class
  and hyperparameters per parameter group, parameter sizes and group
  membership, this server's initial shard and (server 0) the buffers, the
  compensation settings, the staleness bound and the update budget.
* ``PUSH`` (leader -> every server): a header ``[kind, version_from,
  samples, lr per parameter group...]`` (float64), then the gradient shard
  (and, to server 0, the group's buffers). The server scales each group's
  ``lr`` by :class:`~hybridagg.ps.compensation.Compensation`, applies the
  user's optimizer to its shard, increments its version, and replies
  ``[version, stop, staleness, lr_scale]`` plus its fresh shard (and
  buffers from server 0). The leader forwards its current learning rates
  with every push, which is how an LR scheduler stepped on the workers keeps
  working.
* ``PULL``: the same reply without an update (rank 0 uses it to validate the
  authoritative model).
* ``DONE``: that leader finished. When every leader is done, the servers
  send their shards (``FINAL``) to leader 0 and return.

Bounded staleness (SSP, ``staleness_bound = s``): server 0 holds the reply to
a leader that is more than ``s`` of its own updates ahead of the slowest
group still running, and releases it when that group catches up; the leader
waits for server 0's reply, so it cannot run further ahead. The unit is a
group's own updates; while one gradient is in flight the other ``G - 1``
groups can apply at most about ``s + 1`` updates each, so the version
staleness an update sees is at most about ``(G - 1)(s + 1)``.

Every wait polls (:func:`hybridagg.comm.poll`), so an idle server costs a
small fraction of a core.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch
from mpi4py import MPI

from .compensation import Compensation
from .shards import pieces_of

__all__ = ["DONE", "FINAL", "INIT", "PULL", "PUSH", "ServerStats", "serve"]

# message kinds (first header element) and tags
PUSH, PULL, DONE = 1.0, 2.0, 3.0
INIT, HDR, GRAD, BUF, REPLY_HDR, REPLY_W, REPLY_BUF, FINAL = range(101, 109)
REPLY_LEN = 4


@dataclass
class ServerStats:
    """What one server did."""

    server: int
    version: int = 0
    updates_per_leader: list[int] = field(default_factory=list)
    pulls: int = 0
    held: int = 0
    max_staleness: int = 0
    busy_seconds: float = 0.0
    apply_seconds: float = 0.0


class _Shard:
    """One server's shard: weights, the user's optimizer over its pieces."""

    def __init__(self, spec: dict) -> None:
        self.flat = torch.as_tensor(np.asarray(spec["shard"])).clone()
        self.grad = torch.zeros_like(self.flat)
        lo, hi = spec["range"]
        self.pieces = pieces_of(spec["numels"], lo, hi)
        by_group: dict[int, list[torch.nn.Parameter]] = {}
        for piece in self.pieces:
            view = self.flat[piece.offset : piece.offset + piece.numel]
            param = torch.nn.Parameter(view)
            param.grad = self.grad[piece.offset : piece.offset + piece.numel]
            by_group.setdefault(spec["group_of"][piece.param], []).append(param)
        self.user_groups = sorted(by_group)
        groups = [{**spec["hyper"][g], "params": by_group[g]} for g in self.user_groups]
        cls = spec["optimizer"]
        self.optimizer = cls(groups, **spec["defaults"]) if groups else None
        self.buffers = (
            torch.as_tensor(np.asarray(spec["buffers"])).clone()
            if spec.get("buffers") is not None
            else None
        )

    def apply(self, lrs: list[float], scale: float) -> None:
        if self.optimizer is None:
            return
        for group, user_group in zip(
            self.optimizer.param_groups, self.user_groups, strict=True
        ):
            group["lr"] = lrs[user_group] * scale
        self.optimizer.step()


def serve(topology, *, timeout: float | None = None) -> ServerStats:
    """Run this server rank until every group leader is done (collective start).

    Args:
        topology: From :func:`hybridagg.init`, on a server rank.
        timeout: Seconds without any message before the server gives up
            (default ``HYBRIDAGG_TIMEOUT``); the job then aborts.

    Returns:
        This server's statistics.

    Raises:
        ValueError: This rank is not a server.
    """
    if not topology.is_server:
        raise ValueError(f"rank {topology.rank} is a worker, not a parameter server")
    ps = topology.comms.leaders.dup("ps")
    G = topology.num_groups
    me = ps.rank - G
    spec = ps.recv_obj(0, INIT, what="parameter-server start-up from rank 0")
    shard = _Shard(spec)
    comp: Compensation = spec["compensation"]
    bound: int | None = spec["staleness_bound"]
    budget: int | None = spec["max_updates"]
    ngroups_user = len(spec["hyper"])
    stats = ServerStats(server=me, updates_per_leader=[0] * G)
    headers = [np.zeros(3 + ngroups_user, dtype=np.float64) for _ in range(G)]
    hreqs = [ps.mpi.Irecv(headers[g], g, HDR) for g in range(G)]
    reply_h = [np.zeros(REPLY_LEN, dtype=np.float64) for _ in range(G)]
    # Replies are sent from the shard itself (no copy); before the shard
    # changes, every reply in flight is completed (the leader posted its
    # receive before pushing, so this is quick).
    sends: list[list[MPI.Request]] = [[] for _ in range(G)]
    held: dict[int, tuple[int, float]] = {}
    done: set[int] = set()
    timeout = ps.timeout if timeout is None else timeout
    version = 0

    def reply(g: int, staleness: int, scale: float) -> None:
        ps.wait(sends[g], f"previous reply to leader {g}")
        stop = 1.0 if budget is not None and version >= budget else 0.0
        reply_h[g][:] = (version, stop, staleness, scale)
        reqs = [
            ps.mpi.Isend(reply_h[g], g, REPLY_HDR),
            ps.isend(shard.flat, g, REPLY_W),
        ]
        if shard.buffers is not None:
            reqs.append(ps.isend(shard.buffers, g, REPLY_BUF))
        sends[g] = reqs

    def too_far_ahead(g: int) -> bool:
        running = [stats.updates_per_leader[h] for h in range(G) if h not in done]
        return bool(running) and stats.updates_per_leader[g] - min(running) > bound

    def release_held() -> None:
        for g in sorted(held):
            if not too_far_ahead(g):
                staleness, scale = held.pop(g)
                reply(g, staleness, scale)

    box: dict[str, int] = {}

    def arrived() -> bool:
        index = MPI.Request.Testany(hreqs)[0]
        if index != MPI.UNDEFINED:
            box["g"] = index
            return True
        return False

    while len(done) < G:
        ps.wait_for(arrived, "next message from a group leader", timeout)
        g = box["g"]
        header = headers[g]
        kind = header[0]
        start = time.perf_counter()
        if kind == PUSH:
            reqs = [ps.irecv(shard.grad, g, GRAD)]
            incoming_buffers = None
            if shard.buffers is not None:
                incoming_buffers = torch.empty_like(shard.buffers)
                reqs.append(ps.irecv(incoming_buffers, g, BUF))
            ps.wait(reqs, f"gradient from leader {g}")
            version_from, samples = int(header[1]), float(header[2])
            staleness = version - version_from
            scale = comp.scale(samples, version, staleness)
            ps.wait([r for reqs in sends for r in reqs], "replies in flight")
            applied = time.perf_counter()
            shard.apply(header[3:].tolist(), scale)
            stats.apply_seconds += time.perf_counter() - applied
            if incoming_buffers is not None:
                shard.buffers.copy_(incoming_buffers)
            version += 1
            stats.updates_per_leader[g] += 1
            stats.max_staleness = max(stats.max_staleness, staleness)
            if me == 0 and bound is not None and too_far_ahead(g):
                held[g] = (staleness, scale)
                stats.held += 1
            else:
                reply(g, staleness, scale)
            if me == 0 and bound is not None:
                release_held()
            hreqs[g] = ps.mpi.Irecv(headers[g], g, HDR)
        elif kind == PULL:
            stats.pulls += 1
            reply(g, 0, 0.0)
            hreqs[g] = ps.mpi.Irecv(headers[g], g, HDR)
        elif kind == DONE:
            done.add(g)
            hreqs[g] = MPI.REQUEST_NULL
            if me == 0 and bound is not None:
                release_held()
        else:
            raise RuntimeError(
                f"server {me}: unknown message kind {kind} from leader {g}"
            )
        stats.busy_seconds += time.perf_counter() - start

    for g in range(G):
        ps.wait(sends[g], f"last reply to leader {g}")
    final = [
        ps.mpi.Isend(np.array([version], dtype=np.float64), 0, FINAL),
        ps.isend(shard.flat, 0, FINAL),
    ]
    if shard.buffers is not None:
        final.append(ps.isend(shard.buffers, 0, FINAL))
    ps.wait(final, "final weights to rank 0")
    stats.version = version
    ps.free()
    return stats
