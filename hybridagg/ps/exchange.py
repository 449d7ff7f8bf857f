"""What a worker does after its group's reduction in ``hybrid`` and ``async`` modes.

The leader pushes the group gradient to the servers and pulls fresh weights
(:class:`~hybridagg.ps.client.PSClient`), then broadcasts them in its group
with a small header (:mod:`hybridagg.ps.groupweights`). Streamed
(``stream=True``), the push leaves bucket by bucket while the group's
reduction completes (:mod:`hybridagg.ps.streaming`). With
``overlap=True`` the leader posts the exchange and lets the group compute
the next step on the weights it has; the reply is applied one step later,
so each gradient is at least one version stale (counted as staleness).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..comm import all_finite, alloc
from ..topology import Topology
from .client import PSClient, RoundTrip
from .compensation import Compensation
from .groupweights import GroupHeader, GroupWeights
from .streaming import StreamedPush

__all__ = ["ExchangeOptions", "GroupExchange", "group_name", "streams"]


def group_name(topology: Topology, g: int) -> str:
    """``group 1 (ranks 2-3)``: a group and its world ranks, for messages."""
    ranks = list(topology.groups[g])
    span = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks[0]}-{ranks[-1]}"
    if len(ranks) > 1 and ranks != list(range(ranks[0], ranks[-1] + 1)):
        span = "ranks " + ",".join(map(str, ranks))
    return f"group {g} ({span})"


@dataclass(frozen=True)
class ExchangeOptions:
    """How a group exchanges with the servers.

    Attributes:
        compensation: Learning-rate rule applied by the servers.
        staleness_bound: SSP bound in a group's own updates (``None``: none).
        max_updates: Server version after which every group is told to stop.
        overlap: Overlap a leader's exchange with the group's next step.
        stream: Stream the leader's push bucket by bucket as the group's
            reduction completes (:mod:`hybridagg.ps.streaming`); the caller
            hands each final bucket to :meth:`GroupExchange.bucket_final`.
            Not with ``overlap``, whose push already runs during the next
            step (:func:`streams`).
        batching: Server-side adaptive batching options (see
            :class:`~hybridagg.ps.client.PSClient`).
        wire: The type pushed gradients and pulled weights travel in.
    """

    compensation: Compensation
    staleness_bound: int | None = None
    max_updates: int | None = None
    overlap: bool = False
    stream: bool = False
    batching: dict | None = None
    wire: str = "fp32"


def streams(stream: bool, overlap: bool, on_cpu: bool) -> bool:
    """Whether a leader streams its push bucket by bucket.

    Not with ``overlap``: its push is posted at the end of a step and
    completed during the next, whose backward rewrites the buckets, so it is
    sent from a copy; and streaming it would put two pushes of one leader in
    flight. Not for parameters off the CPU: the buckets would be sent from
    device memory, which needs a CUDA-aware MPI.
    """
    return stream and not overlap and on_cpu


class GroupExchange:
    """The hybrid/async step of one worker.

    Args:
        topology: From :func:`hybridagg.init` (with servers).
        params: The model's parameters (model order).
        buffers: Floating buffers that travel with the weights.
        optimizer: The user's optimizer (its class and settings go to the servers).
        options: How to exchange.

    Attributes:
        should_stop: The servers told every group to stop.
        last_staleness: Staleness of the group's last update.
        last_lr_scale: Factor the servers applied to its rates.
        updates: Updates this rank's model has received.
        version: Newest server version this group has seen.
        checkpoint_requested: Newest checkpoint the servers requested.
        checkpoint_done: Newest checkpoint this group saved.
        advice: Batch size from server 0 (0: none).
        stop_flags: Leader: flags sent with every push (``FLAG_STOP``).
        seconds_per_sample: Leader: the group's compute time per sample,
            sent with every push (adaptive batching).
        nonfinite_group: The group whose loss or gradient was not finite,
            which stopped every group (``None``: none); this group's own
            after :meth:`halt`, another's as the servers' replies tell it.
        nonfinite_version: The newest server version seen when it was told.
        model_versions: Leader: per shard, the version the model's weights
            came from.
    """

    def __init__(
        self,
        topology: Topology,
        params: list[torch.Tensor],
        buffers: list[torch.Tensor],
        optimizer: torch.optim.Optimizer,
        options: ExchangeOptions,
    ) -> None:
        comms = topology.comms
        self.topology = topology
        self.is_leader, self.overlap = topology.is_leader, options.overlap
        self.group = (
            GroupWeights(
                comms.group.dup("group.weights"), params, buffers, topology.is_leader
            )
            if comms.group.size > 1
            else None
        )
        self.client: PSClient | None = None
        if self.is_leader:
            self.client = PSClient(
                comms.leaders.dup("ps"),
                topology.num_groups,
                params,
                buffers,
                optimizer,
                options.compensation,
                options.staleness_bound,
                options.max_updates,
                batching=options.batching,
                wire=options.wire,
            )
        self.pending: RoundTrip | None = None
        self._stash: torch.Tensor | None = None  # (pull: the model's weights meanwhile)
        self.unsent = False  # the leader's model holds weights its group lacks
        self.model_versions = [0] * (self.client.num_servers if self.client else 0)
        self.should_stop = False
        self.last_staleness = 0
        self.last_lr_scale = 1.0
        self.updates = 0
        self.version = 0
        self.checkpoint_requested = 0
        self.checkpoint_done = 0
        self.advice = 0.0
        self.stop_flags = 0
        self.seconds_per_sample = 0.0
        self.nonfinite_group: int | None = None
        self.nonfinite_version = 0
        self.halted_here = False  # this group found its own NaN or infinity
        self.buckets: list[tuple[int, int]] | None = None
        """Streaming: each bucket's range of the flat model (set by the caller)."""
        self.streaming: StreamedPush | None = None
        self._refused = False  # this step's first final bucket was not finite
        self.cut_after: int | None = None
        """Parts of this group's last push sent before it was cut short."""

    # --- leader: streaming ---------------------------------------------------
    def bucket_final(
        self, index: int, flat: torch.Tensor, samples: float, lrs: list[float]
    ) -> None:
        """Leader, streaming: bucket ``index`` is final; push what it completes.

        The first final bucket of a step starts the push (the header goes to
        every server). A bucket that is not finite sends nothing: the push is
        cut short when the step ends (the group's own check then halts it),
        and if it was the step's first, nothing is pushed at all.

        Args:
            index: The bucket's index (buckets become final in index order).
            flat: Its memory, divided by the group's total.
            samples: The group's samples in this update.
            lrs: Current ``lr`` of each of the user's parameter groups.
        """
        if self._refused or samples <= 0 or self.nonfinite_group is not None:
            return
        finite = all_finite([flat])
        if self.streaming is None:
            if not finite:
                self._refused = True
                return
            self.streaming = self._begin(samples, lrs)
        if finite and self.streaming.next == index:
            self.streaming.send(index, flat)

    def _begin(self, samples: float, lrs: list[float]) -> StreamedPush:
        return self.client.stream(
            self.buckets,
            samples,
            lrs,
            self.model_versions,
            flags=self.stop_flags,
            seconds_per_sample=self.seconds_per_sample,
        )

    def _stream_step(self, flats: list[torch.Tensor], samples: float, lrs) -> None:
        """End the step's streamed push: the buckets not sent yet, then the reply."""
        if self.streaming is None:
            self.streaming = self._begin(samples, lrs)
        push, self.streaming = self.streaming, None
        for b in range(push.next, len(flats)):
            push.send(b, flats[b])
        self._take_reply(self.client.complete(self.client.end_stream(push)))

    def _cut_stream(self) -> None:
        """Cut the step's streamed push short; its reply is not taken."""
        self._refused = False
        if self.streaming is None:
            return
        push, self.streaming = self.streaming, None
        self.cut_after = push.sent
        self.client.complete(self.client.end_stream(push, cut=True))

    # --- leader ------------------------------------------------------------
    def _leader_step(self, grads, samples: float, lrs: list[float]) -> bool:
        """Returns whether the model holds weights the group has not been sent."""
        if self.overlap:
            # the gradient was computed on the weights of the versions held
            # before the pending reply is applied: that is its staleness
            computed_on = list(self.model_versions)
            if self.pending is not None:
                self._finish_pending()
            if samples > 0:
                self.pending = self._push(grads, samples, lrs, computed_on)
        elif samples > 0 and self.buckets is not None:
            self._stream_step(grads, samples, lrs)
        elif samples > 0:
            self._take_reply(self.client.complete(self._push(grads, samples, lrs)))
        self._refused = False
        new, self.unsent = self.unsent, False
        return new

    def _push(self, grads, samples, lrs, versions=None) -> RoundTrip:
        return self.client.push(
            grads,
            samples,
            lrs,
            self.model_versions if versions is None else versions,
            flags=self.stop_flags,
            seconds_per_sample=self.seconds_per_sample,
        )

    def _finish_pending(self) -> None:
        info = self.client.complete(self.pending)
        self.pending = None
        self._take_reply(info)

    def _take_reply(self, info: dict) -> None:
        self.client.unpack_into_model()
        self.unsent = True  # (also after a pending reply completed by pull())
        self.model_versions = info["versions"]
        self.should_stop = self.should_stop or info["stop"]
        self.last_staleness = info["staleness"]
        self.last_lr_scale = info["lr_scale"]
        self.checkpoint_requested = max(self.checkpoint_requested, info["checkpoint"])
        self.advice = info["advice"]
        self.version = max(self.version, max(info["versions"]))
        self.updates += 1
        if info["nonfinite"] is not None and self.nonfinite_group is None:
            self.nonfinite_group = info["nonfinite"]
            self.nonfinite_version = self.version

    # --- everyone ------------------------------------------------------------
    def step(self, grads, samples: float, lrs: list[float]) -> None:
        """After the group reduction: exchange (leader) and share the weights.

        Args:
            grads: Each parameter's gradient; streaming: each bucket's memory.
            samples: The group's samples in this update.
            lrs: Current ``lr`` of each of the user's parameter groups.
        """
        new = self._leader_step(grads, samples, lrs) if self.is_leader else False
        if self.group is None:
            return
        header = None
        if self.is_leader:
            header = GroupHeader(
                stop=self.should_stop,
                new_weights=new,
                staleness=self.last_staleness,
                lr_scale=self.last_lr_scale,
                checkpoint=self.checkpoint_requested,
                advice=self.advice,
                version=self.version,
                nonfinite=self.nonfinite_group,
            )
        got = self.group.broadcast(header, "weights")
        if self.is_leader:
            return
        if got.new_weights:
            self.updates += 1
        self.should_stop = got.stop
        self.last_staleness = got.staleness
        self.last_lr_scale = got.lr_scale
        self.checkpoint_requested = got.checkpoint
        self.advice = got.advice
        self.version = got.version
        if got.nonfinite is not None and self.nonfinite_group is None:
            self.nonfinite_group = got.nonfinite
            self.nonfinite_version = got.version

    def halt(self) -> None:
        """This group's loss or gradient was not finite: push nothing more.

        Call on every member (each reached the same verdict). The leader
        tells every server when it finishes (:meth:`finish`); the servers
        then stop every other group with the reason in their replies.
        """
        self.halted_here = True
        if self.nonfinite_group is None:
            self.nonfinite_group = self.topology.group
            self.nonfinite_version = self.version
        if self.is_leader:
            self._cut_stream()

    @property
    def halted_by_servers(self) -> str | None:
        """Why the servers stopped this group for a NaN or an infinity they found.

        Another group's, or this group's own push when the group had not
        halted itself: its gradient was finite, what arrived was not (on an
        fp16 wire, an element beyond 65504 becomes an infinity).
        """
        g = self.nonfinite_group
        if g is None or self.halted_here:
            return None
        if g == self.topology.group:
            return (
                f"the push of {group_name(self.topology, g)} was not finite on "
                "the servers (an element beyond the wire format's range?); the "
                f"servers stopped every group (server version "
                f"{self.nonfinite_version})"
            )
        return (
            f"{group_name(self.topology, g)} had a non-finite loss or gradient; "
            f"the servers stopped every group (server version "
            f"{self.nonfinite_version})"
        )

    @property
    def checkpoint_due(self) -> int:
        """The checkpoint this group must save now (0: none); same in the group."""
        c = self.checkpoint_requested
        return c if c > self.checkpoint_done else 0

    def checkpointed(self, number: int) -> None:
        """After every member saved its part of ``number``: tell the servers.

        Call on every member of the group (the leader sends ``CKPT``); the
        servers then hold this group's next push until the snapshot is whole.
        """
        self.checkpoint_done = max(self.checkpoint_done, number)
        if self.is_leader:
            self.client.checkpointed(number)

    def refresh(self) -> None:
        """Load the servers' current weights into every member's model (collective).

        Used when training resumes from a checkpoint: the servers hold the
        authoritative model.
        """
        if self.is_leader:
            if self.pending is not None:
                self._finish_pending()
            info = self.client.complete(self.client.pull())
            self.client.unpack_into_model()
            self.model_versions = info["versions"]
            self.version = max(info["versions"])
            self.checkpoint_requested = max(
                self.checkpoint_requested, info["checkpoint"]
            )
            self.checkpoint_done = self.checkpoint_requested
        if self.group is None:
            return
        header = None
        if self.is_leader:
            header = GroupHeader(
                new_weights=True, checkpoint=self.checkpoint_done, version=self.version
            )
        got = self.group.broadcast(header, "resumed weights")
        if not self.is_leader:
            self.version = got.version
            self.checkpoint_requested = self.checkpoint_done = got.checkpoint

    def pull_state(
        self, out: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """On a leader: the servers' weights and buffers, flat (copies).

        Does not change the model. ``out``: see :meth:`pull`.
        """
        weights = self.pull(out)
        buffers = self.client.flat_buffers
        return weights, None if buffers is None else buffers.clone()

    def pull(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """On a leader: the servers' current weights as one flat tensor (a copy).

        Does not change the model. In overlap mode a pending exchange is
        completed (and applied) first.

        Args:
            out: A flat tensor of the model's size to copy them into and
                return (a caller that pulls again and again, as validation
                does, keeps one: fresh memory costs page faults on every
                pull); ``None``: a new tensor.

        Raises:
            ValueError: This rank is not a group leader, or ``out`` is not
                a tensor of the model's size.
        """
        if not self.is_leader:
            raise ValueError("only a group leader can pull from the parameter servers")
        flat = self.client.flat_weights
        if out is not None and (
            not isinstance(out, torch.Tensor)
            or out.shape != flat.shape
            or out.dtype != flat.dtype
            or out.data_ptr() == flat.data_ptr()
        ):
            raise ValueError(
                f"pull(out=...) needs a flat {flat.dtype} tensor of {flat.numel()} "
                f"elements of its own, got {_describe(out)}"
            )
        if self.pending is not None:
            self._finish_pending()
        # the model's weights are kept aside while the pull lands where the
        # replies always do; the stash is made once and reused
        if self._stash is None:
            self._stash = alloc(flat.numel(), flat.dtype, pinned=self.client.pinned)
        self._stash.copy_(flat)
        self.client.complete(self.client.pull())
        fresh = flat.clone() if out is None else out.copy_(flat)
        flat.copy_(self._stash)
        return fresh

    def finish(self, timeout: float | None = None, final: bool = True) -> int | None:
        """End this group's run (call on every worker, after the last step).

        The leader completes any pending exchange, tells the servers it is
        done; leader 0 then receives the final weights of every shard (once
        every group is done) and loads them into its model.

        Args:
            timeout: Seconds to wait for the final weights.
            final: Leader 0 receives the final weights now. ``False`` (with
                ``--on-group-failure continue``): whichever leader the
                survivors choose receives them later (:meth:`receive_final`).

        Returns:
            On leader 0 the final server version, else ``None``.
        """
        if not self.is_leader:
            return None
        self._cut_stream()
        if self.pending is not None:
            self._finish_pending()
        self.client.done(nonfinite=self.nonfinite_group)
        if self.client.ps.rank != 0 or not final:
            return None
        return self.receive_final(timeout)

    def receive_final(self, timeout: float | None = None) -> int:
        """On the leader chosen to: receive every shard's final weights into the model.

        Returns:
            The final server version.
        """
        version = self.client.receive_final(timeout)
        self.client.unpack_into_model()
        return version

    def lost(self, dead_rank: int) -> None:
        """A member of this group died: the leader tells the servers, which drop the group.

        A pending exchange is completed first (the servers are alive), so no
        reply is left in flight to a leader that no longer listens.

        Args:
            dead_rank: The world rank found dead (-1: unknown).
        """
        if not self.is_leader:
            return
        self._cut_stream()
        if self.pending is not None:
            self.client.complete(self.pending)
            self.pending = None
        self.client.lost(dead_rank)


def _describe(value) -> str:
    """A tensor's shape and dtype for a message, else its type."""
    if isinstance(value, torch.Tensor):
        return f"{value.dtype} of shape {tuple(value.shape)}"
    return type(value).__name__
