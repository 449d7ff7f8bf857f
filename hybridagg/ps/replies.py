"""A server's replies to the leaders: headers, weights, buffers, in flight.

With one group and no lookahead, replies are sent from the shard itself (no
copy); before the shard changes, the reply in flight is completed (the
leader posted its receives before pushing, so this is quick). With several,
each group's reply is sent from a copy of its own: a large reply completes
only inside the receiving leader's MPI calls, and a leader that overlaps
its exchange with compute makes none for a whole step, so waiting for it
would pace every other group to it.

On a compact wire (``bf16``, ``fp16``) every weights reply is rounded from
the float32 master (or the lookahead's copy of it) into a compact copy of
the group's own, which the reply is sent from: the master never leaves the
server, so rounding never accumulates in the model.
"""

from __future__ import annotations

import numpy as np
import torch
from mpi4py import MPI

from ..comm import Comm, WireCodec, alloc
from . import protocol as P
from .failures import leader_lost
from .lookahead import Lookahead
from .store import ShardStore

__all__ = ["ReplySender"]


class ReplySender:
    """The replies of one server to each leader, and the memory they are sent from.

    Args:
        ps: The leaders-and-servers communicator (leader ``g`` is rank ``g``).
        num_groups: Number of groups ``G``.
        store: The server's shard.
        lookahead: Decides which replies to a push are predictions.
        drop_lost: A failed reply raises
            :class:`~hybridagg.ps.failures.LeaderLost` (the group is then
            dropped) instead of the MPI error.
    """

    def __init__(
        self,
        ps: Comm,
        num_groups: int,
        store: ShardStore,
        lookahead: Lookahead,
        drop_lost: bool = False,
    ) -> None:
        self.ps, self.num_groups, self.drop_lost = ps, num_groups, drop_lost
        self.store, self.lookahead = store, lookahead
        self.headers = [
            np.zeros(P.REPLY_LEN, dtype=np.float64) for _ in range(num_groups)
        ]
        self.in_flight: list[list[MPI.Request]] = [[] for _ in range(num_groups)]
        # per group: a copy of the weights and of the buffers to reply from
        self.copies: list[tuple[torch.Tensor, torch.Tensor | None] | None] = [
            None
        ] * num_groups
        # per group: the compact copy a reply's weights are sent from
        self.wires: list[WireCodec | None] = [None] * num_groups

    def header(self, g: int, reply: P.Reply) -> MPI.Request:
        """Post the reply header to ``g``, once its previous reply has completed."""
        self._complete(g, f"previous reply to leader {g}")
        return self.ps.Isend(reply.encode_into(self.headers[g]), g, P.REPLY_HDR)

    def weights(self, g: int, part: int, predict: bool) -> MPI.Request:
        """Post part ``part`` of the weights to ``g`` (after :meth:`header`).

        ``predict``: the reply answers a push, so it may be a prediction.
        """
        a, b = self.store.parts[part]
        source = self._source(g, a, b, part if predict else None)
        if self.store.grad_wire.compact:
            wire = self.wires[g]
            if wire is None:
                numel = self.store.flat.numel()
                wire = WireCodec(self.store.wire, numel, feedback=False)
                self.wires[g] = wire
            wire.buffer[a:b].copy_(source)  # rounded to nearest
            source = wire.landing(self.store.flat, a, b)
        return self.ps.Isend(source, self.store.owners.of(g, part), P.part_tag(part))

    def buffers(self, g: int) -> MPI.Request:
        """Post the buffers to ``g`` (server 0, after :meth:`header`)."""
        return self.ps.Isend(self._source(g), g, P.REPLY_BUF)

    def track(self, g: int, requests: list[MPI.Request]) -> None:
        """``requests`` are now the reply to ``g`` in flight."""
        self.in_flight[g] = requests

    def send_whole(self, g: int, reply: P.Reply, predict: bool = False) -> None:
        """Send ``g`` the header and every part (``predict``: an answer to a push)."""
        reqs = [self.header(g, reply)]
        reqs += [self.weights(g, i, predict) for i in range(len(self.store.parts))]
        if self.store.buffers is not None:
            reqs.append(self.buffers(g))
        self.track(g, reqs)

    def before_update(self) -> None:
        """Complete a reply sent from the shard itself before the shard changes."""
        if self.num_groups == 1:
            self._complete(0, "reply in flight")

    def wait_all(self) -> None:
        """Complete every reply (at the end); replies to dropped groups are forgotten."""
        for g in range(self.num_groups):
            self._complete(g, f"last reply to leader {g}")

    def drop(self, g: int) -> None:
        """Forget the replies to ``g`` (its group was dropped: nobody receives them).

        Their requests are left to MPI: to a dead leader they fail, to a
        live one that left they are small and complete on their own.
        """
        self.in_flight[g] = []

    def prepare(self) -> None:
        """Make every group's reply copy now, its pages touched (see
        :meth:`RequestHandler.prepare <hybridagg.ps.handler.RequestHandler.prepare>`).
        A lone group replies from the shard itself unless the lookahead
        predicts its weights."""
        if self.num_groups > 1 or self.lookahead.enabled:
            for g in range(self.num_groups):
                self._copy(g)[0].zero_()

    def _copy(self, g: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``g``'s copy of the weights and buffers to reply from (made at first use)."""
        if self.copies[g] is None:
            store = self.store
            bufs = None if store.buffers is None else store.buffers.clone()
            self.copies[g] = (alloc(store.flat.numel(), store.flat.dtype), bufs)
        return self.copies[g]

    def _complete(self, g: int, what: str) -> None:
        try:
            self.ps.wait(self.in_flight[g], what)
        except MPI.Exception as exc:
            if not self.drop_lost:
                raise
            lost = leader_lost(self.ps, g, exc)
            self.in_flight[g] = []
            raise lost from exc

    def _source(
        self,
        g: int,
        a: int | None = None,
        b: int | None = None,
        part: int | None = None,
    ) -> torch.Tensor:
        """The memory a reply to ``g`` sends weights ``[a, b)`` (None: buffers) from.

        Call after :meth:`header` (which completes ``g``'s previous reply).
        With ``part`` given and the lookahead on, the weights of that part are
        the ones expected when ``g``'s next gradient is applied.
        """
        store = self.store
        src = store.buffers if a is None else store.flat[a:b]
        predict = part is not None and self.lookahead.predicts(g)
        if self.num_groups == 1 and not predict:
            return src
        weights, bufs = self._copy(g)
        out = bufs if a is None else weights[a:b]
        out.copy_(src)
        if predict:
            la = self.lookahead
            store.predict(part, out, la.rates[g], la.tau[g])
        return out
