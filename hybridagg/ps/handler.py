"""A server's handling of the leaders' requests: push, pull, checkpoint, done.

A push arrives as a header, then the gradient shard in parts (each with its
own tag, in any order: a streamed push sends them in backward order as the
group's reduction completes), and to server 0 the group's buffers. The
header posts every receive; the server loop then applies each part as it
arrives (:meth:`RequestHandler.advance`), scaling the group's forwarded
``lr`` by the compensation, and sends the updated part back, while it goes
on serving the other leaders (pushes of several groups may be in flight).
A part of length 0 is not applied: the leader cut its push short there.
On a compact wire (``bf16``, ``fp16``) parts land in the wire's type (each
group after the first in a compact buffer of its own) and are widened to
float32 just before they are checked and applied.

Non-finite values: each part of a pushed gradient (and the buffers) is
checked before it is applied. A NaN or an infinity, or a leader's ``DONE``
saying its group's loss or gradient was not finite, *halts* the server: it
applies nothing more (pushes are still received and answered), every reply
tells the leader to stop and names the group, no snapshot is taken, and
:attr:`RequestHandler.nonfinite` says why the run ends. Parts of the refused
push that came before the bad one were applied already (each part is
applied as it arrives); the run then stops without a checkpoint, so the last
checkpoint is where to resume.

With ``drop_lost=True`` (``--on-group-failure continue``) a group whose
leader died (its receive fails with a ULFM error) or whose leader says
``LOST`` is dropped (:meth:`RequestHandler.drop`): its pending push is
discarded, its held reply too, and the staleness bound stops waiting for
it. A push is then received whole before any part is applied, so a leader
that dies in the middle of one leaves no half-applied gradient.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch
from mpi4py import MPI

from ..comm import Comm, CommTimeoutError, WireCodec, all_finite, alloc
from . import protocol as P
from .advice import BatchAdvisor
from .checkpoints import CheckpointCoordinator
from .compensation import Compensation
from .failures import leader_lost
from .lookahead import Lookahead
from .replies import ReplySender
from .staleness import GroupBook, HeldReply
from .store import ShardStore

__all__ = ["RequestHandler"]

# apply times kept for the statistics: enough for medians, bounded memory
_MAX_APPLY_TIMES = 10_000


@dataclass(frozen=True)
class _Landing:
    """Where one group's pushed gradient lands, and the float32 it is applied from.

    Parts are received in the wire's type (:meth:`receive_into`) and widened
    into ``flat`` (:meth:`widen`) just before they are checked and applied;
    on the float32 wire they land in ``flat`` itself.
    """

    codec: WireCodec
    flat: torch.Tensor
    """The whole shard's float32 gradient, as the optimizer reads it."""

    def receive_into(self, a: int, b: int) -> torch.Tensor:
        """The memory part ``[a, b)`` of the shard is received into."""
        return self.codec.landing(self.flat, a, b)

    def widen(self, a: int, b: int) -> torch.Tensor:
        """Part ``[a, b)`` in float32, once it has arrived (``flat[a:b]``)."""
        self.codec.decode(self.flat, a, b)
        return self.flat[a:b]


@dataclass
class _Push:
    """A push in flight on a server: its receives and what is left to do."""

    g: int
    request: P.Request
    landing: _Landing
    """Where the gradient lands (the whole shard)."""
    parts: list[MPI.Request]
    incoming: torch.Tensor | None
    """Server 0: the group's buffers."""
    buffers: MPI.Request
    replies: list[MPI.Request] = field(default_factory=list)
    begun: bool = False
    """Counted as an update (``drop_lost``: only once whole)."""
    staleness: int = 0
    scale: float = 1.0
    hold: bool = False
    """The staleness bound holds its reply."""
    waiting: list[int] = field(default_factory=list)
    """Parts not arrived yet."""
    ready: list[int] = field(default_factory=list)
    """Parts arrived and not applied yet (``drop_lost``: until all are in)."""
    applied: float = 0.0
    """Seconds in the optimizer."""
    last: float = field(default_factory=time.perf_counter)
    """When a part last arrived (or the push began)."""
    empty: set[int] = field(default_factory=set)
    """Parts that came with length 0: the leader cut its push short there
    (its group's gradient was not finite); they are not applied."""
    cut: bool = False
    """The buffers came with length 0 (the push was cut short)."""

    def __post_init__(self) -> None:
        self.waiting = list(range(len(self.parts)))

    @property
    def lrs(self) -> list[float]:
        return list(self.request.lrs)


class RequestHandler:
    """One server's receipt of requests and its answers to them.

    Owns the posted receive of each leader's next request header, and what
    each kind of request does to the shard, the groups' bookkeeping, the
    checkpoints and the replies.

    Args:
        ps: The leaders-and-servers communicator.
        server: This server's index (server 0 enforces the staleness bound,
            requests checkpoints and stops, and advises batches).
        store: The shard.
        compensation: The learning-rate rule.
        book: The groups' progress and the staleness bound.
        lookahead: The groups' predictions.
        replies: The replies in flight.
        checkpoints: The checkpoint coordination.
        advisor: Server 0's batch advice, or ``None``.
        request_len: Length of a request header.
        drop_lost: Drop a group whose leader died or reported a lost
            member, instead of failing (needs ULFM).
        on_drop: ``f(group, dead_rank)`` after a group was dropped.
        fault: ``f(version)`` after each update (a test's fault injection).

    Attributes:
        nonfinite: The group whose NaN or infinity halted this server
            (``None``: running).
    """

    def __init__(
        self,
        ps: Comm,
        server: int,
        store: ShardStore,
        compensation: Compensation,
        book: GroupBook,
        lookahead: Lookahead,
        replies: ReplySender,
        checkpoints: CheckpointCoordinator,
        advisor: BatchAdvisor | None,
        request_len: int,
        drop_lost: bool = False,
        on_drop=None,
        fault=None,
    ) -> None:
        self.ps, self.server, self.store = ps, server, store
        self.drop_lost, self.on_drop, self.fault = drop_lost, on_drop, fault
        self.compensation, self.book, self.lookahead = compensation, book, lookahead
        self.replies, self.checkpoints, self.advisor = replies, checkpoints, advisor
        self.schedule = checkpoints.schedule
        self.pulls = 0
        self.apply_seconds = 0.0
        self.apply_times: list[float] = []
        self.nonfinite: int | None = None
        self.pushes: dict[int, _Push] = {}
        """The pushes in flight, by group."""
        self.landings: dict[int, _Landing] = {}
        groups = book.num_groups
        self.headers = [np.zeros(request_len, dtype=np.float64) for _ in range(groups)]
        self.inbox = [MPI.REQUEST_NULL] * groups
        for g in range(groups):
            self.listen(g)

    # --- the inbox ---------------------------------------------------------------
    def listen(self, g: int) -> None:
        """Post the receive of leader ``g``'s next request."""
        self.inbox[g] = self.ps.Irecv(self.headers[g], g, P.HDR)

    def next_request(self) -> int | None:
        """A leader whose request has arrived, or ``None``.

        Raises:
            LeaderLost: (``drop_lost``) a leader's receive failed: it died.
        """
        if not self.drop_lost:
            index = MPI.Request.Testany(self.inbox)[0]
            return None if index == MPI.UNDEFINED else index
        # one test per leader: a failed request must name its leader
        for g, req in enumerate(self.inbox):
            if req == MPI.REQUEST_NULL:
                continue
            try:
                if req.Test():
                    return g
            except MPI.Exception as exc:
                self._lost(g, exc)
        return None

    def _lost(self, g: int, exc: MPI.Exception) -> None:
        """Turn a ULFM error on leader ``g``'s traffic into :class:`LeaderLost`."""
        if not self.drop_lost:
            raise exc
        raise leader_lost(self.ps, g, exc) from exc

    def drop(self, g: int, dead_rank: int) -> None:
        """Drop group ``g``: nothing more is received from or sent to it."""
        self.inbox[g] = MPI.REQUEST_NULL
        push = self.pushes.pop(g, None)
        if push is not None:  # nothing of it was applied (whole before applied)
            for req in [*push.parts, push.buffers]:
                _forget(req)
        self.replies.drop(g)
        if self.book.drop(g, time.perf_counter(), dead_rank):
            self.schedule.paused.pop(g, None)
            if self.on_drop is not None:
                self.on_drop(g, dead_rank)
        if self.server == 0:
            self.release_held()

    def handle(self, g: int) -> None:
        """Act on leader ``g``'s request (it has arrived).

        Raises:
            RuntimeError: An unknown kind of request.
        """
        request = P.Request.decode(self.headers[g])
        if request.kind == P.PUSH:
            self.push(g, request)
            self.listen(g)
        elif request.kind == P.PULL:
            self.pulls += 1
            self.replies.send_whole(g, self._reply(g, 0, 0.0))
            self.listen(g)
        elif request.kind == P.CKPT:
            # nothing more from g until the snapshot
            self.schedule.pause(g, request.arg)
            self.inbox[g] = MPI.REQUEST_NULL
        elif request.kind == P.LOST and self.drop_lost:
            self.drop(g, request.arg)
        elif request.kind == P.DONE:
            if request.flags & P.FLAG_NONFINITE:
                self.halt(request.arg)
            self.book.finish(g)
            self.inbox[g] = MPI.REQUEST_NULL
            if self.server == 0:
                self.release_held()
        else:
            raise RuntimeError(
                f"server {self.server}: unknown message kind {request.kind} from leader {g}"
            )

    # --- pushes ----------------------------------------------------------------
    def push(self, g: int, request: P.Request) -> None:
        """Start leader ``g``'s push: count it, post the receive of every part.

        The parts are then applied by :meth:`advance`, each as it arrives,
        while the server goes on answering the other leaders (a pipelined
        push's parts follow its header over the whole backward pass).
        """
        ps, store = self.ps, self.store
        if g in self.pushes:
            raise RuntimeError(
                f"server {self.server}: leader {g} pushed again before its push ended"
            )
        if request.flags & P.FLAG_STOP and self.server == 0:
            self.stop()
        if self.advisor is not None:
            self.advisor.observe(
                g, request.seconds_per_sample, request.samples, store.version
            )
        landing = self._landing(g)
        parts = [
            ps.Irecv(landing.receive_into(a, b), store.owners.of(g, i), P.part_tag(i))
            for i, (a, b) in enumerate(store.parts)
        ]
        incoming, buffers = None, MPI.REQUEST_NULL
        if store.buffers is not None:
            incoming = torch.empty_like(store.buffers)
            buffers = ps.Irecv(incoming, g, P.BUF)
        self.pushes[g] = push = _Push(g, request, landing, parts, incoming, buffers)
        if not self.drop_lost:  # (else once the push is whole)
            self._begin(push)
        self._advance(self.pushes[g])

    def _begin(self, push: _Push) -> None:
        """Count ``push`` as an update and send its reply header (unless held)."""
        g, request, store = push.g, push.request, self.store
        version = store.version
        push.staleness = staleness = version - request.arg
        push.scale = scale = self.compensation.scale(
            request.samples, version, staleness
        )
        self.lookahead.observe(g, staleness, push.lrs, request.samples, version)
        self.replies.before_update()
        store.version += 1
        self.book.record(g, staleness)
        if self.server == 0 and self.schedule.request_due(store.version):
            self.release_held(everyone=True)
        push.hold = self.nonfinite is None and self.book.too_far_ahead(
            g, self.schedule.pending
        )
        if not push.hold:
            push.replies.append(
                self.replies.header(g, self._reply(g, staleness, scale))
            )
        push.begun = True

    def advance(self) -> int:
        """Apply the parts that arrived, in every push in flight.

        Returns:
            How many parts (and buffers) arrived since the last call.

        Raises:
            LeaderLost: (``drop_lost``) a leader died in the middle of its push.
            CommTimeoutError: A push received nothing for the communicator's
                timeout (a leader stuck in the middle of its push).
        """
        moved = 0
        for push in list(self.pushes.values()):
            moved += self._advance(push)
        return moved

    def _arrived(self, push: _Push) -> list[int]:
        """The parts of ``push`` that arrived since the last look, as tested."""
        out = []
        for i in push.waiting:
            status = MPI.Status()
            try:
                done = push.parts[i].Test(status)
            except MPI.Exception as exc:
                self._lost(push.g, exc)
            if done:
                out.append(i)
                if status.Get_count(MPI.BYTE) == 0:
                    push.empty.add(i)  # the leader cut its push short
        return out

    def _advance(self, push: _Push) -> int:
        """Apply (and answer) the parts of ``push`` that have arrived; returns how many."""
        g, store = push.g, self.store
        arrived = self._arrived(push)
        push.waiting = [i for i in push.waiting if i not in set(arrived)]
        push.ready += arrived
        moved = len(arrived)
        if push.buffers != MPI.REQUEST_NULL:
            status = MPI.Status()
            try:
                if push.buffers.Test(status):
                    push.buffers = MPI.REQUEST_NULL
                    push.cut = status.Get_count(MPI.BYTE) == 0
                    moved += 1
            except MPI.Exception as exc:
                self._lost(g, exc)
        now = time.perf_counter()
        if moved:
            push.last = now
        elif now - push.last > self.ps.timeout:
            raise CommTimeoutError(
                f"server {self.server}: the push of leader {g} received nothing "
                f"for {self.ps.timeout:g} s ({len(push.waiting)} of "
                f"{len(push.parts)} parts missing; raise HYBRIDAGG_TIMEOUT if "
                "the leader is legitimately slow)"
            )
        if self.drop_lost and (push.waiting or push.buffers != MPI.REQUEST_NULL):
            return moved  # whole before applied: a leader dying mid-push leaves nothing
        if not push.begun:
            self._begin(push)
        t0 = time.perf_counter()
        for i in push.ready:
            a, b = store.parts[i]
            if i not in push.empty and self.nonfinite is None:
                part = push.landing.widen(a, b)  # (bf16/fp16: to float32)
                if all_finite([part]):
                    store.apply(i, push.lrs, push.scale, push.landing.flat)
                else:
                    self.halt(g)  # one group must not poison the model
            if not push.hold:
                push.replies.append(self.replies.weights(g, i, predict=True))
        push.applied += time.perf_counter() - t0
        push.ready = []
        if not push.waiting and push.buffers == MPI.REQUEST_NULL:
            self._finish(push)
        return moved

    def _finish(self, push: _Push) -> None:
        """Every part of ``push`` is in: the buffers, the reply, the counts."""
        g, store = push.g, self.store
        del self.pushes[g]
        incoming = push.incoming
        if incoming is not None:
            if not push.cut and self.nonfinite is None and not all_finite([incoming]):
                self.halt(g)
            if not push.cut and self.nonfinite is None:
                store.buffers.copy_(incoming)
            if not push.hold:
                push.replies.append(self.replies.buffers(g))
        self.replies.track(g, push.replies)
        if self.fault is not None:
            self.fault(store.version)
        self.apply_seconds += push.applied
        if len(self.apply_times) < _MAX_APPLY_TIMES:
            self.apply_times.append(push.applied)
        if push.hold:
            self.book.hold(HeldReply(g, push.staleness, push.scale))
        if self.server == 0:
            self.release_held()

    def prepare(self) -> None:
        """Make every group's landing buffer now, its pages touched.

        Made at a group's first push instead, each buffer's first receive
        pays the kernel's page faults inside the push, while the other
        leaders queue behind it: with the ResNet-50 twin's 94 MB shard the
        first pushes took a server 0.25-0.33 s each against 0.02 s after
        (bench/RESULTS.md). Made here, before the first push, the memory is
        what every group's first push would have allocated anyway.
        """
        numel = self.store.grad.numel()
        for g in range(self.book.num_groups):
            self._landing(g).receive_into(0, numel).zero_()

    def _landing(self, g: int) -> _Landing:
        """Where leader ``g``'s gradient lands: pushes of several groups may
        be in flight at once, so each group after the first has its own
        landing buffer, in the wire's type. On a compact wire every group's
        parts are widened into the shard's one float32 ``grad`` just before
        they are applied (the server applies one part at a time), so a
        group's own buffer costs 2 bytes per element, not 4."""
        store = self.store
        if g == 0:
            return _Landing(store.grad_wire, store.grad)
        if self.landings.get(g) is None:
            numel = store.grad.numel()
            if store.grad_wire.compact:
                own = _Landing(WireCodec(store.wire, numel, feedback=False), store.grad)
            else:
                own = _Landing(store.grad_wire, alloc(numel, store.grad.dtype))
            self.landings[g] = own
        return self.landings[g]

    def _reply(self, g: int, staleness: int, scale: float) -> P.Reply:
        """The reply header to leader ``g``, as things stand now."""
        version = self.store.version
        advice = 0.0 if self.advisor is None else self.advisor.advice(g)
        return P.Reply(
            version=version,
            stop=self.schedule.stop_flag(version) or self.nonfinite is not None,
            staleness=staleness,
            lr_scale=scale,
            checkpoint=self.schedule.requested,
            advice=advice,
            nonfinite=self.nonfinite,
        )

    def halt(self, g: int) -> None:
        """Group ``g``'s loss or gradient was not finite: stop every group.

        Nothing more is applied; server 0 lets every held reply go, since
        each carries the stop.
        """
        if self.nonfinite is not None:
            return
        self.nonfinite = g
        if self.server == 0:
            self.release_held(everyone=True)

    # --- server 0: holding, stopping ----------------------------------------------
    def release_held(self, everyone: bool = False) -> None:
        """Send the held replies that may go now (``everyone``: all)."""
        for held in self.book.release(everyone, self.schedule.pending):
            reply = self._reply(held.group, held.staleness, held.lr_scale)
            self.replies.send_whole(held.group, reply, predict=True)

    def stop(self) -> None:
        """Server 0: stop every group (after a checkpoint, if checkpointing)."""
        if self.schedule.request_stop():
            self.release_held(everyone=True)

    # --- snapshots ---------------------------------------------------------------
    def snapshot(self) -> None:
        """Save this server's part of the checkpoint the paused leaders reached."""
        number = self.schedule.snapshot_number()
        store, book = self.store, self.book
        if self.nonfinite is not None:  # no checkpoint of a halted run
            for g in self.schedule.record_skip():
                if g not in book.done:
                    self.listen(g)
            return
        state = {
            "checkpoint": number,
            "version": store.version,
            "updates_per_leader": list(book.updates),
            "done": sorted(book.done),
            "shard": store.state(),
        }
        for g in self.checkpoints.save(number, state, store.version):
            if g not in book.done:  # (at the end, every leader is done)
                self.listen(g)
        if self.server == 0 and self.schedule.stopping:
            # a stop that waited for this checkpoint is told now, with its own
            self.release_held(everyone=True)


def _forget(req: MPI.Request) -> None:
    """Cancel a receive from a dropped leader, leaving the request to MPI."""
    if req == MPI.REQUEST_NULL:
        return
    try:
        req.Cancel()
        req.Free()
    except MPI.Exception:
        pass  # (a dead peer's request may fail: nothing more to do with it)
