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

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from ..runtime import envvars
from . import protocol as P
from .advice import BatchAdvisor
from .checkpoints import CheckpointCoordinator, CheckpointSchedule
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


_LONG_SILENCE_S = 0.064
"""Seconds without a message after which the server's short back-off cap
lifts: pushes then arrive rarely, and each wake costs CPU time that the
workers sharing the node could use (an idle server would otherwise wake
thousands of times a second). Where it lifts, the general back-off
(1/32 of the wait) equals the general cap, so a push then waits at most
that cap, a small share of the silence before it."""


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
        reshard: ShardSource | None = None,
    ) -> None:
        self.ps = ps = topology.comms.leaders.dup("ps")
        self.num_groups = groups = topology.num_groups
        self.server = ps.rank - groups
        spec: ServerSpec = ps.recv(
            0, P.INIT, what="parameter-server start-up from rank 0"
        )
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
        )
        self.advisor = (
            BatchAdvisor(spec.batching, groups, on_batch)
            if spec.batching is not None and lead
            else None
        )
        self.replies = ReplySender(ps, groups, store, lookahead)
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
        )
        self.busy_seconds = 0.0

    def run(self) -> ServerStats:
        """Serve until every leader is done, then shut down."""
        handler, book = self.handler, self.book
        lead = self.server == 0
        box: dict[str, int] = {}

        def event() -> bool:
            if lead:
                if self.checkpoints.stop_asked():
                    handler.stop()
                self.checkpoints.poll_reports()
            if self.schedule.ready(self.num_groups, book.done):
                box["event"] = _SNAPSHOT
                return True
            g = handler.next_request()
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
            if what == _SNAPSHOT:
                handler.snapshot()
            elif what is not None:
                handler.handle(what)
            self.busy_seconds += time.perf_counter() - start
        return self.finish()

    def finish(self) -> ServerStats:
        """Complete the replies, take the last checkpoint, send the shard to leader 0."""
        ps, store, schedule = self.ps, self.store, self.schedule
        self.replies.wait_all()
        halted = self.handler.nonfinite is not None
        if schedule.enabled and store.version != schedule.saved_version and not halted:
            # every server processed the same pushes and CKPTs, so all agree
            # on this final checkpoint's number and on whether it is needed
            for g in range(self.num_groups):
                schedule.pause(g, schedule.saved + 1)
            self.handler.snapshot()
        self.checkpoints.wait_for_commits()
        self.checkpoints.cancel_reports()
        final = [
            ps.Isend(np.array([store.version], dtype=np.float64), 0, P.FINAL),
            *(ps.Isend(store.flat[a:b], 0, P.FINAL) for a, b in store.parts),
        ]
        if store.buffers is not None:
            final.append(ps.Isend(store.buffers, 0, P.FINAL))
        ps.wait(final, "final weights to rank 0")
        self.checkpoints.wait_cancelled()
        ps.free()
        return ServerStats(
            server=self.server,
            version=store.version,
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
        )


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
    reshard: ShardSource | None = None,
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
    server = _Server(
        topology,
        timeout,
        checkpoint_every,
        on_snapshot,
        on_commit,
        stop_requested,
        restore,
        on_batch,
        reshard,
    )
    if on_ready is not None:
        on_ready()
    return server.run()
