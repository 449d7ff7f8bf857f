"""The group leader's side of the parameter-server protocol (see ``server.py``)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from mpi4py import MPI

from ..comm import Comm, WireCodec, alloc
from ..runtime import envvars
from . import protocol as P
from .compensation import Compensation
from .flat import flatten_into, unflatten_from
from .shards import part_ranges, shard_ranges
from .spec import server_specs
from .streaming import StreamedPush, plan_stream

__all__ = ["PSClient", "RoundTrip", "check_part_tags", "part_elements"]


def part_elements(part_bytes: int | None, element_size: int) -> int:
    """Elements of a part of about ``part_bytes`` (default ``HYBRIDAGG_PS_PART_BYTES``).

    Raises:
        ValueError: The registry's value is not positive.
    """
    if part_bytes is None:  # (the default lives in the registry)
        part_bytes = envvars.get_int("HYBRIDAGG_PS_PART_BYTES")
        if part_bytes < 1:
            raise ValueError(
                f"HYBRIDAGG_PS_PART_BYTES must be positive, got {part_bytes}"
            )
    return max(1, int(part_bytes) // element_size)


def check_part_tags(ps: Comm, most: int) -> None:
    """Refuse ``most`` parts per server when their tags pass this MPI's limit.

    Raises:
        ValueError: Naming the limit and the fix.
    """
    tag_ub = ps.mpi.Get_attr(MPI.TAG_UB)
    if tag_ub is not None and P.part_tag(most) > tag_ub:
        raise ValueError(
            f"{most} parts per server need tags above this MPI's limit "
            f"({tag_ub}); raise HYBRIDAGG_PS_PART_BYTES"
        )


@dataclass
class RoundTrip:
    """A push-and-pull (or a pull) posted to the servers, not yet complete.

    Attributes:
        requests: Its sends and receives.
        replies: Each server's reply header, filled on completion.
        keep: Buffers that must outlive the requests.
    """

    requests: list
    replies: list[np.ndarray]
    keep: list


class PSClient:
    """A group leader's connection to the sharded parameter server.

    Owns the leader's flat copies of the model (weights, gradient, buffers),
    how they are cut into shards and parts, and the messages of the
    protocol: start-up, push, pull, checkpoint reports, done, final weights.

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
            leader; default ``HYBRIDAGG_PS_PART_BYTES``).
        skip_update: Servers return the weights without applying the
            optimizer (to benchmark the transport alone).
        batching: Adaptive batching on server 0: ``initial`` (each group's
            batch), ``deadband``, ``smoothing``, ``window``, ``min_batch``,
            ``max_group_batch``; ``None``: off.
        wire: The type the gradient is pushed in and the weights come back
            in (``fp32``, ``bf16``, ``fp16``): the leader rounds its group's
            gradient with error feedback (:mod:`hybridagg.comm.wire`); the
            final weights (``FINAL``) and the buffers stay exact.

    Raises:
        ValueError: The parameters have several dtypes, or (leader 0) one is
            in none of the optimizer's groups.
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
        wire: str = "fp32",
    ) -> None:
        self.ps, self.num_groups = ps, num_groups
        self.num_servers = ps.size - num_groups
        dtypes = {p.dtype for p in params}
        if len(dtypes) != 1:
            raise ValueError(
                f"the parameter server needs one parameter dtype, got {dtypes}"
            )
        self.params, self.buffers = params, buffers
        total = sum(p.numel() for p in params)
        self.ranges = shard_ranges(total, self.num_servers)
        self.part_elems = part_elements(part_bytes, params[0].element_size())
        # per server: its parts, as ranges of the flat model
        self.parts = [
            [(lo + a, lo + b) for a, b in part_ranges(hi - lo, self.part_elems)]
            for lo, hi in self.ranges
        ]
        check_part_tags(ps, max(len(p) for p in self.parts))
        dtype = params[0].dtype
        # (pinned for a model on a GPU: its copies to and from it are DMA)
        self.pinned = params[0].device.type == "cuda"
        self.flat_weights = alloc(total, dtype, zero=False, pinned=self.pinned)
        torch.cat([p.detach().reshape(-1).cpu() for p in params], out=self.flat_weights)
        self._flat_grad: torch.Tensor | None = None  # (only unstreamed pushes)
        self._plan: list | None = None
        # what the gradient is pushed in (rounded, with error feedback; a
        # streamed push rounds each part from bucket memory with the same
        # residual as an unstreamed one) and the weights are received in
        self.grad_wire = WireCodec(wire, total, feedback=True)
        self.weights_wire = WireCodec(wire, total, feedback=False)
        nbuf = sum(b.numel() for b in buffers)
        self.flat_buffers = (
            alloc(nbuf, torch.float64, pinned=self.pinned) if nbuf else None
        )
        self.versions = [0] * self.num_servers
        self.request_len = P.request_len(len(optimizer.param_groups))
        if ps.rank == 0:
            specs = server_specs(
                params,
                optimizer,
                self.flat_weights,
                self._pack_buffers() if buffers else None,
                self.ranges,
                compensation=compensation,
                staleness_bound=staleness_bound,
                max_updates=max_updates,
                part_elems=self.part_elems,
                skip_update=bool(skip_update),
                batching=batching,
                wire=wire,
            )
            pending = [
                ps.isend(spec, self._server(s), P.INIT) for s, spec in enumerate(specs)
            ]
            ps.wait([req for req, _ in pending], "parameter-server start-up")

    def prepare_flat_grad(self) -> None:
        """Make the flat gradient now (unstreamed pushes): made at the first
        push instead, its page faults fall inside that push."""
        self.flat_grad  # noqa: B018  (the property makes it)

    @property
    def flat_grad(self) -> torch.Tensor:
        """The flat gradient an unstreamed push is sent from (allocated at first use)."""
        if self._flat_grad is None:
            total = sum(p.numel() for p in self.params)
            self._flat_grad = alloc(total, self.params[0].dtype, pinned=self.pinned)
        return self._flat_grad

    def _server(self, s: int) -> int:
        return P.server_rank(self.num_groups, s)

    def _pack_buffers(self) -> torch.Tensor:
        return torch.cat([b.detach().reshape(-1).double().cpu() for b in self.buffers])

    # --- exchanges -------------------------------------------------------------
    def _post_replies(self) -> tuple[list, list[np.ndarray]]:
        reqs, replies = [], []
        for s in range(self.num_servers):
            head = np.zeros(P.REPLY_LEN, dtype=np.float64)
            reqs.append(self.ps.Irecv(head, self._server(s), P.REPLY_HDR))
            for i, (lo, hi) in enumerate(self.parts[s]):
                into = self.weights_wire.landing(self.flat_weights, lo, hi)
                reqs.append(self.ps.Irecv(into, self._server(s), P.part_tag(i)))
            replies.append(head)
        if self.flat_buffers is not None:
            reqs.append(self.ps.Irecv(self.flat_buffers, self._server(0), P.REPLY_BUF))
        return reqs, replies

    def _post_push(
        self,
        versions: list[int],
        samples: float,
        lrs: list[float],
        flags: int,
        seconds_per_sample: float,
    ) -> tuple[list, list[np.ndarray], list[np.ndarray]]:
        """Post the reply's receives and a push's header to every server.

        Returns the requests, the reply headers' buffers, and the sent
        headers (kept alive until their sends complete).
        """
        reqs, replies = self._post_replies()
        keep = []
        for s in range(self.num_servers):
            head = P.Request(
                P.PUSH, versions[s], samples, flags, seconds_per_sample, tuple(lrs)
            ).encode(self.request_len)
            keep.append(head)
            reqs.append(self.ps.Isend(head, self._server(s), P.HDR))
        return reqs, replies, keep

    def _post_to_all(self, request: P.Request) -> tuple[list, list[np.ndarray]]:
        """Post ``request`` to every server; returns the sends and their headers."""
        heads = [request.encode(self.request_len) for _ in range(self.num_servers)]
        reqs = [self.ps.Isend(h, self._server(s), P.HDR) for s, h in enumerate(heads)]
        return reqs, heads

    def _tell_all(self, request: P.Request, what: str) -> None:
        """Send ``request`` to every server and wait until it has left."""
        reqs, heads = self._post_to_all(request)
        self.ps.wait(reqs, what)
        del heads  # (the headers had to outlive their sends)

    def push(
        self,
        grads: list[torch.Tensor | None] | torch.Tensor,
        samples: float,
        lrs: list[float],
        versions: list[int],
        *,
        flags: int = 0,
        seconds_per_sample: float = 0.0,
    ) -> RoundTrip:
        """Post a push of the group gradient and the pull of fresh weights.

        Args:
            grads: The group-averaged gradient of each parameter (``None``:
                zero), or ``self.flat_grad`` itself, already filled.
            samples: The group's samples in this update.
            lrs: Current ``lr`` of each of the user's parameter groups.
            versions: Per shard, the version the gradient was computed from.
            flags: :data:`~hybridagg.ps.protocol.FLAG_STOP` to stop every group.
            seconds_per_sample: The group's compute time per sample
                (adaptive batching; 0: none).
        """
        if grads is not self.flat_grad:  # else the caller filled it in place
            flatten_into(self.flat_grad, grads, like=self.params)
        reqs, replies, keep = self._post_push(
            versions, samples, lrs, flags, seconds_per_sample
        )
        for s in range(self.num_servers):
            for i, (lo, hi) in enumerate(self.parts[s]):
                part = self.grad_wire.encode(self.flat_grad, lo, hi)
                reqs.append(self.ps.Isend(part, self._server(s), P.part_tag(i)))
        if self.flat_buffers is not None:
            packed = self._pack_buffers()
            keep.append(packed)
            reqs.append(self.ps.Isend(packed, self._server(0), P.BUF))
        return RoundTrip(reqs, replies, keep)

    def stream(
        self,
        buckets: list[tuple[int, int]],
        samples: float,
        lrs: list[float],
        versions: list[int],
        *,
        flags: int = 0,
        seconds_per_sample: float = 0.0,
    ) -> StreamedPush:
        """Begin a push streamed bucket by bucket (:mod:`hybridagg.ps.streaming`).

        Posts the receives of the reply and the request header to every
        server; the caller then hands each final bucket to
        :meth:`StreamedPush.send` and ends with :meth:`end_stream`.

        Args:
            buckets: Each bucket's range of the flat model, in the order the
                buckets become final (the same on every push).
            samples: The group's samples in this update.
            lrs: Current ``lr`` of each of the user's parameter groups.
            versions: Per shard, the version the gradient was computed from.
            flags: :data:`~hybridagg.ps.protocol.FLAG_STOP` to stop every group.
            seconds_per_sample: The group's compute time per sample.
        """
        if self._plan is None or self._plan[0] != buckets:
            self._plan = (list(buckets), plan_stream(self.parts, list(buckets)))
        reqs, replies, keep = self._post_push(
            versions, samples, lrs, flags, seconds_per_sample
        )
        servers = [self._server(s) for s in range(self.num_servers)]
        push = StreamedPush(
            self.ps, servers, self._plan[1], reqs, keep, codec=self.grad_wire
        )
        push.replies = replies
        return push

    def end_stream(self, push: StreamedPush, cut: bool = False) -> RoundTrip:
        """Send what is left of a streamed push (``cut``: nothing more is applied).

        Without ``cut`` every bucket must have been sent; with it, the parts
        not sent go with length 0 and the servers apply none of them.
        """
        if cut:
            push.cut()
        elif not push.sent_all:
            raise ValueError(f"the push ended before bucket {push.next} was sent")
        buffers = self._pack_buffers() if self.flat_buffers is not None else None
        reqs = push.finish(buffers, cut=cut)
        return RoundTrip(reqs, push.replies, push.keep)

    def pull(self) -> RoundTrip:
        """Post a pull of the current weights without an update."""
        reqs, replies = self._post_replies()
        sends, keep = self._post_to_all(P.Request(P.PULL))
        return RoundTrip(reqs + sends, replies, keep)

    def complete(self, trip: RoundTrip) -> dict:
        """Wait for a round trip; ``flat_weights`` then holds the servers' weights.

        Returns:
            ``versions`` per shard, ``stop``, max ``staleness``, and from
            server 0 ``lr_scale``, the requested ``checkpoint`` and
            ``advice``; ``nonfinite``: the group whose NaN or infinity made
            a server stop every group (``None``: none).
        """
        self.ps.wait(trip.requests, "push/pull with the parameter servers")
        if self.weights_wire.compact:
            for parts in self.parts:
                for lo, hi in parts:
                    self.weights_wire.decode(self.flat_weights, lo, hi)
        replies = [P.Reply.decode(h) for h in trip.replies]
        self.versions = [r.version for r in replies]
        first = replies[0]
        return {
            "versions": list(self.versions),
            "stop": any(r.stop for r in replies),
            "staleness": max(r.staleness for r in replies),
            "lr_scale": first.lr_scale,
            "checkpoint": first.checkpoint,
            "advice": first.advice,
            "nonfinite": next(
                (r.nonfinite for r in replies if r.nonfinite is not None), None
            ),
        }

    def checkpointed(self, number: int) -> None:
        """Tell every server this group has saved its part of checkpoint ``number``."""
        self._tell_all(
            P.Request(P.CKPT, number),
            f"checkpoint {number} report to the parameter servers",
        )

    def unpack_into_model(self) -> None:
        """Copy ``flat_weights`` (and buffers) into the model's tensors."""
        unflatten_from(self.flat_weights, self.params)
        if self.flat_buffers is not None:
            unflatten_from(self.flat_buffers, self.buffers)

    def done(self, nonfinite: int | None = None) -> None:
        """Tell every server this leader is finished.

        Args:
            nonfinite: The group whose loss or gradient was not finite (this
                one, or another the servers told of): every server then
                stops every group and ends with that reason.
        """
        request = (
            P.Request(P.DONE)
            if nonfinite is None
            else P.Request(P.DONE, nonfinite, flags=P.FLAG_NONFINITE)
        )
        self._tell_all(request, "done message to the parameter servers")

    def lost(self, dead_rank: int) -> None:
        """Tell every server this leader's group lost a member and leaves.

        Args:
            dead_rank: The world rank found dead (-1: unknown).
        """
        self._tell_all(
            P.Request(P.LOST, int(dead_rank)),
            "lost-group message to the parameter servers",
        )

    def receive_final(self, timeout: float | None = None) -> int:
        """On leader 0: receive every server's final shard; returns the version."""
        reqs, heads = [], []
        for s in range(self.num_servers):
            head = np.zeros(1, dtype=np.float64)
            heads.append(head)
            reqs.append(self.ps.Irecv(head, self._server(s), P.FINAL))
            for lo, hi in self.parts[s]:
                reqs.append(
                    self.ps.Irecv(self.flat_weights[lo:hi], self._server(s), P.FINAL)
                )
        if self.flat_buffers is not None:
            reqs.append(self.ps.Irecv(self.flat_buffers, self._server(0), P.FINAL))
        self.ps.wait(reqs, "final weights from the parameter servers", timeout)
        return int(max(h[0] for h in heads))
