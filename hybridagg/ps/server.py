"""The parameter-server rank: holds a shard of the model and its optimizer state.

Wire protocol, on a communicator of the group leaders followed by the servers
(leader ``g`` is rank ``g``, server ``s`` is rank ``G + s``). Headers are
float64 vectors (:mod:`hybridagg.ps.protocol`).

* ``INIT`` (leader 0 -> each server, pickled once at start): optimizer class
  and hyperparameters per parameter group, parameter sizes and group
  membership, this server's initial shard and (server 0) the buffers, the
  compensation settings, the staleness bound, the update budget and the
  part size.
* ``PUSH`` (leader -> every server): a header, then the gradient shard in
  *parts* of at most ``part_bytes`` (default 4 MiB, like BytePS's tensor
  partitions), and to server 0 the group's buffers. The server scales each
  group's ``lr`` by :class:`~hybridagg.ps.compensation.Compensation`, and for
  each part, as soon as it has arrived, applies the user's optimizer to it
  and sends the updated part back, so receiving, updating and replying
  overlap. The reply header carries ``[version, stop, staleness, lr_scale,
  checkpoint, advice]``. The leader forwards its current learning rates with
  every push, which is how an LR scheduler stepped on the workers keeps
  working.
* ``PULL``: the same reply without an update (validation, resume).
* ``CKPT c``: the leader's group has saved its part of checkpoint ``c``;
  the server handles nothing more from that leader until every running
  leader has done the same, then saves its own part (so the snapshot holds
  exactly the pushes sent before each leader's ``CKPT``: one consistent cut,
  although the groups run asynchronously) and continues.
* ``DONE``: that leader finished. When every leader is done, the servers
  send their shards (``FINAL``) to leader 0 and return.

Checkpoints are requested by server 0 (every ``checkpoint_every`` versions,
when a leader or server 0 itself asks, e.g. on SIGTERM, and at the update
budget) through the ``checkpoint`` field of its replies; the other servers
report to server 0 when they have saved, and server 0 commits.

Bounded staleness (SSP, ``staleness_bound = s``): server 0 holds the reply to
a leader that is more than ``s`` of its own updates ahead of the slowest
group still running, and releases it when that group catches up; the leader
waits for server 0's reply, so it cannot run further ahead. The unit is a
group's own updates; while one gradient is in flight the other ``G - 1``
groups can apply at most about ``s + 1`` updates each, so the version
staleness an update sees is at most about ``(G - 1)(s + 1)``. A checkpoint
request releases held replies (the held group must reach the snapshot), so
around a checkpoint a group may get one update further ahead.

Every wait polls (:func:`hybridagg.comm.wait_until`), so an idle server costs a
small fraction of a core. Waiting for the next message, it sleeps at most
``HYBRIDAGG_SERVER_MAX_SLEEP_US`` (500 us) between polls instead of the
general 2 ms cap: a push that arrives while the server sleeps waits for it,
and that delay adds to the round trip of every group's step.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
from mpi4py import MPI

from ..batching import BatchController
from ..comm import alloc
from ..runtime import envvars
from . import protocol as P
from .compensation import Compensation, lookahead_factor
from .shards import part_ranges, pieces_of

__all__ = ["ServerStats", "serve", "server_max_sleep"]

# weight of the newest staleness in a group's running mean (lookahead)
_TAU_WEIGHT = 0.3


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
    """What one server did."""

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


class _Shard:
    """One server's shard: weights, and the user's optimizer over each part."""

    def __init__(self, spec: dict) -> None:
        initial = torch.as_tensor(np.asarray(spec["shard"]))
        self.flat = alloc(initial.numel(), initial.dtype, zero=False)
        self.flat.copy_(initial)
        self.grad = alloc(initial.numel(), initial.dtype)
        lo, hi = spec["range"]
        self.parts = part_ranges(hi - lo, spec["part_elems"])
        cls = spec["optimizer"]
        self.optimizers: list[tuple[torch.optim.Optimizer, list[int]] | None] = []
        for a, b in self.parts:
            by_group: dict[int, list[torch.nn.Parameter]] = {}
            for piece in pieces_of(spec["numels"], lo + a, lo + b):
                start = a + piece.offset
                param = torch.nn.Parameter(self.flat[start : start + piece.numel])
                param.grad = self.grad[start : start + piece.numel]
                by_group.setdefault(spec["group_of"][piece.param], []).append(param)
            groups = sorted(by_group)
            if not groups:
                self.optimizers.append(None)
                continue
            hyper = [{**spec["hyper"][g], "params": by_group[g]} for g in groups]
            self.optimizers.append((cls(hyper, **spec["defaults"]), groups))
        self.buffers = (
            torch.as_tensor(np.asarray(spec["buffers"])).clone()
            if spec.get("buffers") is not None
            else None
        )
        self.skip_update = bool(spec.get("skip_update", False))

    def apply(self, part: int, lrs: list[float], scale: float) -> None:
        entry = self.optimizers[part]
        if entry is None or self.skip_update:
            return
        opt, groups = entry
        for group, user_group in zip(opt.param_groups, groups, strict=True):
            group["lr"] = lrs[user_group] * scale
        opt.step()

    def predict(
        self, part: int, out: torch.Tensor, lrs: list[float], staleness: float
    ) -> None:
        """Move ``out``, part ``part``'s weights, along ``staleness`` updates of momentum."""
        entry = self.optimizers[part]
        if entry is None or self.skip_update:
            return
        opt, groups = entry
        lo = self.parts[part][0]
        size = self.flat.element_size()
        base = self.flat.data_ptr()
        for group, user_group in zip(opt.param_groups, groups, strict=True):
            momentum = float(group.get("momentum", 0.0) or 0.0)
            if momentum <= 0.0 or momentum >= 1.0:
                continue
            alpha = lrs[user_group] * lookahead_factor(momentum, staleness)
            for param in group["params"]:
                buf = opt.state.get(param, {}).get("momentum_buffer")
                if buf is None:
                    continue
                start = (param.data_ptr() - base) // size - lo
                out[start : start + param.numel()].sub_(buf.reshape(-1), alpha=alpha)

    def state(self) -> dict:
        return {
            "flat": self.flat.clone(),
            "buffers": None if self.buffers is None else self.buffers.clone(),
            "optimizers": [
                None if e is None else e[0].state_dict() for e in self.optimizers
            ],
        }

    def load(self, state: dict) -> None:
        if state["flat"].shape != self.flat.shape:
            raise ValueError(
                f"checkpointed shard has {state['flat'].numel()} elements, this "
                f"server's shard {self.flat.numel()} (another model or server count?)"
            )
        self.flat.copy_(state["flat"])
        if self.buffers is not None and state.get("buffers") is not None:
            self.buffers.copy_(state["buffers"])
        saved = state["optimizers"]
        if len(saved) != len(self.optimizers):
            raise ValueError("checkpointed shard was cut into other parts")
        for entry, sd in zip(self.optimizers, saved, strict=True):
            if entry is not None and sd is not None:
                entry[0].load_state_dict(sd)


class _Server:
    """The state machine of one server rank (see the module docstring)."""

    def __init__(
        self,
        topology,
        timeout,
        checkpoint_every,
        on_snapshot,
        on_commit,
        stop_requested,
        restore,
        on_batch=None,
    ) -> None:
        self.on_batch = on_batch
        self.ps = topology.comms.leaders.dup("ps")
        self.G = topology.num_groups
        self.K = self.ps.size - self.G
        self.me = self.ps.rank - self.G
        spec = self.ps.recv(0, P.INIT, what="parameter-server start-up from rank 0")
        self.shard = _Shard(spec)
        self.comp: Compensation = spec["compensation"]
        self.lookahead = self.comp.lookahead
        horizon = self.comp.lookahead_horizon
        self.horizon = float(self.G) if horizon is None else horizon
        # running mean of each group's staleness, and the undamped rates of
        # its updates: what the lookahead of a reply to it is computed from
        self.tau = [float(self.G - 1)] * self.G
        self.pred_lrs: list[list[float] | None] = [None] * self.G
        self.bound: int | None = spec["staleness_bound"]
        self.budget: int | None = spec["max_updates"]
        self.hlen = P.request_len(len(spec["hyper"]))
        self.stats = ServerStats(server=self.me, updates_per_leader=[0] * self.G)
        self.version = 0
        if restore is not None:
            self.shard.load(restore["shard"])
            self.version = int(restore["version"])
            self.stats.updates_per_leader = list(restore["updates_per_leader"])
        self.timeout = self.ps.timeout if timeout is None else timeout
        self.max_sleep = server_max_sleep()
        self._setup_batching(spec.get("batching"))
        self.every, self.on_snapshot, self.on_commit = (
            checkpoint_every,
            on_snapshot,
            on_commit,
        )
        self.stop_requested = stop_requested
        self.next_ckpt_version = (
            (self.version // checkpoint_every + 1) * checkpoint_every
            if checkpoint_every
            else None
        )
        self.requested = int(restore["checkpoint"]) if restore is not None else 0
        self.saved = self.requested  # last checkpoint this server saved
        self.saved_version = self.version
        self.committed = self.requested
        self.paused: dict[int, int] = {}
        self.written: dict[int, set[int]] = {}
        self.headers = [np.zeros(self.hlen, dtype=np.float64) for _ in range(self.G)]
        self.hreqs = [
            self.ps.mpi.Irecv(self.headers[g], g, P.HDR) for g in range(self.G)
        ]
        self.reply_h = [np.zeros(P.REPLY_LEN, dtype=np.float64) for _ in range(self.G)]
        # With one group and no lookahead, replies are sent from the shard
        # itself (no copy); before the shard changes, the reply in flight is
        # completed (the leader posted its receives before pushing, so this
        # is quick). With several, each group's reply is sent from a copy of
        # its own: a large reply completes only inside the receiving leader's
        # MPI calls, and a leader that overlaps its exchange with compute
        # makes none for a whole step, so waiting for it would pace every
        # other group to it.
        self.sends: list[list[MPI.Request]] = [[] for _ in range(self.G)]
        self.copies: list[tuple[torch.Tensor, torch.Tensor | None] | None] = [
            None
        ] * self.G
        self.held: dict[int, tuple[int, float]] = {}
        self.done: set[int] = set()
        self.stopping = False
        self.wreqs: list[tuple[MPI.Request, np.ndarray]] = []
        if self.me == 0:
            for s in range(1, self.K):
                buf = np.zeros(1, dtype=np.float64)
                self.wreqs.append((self.ps.mpi.Irecv(buf, self.G + s, P.WRITTEN), buf))

    def _setup_batching(self, options: dict | None) -> None:
        """Server 0 sizes each group's batch from the times leaders report."""
        self.batcher, self.assigned, self.pushes = None, None, 0
        if options is None or self.me != 0:
            return
        self.batcher = BatchController(
            batches=options["initial"],
            deadband=options["deadband"],
            smoothing=options["smoothing"],
            window=1,
            min_batch=options["min_batch"],
            max_batch=options.get("max_group_batch"),
        )
        self.batch_window = max(1, int(options["window"])) * self.G
        first = options.get("first_window") or options["window"]
        self.first_batch_window = max(1, int(first)) * self.G
        self.assigned = list(self.batcher.batches)

    def _observe_batch(self, g: int, seconds_per_sample: float, samples: float) -> None:
        if self.batcher is None or seconds_per_sample <= 0 or samples <= 0:
            return
        self.batcher.add(g, seconds_per_sample * samples, samples)
        self.pushes += 1
        unknown = any(e is None for e in self.batcher.estimate)
        if self.pushes < (self.first_batch_window if unknown else self.batch_window):
            return
        self.pushes = 0
        decision = self.batcher.decide()
        if decision is not None:
            self.assigned = list(decision.new)
            self.stats.batch_decisions.append(
                (self.version, decision.old, decision.new, decision.seconds_per_sample)
            )
            if self.on_batch is not None:
                self.on_batch(self.version, decision)

    # --- replies -------------------------------------------------------------
    def _stop_flag(self) -> float:
        over = self.budget is not None and self.version >= self.budget
        return 1.0 if over or self.stopping else 0.0

    def _head(self, g: int, staleness: int, scale: float) -> np.ndarray:
        self.ps.wait(self.sends[g], f"previous reply to leader {g}")
        h = self.reply_h[g]
        advice = float(self.assigned[g]) if self.assigned is not None else 0.0
        h[:] = (
            self.version,
            self._stop_flag(),
            staleness,
            scale,
            self.requested,
            advice,
        )
        return h

    def _predicting(self, g: int) -> bool:
        tau = self.tau[g]
        return (
            self.lookahead and self.pred_lrs[g] is not None and 0 < tau <= self.horizon
        )

    def _reply_from(
        self,
        g: int,
        a: int | None = None,
        b: int | None = None,
        part: int | None = None,
    ) -> torch.Tensor:
        """The memory a reply to ``g`` sends weights ``[a, b)`` (None: buffers) from.

        Call after :meth:`_head` (which completes ``g``'s previous reply).
        With ``part`` given and the lookahead on, the weights of that part are
        the ones expected when ``g``'s next gradient is applied.
        """
        shard = self.shard
        src = shard.buffers if a is None else shard.flat[a:b]
        predict = part is not None and self._predicting(g)
        if self.G == 1 and not predict:
            return src
        if self.copies[g] is None:
            bufs = None if shard.buffers is None else shard.buffers.clone()
            self.copies[g] = (alloc(shard.flat.numel(), shard.flat.dtype), bufs)
        weights, bufs = self.copies[g]
        out = bufs if a is None else weights[a:b]
        out.copy_(src)
        if predict:
            shard.predict(part, out, self.pred_lrs[g], self.tau[g])
        return out

    def reply_whole(
        self, g: int, staleness: int, scale: float, predict: bool = False
    ) -> None:
        """Send ``g`` the header and every part (``predict``: an answer to a push)."""
        reqs = [self.ps.mpi.Isend(self._head(g, staleness, scale), g, P.REPLY_HDR)]
        for i, (a, b) in enumerate(self.shard.parts):
            src = self._reply_from(g, a, b, i if predict else None)
            reqs.append(self.ps.Isend(src, g, P.REPLY_W))
        if self.shard.buffers is not None:
            reqs.append(self.ps.Isend(self._reply_from(g), g, P.REPLY_BUF))
        self.sends[g] = reqs

    def too_far_ahead(self, g: int) -> bool:
        if self.me != 0 or self.bound is None or self.requested > self.saved:
            return False
        counts = self.stats.updates_per_leader
        running = [counts[h] for h in range(self.G) if h not in self.done]
        return bool(running) and counts[g] - min(running) > self.bound

    def release_held(self, everyone: bool = False) -> None:
        for g in sorted(self.held):
            if everyone or not self.too_far_ahead(g):
                staleness, scale = self.held.pop(g)
                self.reply_whole(g, staleness, scale, predict=True)

    # --- messages --------------------------------------------------------------
    def push(self, g: int, header: np.ndarray) -> None:
        ps, shard = self.ps, self.shard
        version_from, samples = int(header[1]), float(header[2])
        if int(header[3]) & P.FLAG_STOP and self.me == 0:
            self.request_stop()
        self._observe_batch(g, float(header[4]), float(header[2]))
        staleness = self.version - version_from
        scale = self.comp.scale(samples, self.version, staleness)
        lrs = header[P.REQUEST_FIELDS :].tolist()
        if self.lookahead:
            self.tau[g] += _TAU_WEIGHT * (staleness - self.tau[g])
            undamped = self.comp.scale(samples, self.version, 0)
            self.pred_lrs[g] = [lr * undamped for lr in lrs]
        grads = [ps.Irecv(shard.grad[a:b], g, P.GRAD) for a, b in shard.parts]
        incoming = None
        if shard.buffers is not None:
            incoming = torch.empty_like(shard.buffers)
            grads.append(ps.Irecv(incoming, g, P.BUF))
        if self.G == 1:  # replies are sent from the shard itself
            ps.wait(self.sends[0], "reply in flight")
        self.version += 1
        self.stats.updates_per_leader[g] += 1
        self.stats.max_staleness = max(self.stats.max_staleness, staleness)
        if self.me == 0:
            self.maybe_request()
        hold = self.too_far_ahead(g)
        reqs = (
            []
            if hold
            else [ps.mpi.Isend(self._head(g, staleness, scale), g, P.REPLY_HDR)]
        )
        applied = 0.0
        for i, (a, b) in enumerate(shard.parts):
            ps.wait_for(grads[i].Test, f"gradient part {i} from leader {g}")
            t0 = time.perf_counter()
            shard.apply(i, lrs, scale)
            applied += time.perf_counter() - t0
            if not hold:
                reqs.append(ps.Isend(self._reply_from(g, a, b, i), g, P.REPLY_W))
        if incoming is not None:
            ps.wait(grads[-1], f"buffers from leader {g}")
            shard.buffers.copy_(incoming)
            if not hold:
                reqs.append(ps.Isend(self._reply_from(g), g, P.REPLY_BUF))
        self.sends[g] = reqs
        self.stats.apply_seconds += applied
        if len(self.stats.apply_times) < 10_000:
            self.stats.apply_times.append(applied)
        if hold:
            self.held[g] = (staleness, scale)
            self.stats.held += 1
        if self.me == 0:
            self.release_held()

    def maybe_request(self) -> None:
        """Server 0: ask for a checkpoint when one is due."""
        if self.on_snapshot is None:
            return
        due = (
            self.next_ckpt_version is not None
            and self.version >= self.next_ckpt_version
        )
        at_budget = self.budget is not None and self.version == self.budget
        if (due or at_budget) and self.requested == self.saved:
            self.requested += 1
            while self.every and self.next_ckpt_version <= self.version:
                self.next_ckpt_version += self.every
            self.release_held(everyone=True)

    def request_stop(self) -> None:
        """Server 0: stop every group (after a checkpoint, if checkpointing)."""
        if self.stopping:
            return
        self.stopping = True
        if self.on_snapshot is not None and self.requested == self.saved:
            self.requested += 1
        self.release_held(everyone=True)

    def checkpoint_ready(self) -> bool:
        pending = max(self.paused.values(), default=0)
        if not pending:
            return False
        return all(
            g in self.done or self.paused.get(g) == pending for g in range(self.G)
        )

    def snapshot(self) -> None:
        c = max(self.paused.values())
        state = {
            "checkpoint": c,
            "version": self.version,
            "updates_per_leader": list(self.stats.updates_per_leader),
            "done": sorted(self.done),
            "shard": self.shard.state(),
        }
        self.on_snapshot(c, state)
        self.saved_version = self.version
        self.saved = max(self.saved, c)
        self.requested = max(self.requested, c)
        self.stats.checkpoints += 1
        if self.me == 0:
            self.written.setdefault(c, set()).add(0)
        else:
            msg = np.array([c], dtype=np.float64)
            self.ps.wait(self.ps.mpi.Isend(msg, self.G, P.WRITTEN), "checkpoint report")
        for g in list(self.paused):
            del self.paused[g]
            self.hreqs[g] = self.ps.mpi.Irecv(self.headers[g], g, P.HDR)

    def poll_written(self) -> None:
        """Server 0: commit every checkpoint all servers have saved."""
        for i, (req, buf) in enumerate(self.wreqs):
            if req.Test():
                self.written.setdefault(int(buf[0]), set()).add(i + 1)
                self.wreqs[i] = (self.ps.mpi.Irecv(buf, self.G + i + 1, P.WRITTEN), buf)
        for c in sorted(self.written):
            if len(self.written[c]) == self.K and c > self.committed:
                self.on_commit(c)
                self.committed = c
                del self.written[c]

    def handle(self, g: int) -> None:
        header = self.headers[g]
        kind = header[0]
        if kind == P.PUSH:
            self.push(g, header)
            self.hreqs[g] = self.ps.mpi.Irecv(self.headers[g], g, P.HDR)
        elif kind == P.PULL:
            self.stats.pulls += 1
            self.reply_whole(g, 0, 0.0)
            self.hreqs[g] = self.ps.mpi.Irecv(self.headers[g], g, P.HDR)
        elif kind == P.CKPT:
            self.paused[g] = int(header[1])
            self.hreqs[g] = MPI.REQUEST_NULL
        elif kind == P.DONE:
            self.done.add(g)
            self.hreqs[g] = MPI.REQUEST_NULL
            if self.me == 0:
                self.release_held()
        else:
            raise RuntimeError(
                f"server {self.me}: unknown message kind {kind} from leader {g}"
            )

    # --- the loop ------------------------------------------------------------------
    def run(self) -> ServerStats:
        box: dict[str, int] = {}

        def event() -> bool:
            if self.me == 0:
                if self.stop_requested is not None and self.stop_requested():
                    self.request_stop()
                if self.wreqs or self.on_commit is not None:
                    self.poll_written()
            if self.checkpoint_ready():
                box["g"] = -1
                return True
            index = MPI.Request.Testany(self.hreqs)[0]
            if index != MPI.UNDEFINED:
                box["g"] = index
                return True
            return len(self.done) == self.G

        while len(self.done) < self.G:
            self.ps.wait_for(
                event,
                "next message from a group leader",
                self.timeout,
                max_sleep=self.max_sleep,
            )
            start = time.perf_counter()
            g = box.pop("g", None)
            if g == -1:
                self.snapshot()
            elif g is not None:
                self.handle(g)
            self.stats.busy_seconds += time.perf_counter() - start
        return self.finish()

    def finish(self) -> ServerStats:
        ps, shard = self.ps, self.shard
        for g in range(self.G):
            ps.wait(self.sends[g], f"last reply to leader {g}")
        if self.on_snapshot is not None and self.version != self.saved_version:
            # every server processed the same pushes and CKPTs, so all agree
            # on this final checkpoint's number and on whether it is needed
            self.paused = {g: self.saved + 1 for g in range(self.G)}
            self.snapshot()
        if self.me == 0 and self.on_commit is not None:
            ps.wait_for(
                lambda: (self.poll_written(), self.committed >= self.saved)[1],
                "checkpoint reports from the other servers",
            )
        for req, _ in self.wreqs:
            req.Cancel()
        final = [
            ps.mpi.Isend(np.array([self.version], dtype=np.float64), 0, P.FINAL),
            *(ps.Isend(shard.flat[a:b], 0, P.FINAL) for a, b in shard.parts),
        ]
        if shard.buffers is not None:
            final.append(ps.Isend(shard.buffers, 0, P.FINAL))
        ps.wait(final, "final weights to rank 0")
        for req, _ in self.wreqs:
            ps.wait(req, "cancelled checkpoint report")
        self.stats.version = self.version
        ps.free()
        return self.stats


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
        on_ready: Called once the server holds its shard, before it serves
            (the training driver starts its clock there).
        on_batch: Server 0 with adaptive batching: ``f(version, decision)``
            for every change of the groups' batch sizes.

    Returns:
        This server's statistics.

    Raises:
        ValueError: This rank is not a server, or ``restore`` does not fit.
    """
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
    )
    if on_ready is not None:
        on_ready()
    return server.run()
