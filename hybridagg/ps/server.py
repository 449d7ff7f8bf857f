"""The parameter-server rank: holds a shard of the model and its optimizer state.

Wire protocol, on a communicator of the group leaders followed by the servers
(leader ``g`` is rank ``g``, server ``s`` is rank ``G + s``); headers and
tags are in :mod:`hybridagg.ps.protocol`.

* ``INIT`` (leader 0 -> each server, pickled once at start): a
  :class:`~hybridagg.ps.spec.ServerSpec`.
* ``PUSH`` (leader -> every server): a header, then the gradient shard in
  *parts* of at most ``part_bytes`` (``HYBRIDAGG_PS_PART_BYTES``; like
  BytePS's tensor partitions), and to server 0 the group's buffers. Each
  part is updated and sent back as soon as it has arrived
  (:mod:`hybridagg.ps.handler`). The leader forwards its
  current learning rates with every push, which is how an LR scheduler
  stepped on the workers keeps working.
* ``PULL``: the same reply without an update (validation, resume).
* ``CKPT c``: the leader's group has saved its part of checkpoint ``c``
  (:mod:`hybridagg.ps.checkpoints`).
* ``DONE``: that leader finished. When every leader is done, the servers
  send their shards (``FINAL``) to leader 0 and return.
* ``LOST`` (``--on-group-failure continue``): a member of the leader's group
  died; the group is dropped (as when the leader itself dies, which the
  server sees as a failed receive). When every group is done or dropped,
  the servers send their shards to the leader ``final_to`` names (after
  the survivors agreed on who is left).

The parts of a server, one module each: the shard and its updates
(:mod:`~hybridagg.ps.store`, :mod:`~hybridagg.ps.lookahead`), the requests
and replies (:mod:`~hybridagg.ps.handler`, :mod:`~hybridagg.ps.replies`), the
groups' progress and the staleness bound (:mod:`~hybridagg.ps.staleness`),
checkpoints and stops (:mod:`~hybridagg.ps.checkpoints`), batch advice
(:mod:`~hybridagg.ps.advice`); this module runs them.

Every wait polls (:func:`hybridagg.comm.wait_until`), so an idle server costs a
small fraction of a core. Waiting for the next message, it sleeps at most
``HYBRIDAGG_SERVER_MAX_SLEEP_US`` between polls, less than the general cap: a
push that arrives while the server sleeps waits for it, and that delay adds
to the round trip of every group's step (bench/RESULTS.md, "The server's
wait for the next push").
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
from mpi4py import MPI

from ..comm import Comm
from ..comm.process import configure_threads
from ..comm.ulfm import failed_world_ranks
from ..runtime import envvars
from ..runtime.outcomes import PeerFailure
from . import protocol as P
from .advice import BatchAdvisor
from .checkpoints import CheckpointCoordinator, CheckpointSchedule
from .failures import LeaderLost
from .handler import RequestHandler
from .lookahead import Lookahead
from .replies import ReplySender
from .reshard import ShardSource
from .spec import ServerSpec
from .staleness import GroupBook
from .store import ShardStore

__all__ = ["ServerStats", "serve", "server_max_sleep"]

# the loop's event for "every running leader reached a checkpoint"
_SNAPSHOT = -1


_FAILURE_CHECK_S = 0.05
"""Seconds between a tolerant server's checks of which peers died (a dead
server ends the job; a dead leader whose receive is not posted, e.g. one
paused for a checkpoint, is dropped)."""

_LONG_SILENCE_S = 0.064
"""Seconds without a message after which the server's short back-off cap
lifts: pushes then arrive rarely, and each wake costs CPU time that the
workers sharing the node could use (an idle server would otherwise wake
thousands of times a second). Where it lifts, the general back-off
(1/32 of the wait) equals the general cap, so a push then waits at most
that cap, a small share of the silence before it."""


def server_threads() -> int | None:
    """Compute threads for a server rank: ``HYBRIDAGG_SERVER_THREADS``, or ``None``.

    ``None`` leaves the rank as :func:`hybridagg.init` set it (the workers'
    setting).

    Raises:
        ValueError: The value is not a positive integer.
    """
    value = envvars.get_int("HYBRIDAGG_SERVER_THREADS")
    if value is not None and value < 1:
        raise ValueError(f"HYBRIDAGG_SERVER_THREADS must be positive, got {value}")
    return value


def server_max_sleep() -> float:
    """How long a server waiting for the next message may sleep between polls.

    Returns:
        ``HYBRIDAGG_SERVER_MAX_SLEEP_US`` in seconds.

    Raises:
        ValueError: The value is not a positive number.
    """
    value = envvars.get_float("HYBRIDAGG_SERVER_MAX_SLEEP_US")
    if value is None or not value > 0:
        raise ValueError(f"HYBRIDAGG_SERVER_MAX_SLEEP_US must be positive, got {value}")
    return value * 1e-6


@dataclass
class ServerStats:
    """What one server did.

    Attributes:
        server: The server's index.
        version: Its final version (updates applied).
        updates_per_leader: Updates applied for each group.
        pulls: Pulls answered.
        held: Replies held back by the staleness bound (server 0).
        max_staleness: Largest staleness of an update.
        checkpoints: Snapshots taken.
        busy_seconds: Time spent handling messages.
        apply_seconds: Time spent in the optimizer.
        apply_times: The optimizer's time per push (the first 10,000 pushes).
        batch_decisions: Server 0's batch changes,
            ``(version, old, new, seconds_per_sample)``.
        nonfinite: The group whose NaN or infinity halted the server
            (``None``: none); the run must then end as non-finite.
        threads: Compute threads the server's updates ran on.
        lost_groups: Groups dropped after a rank died: group -> (the
            ``time.perf_counter()`` when dropped, the world rank found dead).
    """

    server: int
    version: int = 0
    updates_per_leader: list[int] = field(default_factory=list)
    pulls: int = 0
    held: int = 0
    max_staleness: int = 0
    checkpoints: int = 0
    busy_seconds: float = 0.0
    apply_seconds: float = 0.0
    apply_times: list[float] = field(default_factory=list)
    batch_decisions: list = field(default_factory=list)
    nonfinite: int | None = None
    lost_groups: dict = field(default_factory=dict)
    threads: int = 1


class _Server:
    """The lifecycle of one server rank: start-up, the loop, shutdown.

    Start-up receives the ``INIT`` spec from leader 0 and builds the
    server's parts (each a class of its own module); the loop waits for the
    next request or a due snapshot and hands it to the
    :class:`~hybridagg.ps.handler.RequestHandler`; shutdown completes the
    replies, takes a final checkpoint if any update came after the last one,
    and sends the shard to leader 0.
    """

    def __init__(
        self,
        topology,
        timeout: float | None,
        checkpoint_every: int | None,
        on_snapshot: Callable[[int, dict], None] | None,
        on_commit: Callable[[int], None] | None,
        stop_requested: Callable[[], bool] | None,
        restore: dict | None,
        on_batch: Callable[[int, object], None] | None = None,
        drop_lost: bool = False,
        on_drop: Callable[[int, int], None] | None = None,
        poll: Callable[[], object] | None = None,
        fault: Callable[[int], None] | None = None,
        reshard: ShardSource | None = None,
        ps: Comm | None = None,
    ) -> None:
        # (a job with pipelined groups passes the communicator its stages share)
        base = topology.comms.leaders if ps is None else ps
        self.ps = ps = base.dup("ps")
        self.drop_lost, self.poll = drop_lost, poll
        self.server_ranks = set(topology.servers)
        self._next_check = 0.0
        self.num_groups = groups = topology.num_groups
        self.server = ps.rank - groups
        # (a worker may draw its data's first chunk from server 0 before
        # rank 0's optimizer sends this: keep answering meanwhile)
        spec: ServerSpec = ps.recv(
            0, P.INIT, what="parameter-server start-up from rank 0", poll=poll
        )
        if spec.initial_from is not None:
            spec = _receive_initial(ps, spec)
        self.store = store = ShardStore(spec)
        if reshard is not None:
            restore = reshard.restore(spec, store, groups)
        updates = None
        if restore is not None:
            store.load(restore["shard"])
            store.version = int(restore["version"])
            updates = restore["updates_per_leader"]
        self.timeout = ps.timeout if timeout is None else timeout
        self.max_sleep = server_max_sleep()
        lead = self.server == 0
        # only server 0 holds replies back: the leader waits for its reply
        self.book = GroupBook(groups, spec.staleness_bound if lead else None, updates)
        lookahead = Lookahead(spec.compensation, groups)
        self.schedule = CheckpointSchedule(
            checkpoint_every,
            enabled=on_snapshot is not None,
            version=store.version,
            restored=int(restore["checkpoint"]) if restore is not None else 0,
            budget=spec.max_updates,
        )
        self.checkpoints = CheckpointCoordinator(
            ps,
            groups,
            self.server,
            self.schedule,
            on_snapshot,
            on_commit,
            stop_requested,
            num_servers=len(topology.servers),
        )
        self.advisor = (
            BatchAdvisor(spec.batching, groups, on_batch)
            if spec.batching is not None and lead
            else None
        )
        self.replies = ReplySender(ps, groups, store, lookahead, drop_lost)
        self.handler = RequestHandler(
            ps,
            self.server,
            store,
            spec.compensation,
            self.book,
            lookahead,
            self.replies,
            self.checkpoints,
            self.advisor,
            P.request_len(len(spec.hyper)),
            drop_lost=drop_lost,
            on_drop=on_drop,
            fault=fault,
        )
        # every group's buffers before the first push (see prepare)
        self.replies.prepare()
        self.handler.prepare()
        self.busy_seconds = 0.0

    def run(
        self, final_to: Callable[[ServerStats], int | None] | None = None
    ) -> ServerStats:
        """Serve until every leader is done (or dropped), then shut down."""
        handler, book = self.handler, self.book
        lead = self.server == 0
        box: dict[str, int] = {}

        def event() -> bool:
            if self.poll is not None:
                self.poll()
            if self.drop_lost:
                self._check_failures()
            if lead:
                if self.checkpoints.stop_asked():
                    handler.stop()
                self.checkpoints.poll_reports()
            if self._advance():
                return True  # (parts applied: the wait starts over, short sleeps)
            # never a snapshot with a push half applied (a leader sends CKPT
            # only after its round trip, so none is: this keeps it so)
            if not handler.pushes and self.schedule.ready(self.num_groups, book.done):
                box["event"] = _SNAPSHOT
                return True
            g = self._next()
            if g is not None:
                box["event"] = g
                return True
            return book.all_done

        while not book.all_done:
            self.ps.wait_for(
                event,
                "next message from a group leader",
                self.timeout,
                max_sleep=self.max_sleep,
                max_sleep_for=_LONG_SILENCE_S,
            )
            start = time.perf_counter()
            what = box.pop("event", None)
            try:
                if what == _SNAPSHOT:
                    handler.snapshot()
                elif what is not None:
                    handler.handle(what)
            except LeaderLost as lost:  # (only with drop_lost)
                handler.drop(lost.group, lost.rank)
            self.busy_seconds += time.perf_counter() - start
        return self.finish(final_to)

    def _advance(self) -> int:
        """Apply the parts of the pushes in flight that arrived (``drop_lost``:
        a leader that died mid-push has its group dropped, nothing applied)."""
        if not self.handler.pushes:
            return 0
        start = time.perf_counter()
        try:
            moved = self.handler.advance()
        except LeaderLost as lost:
            self.handler.drop(lost.group, lost.rank)
            moved = 1
        self.busy_seconds += time.perf_counter() - start
        return moved

    def _next(self) -> int | None:
        """One test of the inbox (``drop_lost``: a dead leader's group is dropped)."""
        try:
            return self.handler.next_request()
        except LeaderLost as lost:
            self.handler.drop(lost.group, lost.rank)
            return None

    def _check_failures(self) -> None:
        """``drop_lost``: end on a dead server; drop the group of a dead leader.

        Raises:
            PeerFailure: A parameter server died (its shard is gone).
        """
        now = time.perf_counter()
        if now < self._next_check:
            return
        self._next_check = now + _FAILURE_CHECK_S
        dead = failed_world_ranks(self.ps.mpi)
        servers = sorted(self.server_ranks.intersection(dead))
        if servers:
            names = ", ".join(str(r) for r in servers)
            raise PeerFailure(
                f"parameter server rank {names} died; its shard of the model is "
                "lost, so the job cannot go on (resume from the last checkpoint)",
                tuple(servers),
            )
        for g in range(self.num_groups):
            if g not in self.book.done and self.ps.world_rank_of(g) in dead:
                self.handler.drop(g, self.ps.world_rank_of(g))

    def finish(
        self, final_to: Callable[[ServerStats], int | None] | None = None
    ) -> ServerStats:
        """Complete the replies, take the last checkpoint, send the shard to a leader.

        Args:
            final_to: ``f(stats)`` returns the group whose leader receives the
                final shards (``None``: nobody); default: leader 0.
        """
        ps, store, schedule = self.ps, self.store, self.schedule
        while True:
            try:
                self.replies.wait_all()
                break
            except LeaderLost as lost:  # (only with drop_lost)
                self.handler.drop(lost.group, lost.rank)
        halted = self.handler.nonfinite is not None
        if schedule.enabled and store.version != schedule.saved_version and not halted:
            # every server processed the same pushes and CKPTs, so all agree
            # on this final checkpoint's number and on whether it is needed
            for g in range(self.num_groups):
                schedule.pause(g, schedule.saved + 1)
            self.handler.snapshot()
        self.checkpoints.wait_for_commits()
        self.checkpoints.cancel_reports()
        stats = self._stats()
        dest = 0 if final_to is None else final_to(stats)
        if dest is not None:
            # (a pipelined group's parts go to the stages holding them)
            final = [
                ps.Isend(np.array([store.version], dtype=np.float64), dest, P.FINAL),
                *(
                    ps.Isend(store.flat[a:b], store.owners.of(dest, i), P.FINAL)
                    for i, (a, b) in enumerate(store.parts)
                ),
            ]
            if store.buffers is not None:
                final.append(ps.Isend(store.buffers, dest, P.FINAL))
            ps.wait(final, f"final weights to leader {dest}")
        self.checkpoints.wait_cancelled()
        ps.free()
        return stats

    def _stats(self) -> ServerStats:
        return ServerStats(
            server=self.server,
            version=self.store.version,
            updates_per_leader=list(self.book.updates),
            pulls=self.handler.pulls,
            held=self.book.held_count,
            max_staleness=self.book.max_staleness,
            checkpoints=self.checkpoints.saves,
            busy_seconds=self.busy_seconds,
            apply_seconds=self.handler.apply_seconds,
            apply_times=self.handler.apply_times,
            batch_decisions=[] if self.advisor is None else self.advisor.decisions,
            nonfinite=self.handler.nonfinite,
            lost_groups=dict(self.book.lost),
            threads=torch.get_num_threads(),
        )


def _receive_initial(ps: Comm, spec: ServerSpec) -> ServerSpec:
    """The spec with its shard, received in pieces from a pipelined group's stages.

    Each stage of group ``spec.initial_from`` sends the piece of its range
    that lies in this server's shard (tag ``INIT``): no rank held the whole
    model to send it from.
    """
    lo, hi = spec.shard_range
    shard = np.empty(hi - lo, dtype=np.dtype(spec.dtype))
    reqs = []
    for a, b, rank in spec.owners[spec.initial_from]:
        x, y = max(a, lo), min(b, hi)
        if x < y:
            reqs.append(ps.Irecv(shard[x - lo : y - lo], rank, P.INIT))
    ps.wait(reqs, "initial weights from the pipelined stages")
    return dataclasses.replace(spec, shard=shard)


def serve(
    topology,
    *,
    timeout: float | None = None,
    checkpoint_every: int | None = None,
    on_snapshot: Callable[[int, dict], None] | None = None,
    on_commit: Callable[[int], None] | None = None,
    stop_requested: Callable[[], bool] | None = None,
    restore: dict | None = None,
    on_ready: Callable[[], None] | None = None,
    on_batch: Callable[[int, object], None] | None = None,
    drop_lost: bool = False,
    on_drop: Callable[[int, int], None] | None = None,
    poll: Callable[[], object] | None = None,
    final_to: Callable[[ServerStats], int | None] | None = None,
    fault: Callable[[int], None] | None = None,
    reshard: ShardSource | None = None,
    ps: Comm | None = None,
) -> ServerStats:
    """Run this server rank until every group leader is done (collective start).

    Args:
        topology: From :func:`hybridagg.init`, on a server rank.
        timeout: Seconds without any message before the server gives up
            (default ``HYBRIDAGG_TIMEOUT``); the job then aborts.
        checkpoint_every: Server 0 requests a checkpoint every this many
            versions (needs ``on_snapshot``).
        on_snapshot: ``f(c, state)`` saves this server's part of checkpoint
            ``c`` (a dict of tensors and numbers, loadable with
            ``torch.load(weights_only=True)``). Checkpoints are off without it.
        on_commit: Server 0: ``f(c)`` once every server has saved ``c``.
        stop_requested: Server 0: polled; true makes every group stop after
            a final checkpoint (e.g. set by a SIGTERM handler).
        restore: A ``state`` this server saved before: continue from it.
        reshard: A checkpoint written by another number of servers: rebuild
            this server's shard from the old parts it overlaps
            (:mod:`hybridagg.ps.reshard`) and continue from it.
        on_ready: Called once the server holds its shard, before it serves
            (the training driver starts its clock there).
        on_batch: Server 0 with adaptive batching: ``f(version, decision)``
            for every change of the groups' batch sizes.
        drop_lost: ``--on-group-failure continue`` (needs ULFM): a group
            whose leader died or reported ``LOST`` is dropped (its pending
            push discarded, the staleness bound no longer waits for it) and
            the others go on; a dead server raises :class:`PeerFailure`.
        on_drop: ``f(group, dead_world_rank)`` when a group is dropped.
        poll: Called whenever the server tests for the next message (a
            service of its own, e.g. the chunk counter). Without it, server
            0 serves the topology's chunk counter
            (:attr:`hybridagg.topology.Comms.chunks`), which a
            :class:`hybridagg.data.ShareSampler` with dynamic shares draws
            from across nodes, from its start-up until every group is done
            (a group's leader draws its group's chunks and says it is done
            after its last step).
        final_to: At the end, ``f(stats)`` returns the group whose leader
            receives the final shards (``None``: nobody); default leader 0.
        fault: ``f(version)`` after every update (tests' fault injection).
        ps: The communicator of the leaders, then the servers, then the
            pipelined groups' other stages (default: the topology's
            leaders-and-servers communicator); duplicated here.

    Returns:
        This server's statistics.

    Raises:
        ValueError: This rank is not a server, or ``restore`` does not fit.
    """
    if restore is not None and reshard is not None:
        raise ValueError("serve() takes restore= or reshard=, not both")
    if not topology.is_server:
        raise ValueError(f"rank {topology.rank} is a worker, not a parameter server")
    if checkpoint_every is not None and checkpoint_every < 1:
        raise ValueError(f"checkpoint_every must be >= 1, got {checkpoint_every}")
    # a server's update is one fused pass over its shard, which torch spreads
    # over the rank's threads: where the server has cores of its own, more
    # threads shorten every push's round trip
    threads = server_threads()
    if threads is not None:
        configure_threads(threads)
    host = None
    comms = topology.comms
    if poll is None and comms is not None and comms.chunks is not None:
        from ..comm.counter import CounterHost

        host = CounterHost(comms.chunks, range(topology.num_workers))
        poll = host.poll
    # hosting the counter: a thread answers draws through the start-up, whose
    # first optimizer takes most of a second to import (where MPI allows
    # threads; else the start-up's wait for rank 0 polls it); the loop after
    threaded = host is not None and MPI.Query_thread() >= MPI.THREAD_MULTIPLE
    try:
        with host.background() if threaded else contextlib.nullcontext():
            server = _Server(
                topology,
                timeout,
                checkpoint_every,
                on_snapshot,
                on_commit,
                stop_requested,
                restore,
                on_batch,
                drop_lost,
                on_drop,
                None if threaded else poll,
                fault,
                reshard,
                ps,
            )
        server.poll = poll
        if on_ready is not None:
            on_ready()
        return server.run(final_to)
    finally:
        if host is not None:
            host.close()
