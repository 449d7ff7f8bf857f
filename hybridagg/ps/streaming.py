"""A leader's push streamed bucket by bucket, as the group's reduction completes.

Unstreamed, a leader pushes nothing until its group's whole gradient is
reduced, then copies it into one flat vector and sends it. Streamed (as
BytePS and DDP do), the request header goes to every server as soon as the
step's first bucket is final (reduced and divided by the group's total
sample count, which the reducer learns early), and each server part is sent
as soon as every bucket it covers is final, straight from the bucket's
memory: a bucket holds a contiguous run of parameters in model order, so a
part inside one bucket is a slice of it. A part that straddles two buckets
is copied into a staging buffer of its own size (at most one per bucket
boundary and server). The servers apply and return each part as it arrives
(:mod:`hybridagg.ps.handler`), in backward order: the last parameters first.

On a compact wire (``--wire bf16``/``fp16``) each part is rounded, with the
client's error feedback (:class:`~hybridagg.comm.WireCodec`), when its
bucket becomes final, and sent from the compact copy: the same parts, the
same residuals and the same arithmetic as an unstreamed push, so both send
the same bits.

:func:`plan_stream` is the pure plan (which parts each bucket completes);
:class:`StreamedPush` sends by it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..comm import Comm, WireCodec
from . import protocol as P

__all__ = ["StreamPart", "StreamedPush", "bucket_ranges", "plan_stream"]


@dataclass(frozen=True)
class StreamPart:
    """One server part of a streamed push and where its gradient lies.

    Attributes:
        server: The server's index.
        index: The part's index in the server's shard (its tag).
        lo: First element of the part in the flat model.
        hi: One past its last.
        pieces: ``(bucket, start, stop)``: the part's gradient, in model
            order, as ranges of each bucket's memory; one piece: the part is
            sent from the bucket itself.
    """

    server: int
    index: int
    lo: int
    hi: int
    pieces: tuple[tuple[int, int, int], ...]

    @property
    def direct(self) -> bool:
        """Whether the part is sent straight from one bucket (no copy)."""
        return len(self.pieces) == 1


def bucket_ranges(numels: list[int], buckets: list[list[int]]) -> list[tuple[int, int]]:
    """The flat-model range of each bucket.

    Args:
        numels: Elements of each parameter (model order).
        buckets: The parameter indices of each bucket, a contiguous run each.

    Raises:
        ValueError: A bucket's parameters are not a contiguous run.
    """
    starts = np.concatenate(([0], np.cumsum(numels, dtype=np.int64))).tolist()
    out = []
    for b, members in enumerate(buckets):
        first, last = min(members), max(members)
        if sorted(members) != list(range(first, last + 1)):
            raise ValueError(f"bucket {b} is not a contiguous run of parameters")
        out.append((int(starts[first]), int(starts[last + 1])))
    return out


def plan_stream(
    parts: list[list[tuple[int, int]]], buckets: list[tuple[int, int]]
) -> list[list[StreamPart]]:
    """Which server parts each bucket completes, in the order they are sent.

    Buckets become final in index order (bucket 0 holds the last
    parameters), so a part is sent with the highest-numbered bucket it
    covers; within a bucket, parts go in backward order (descending start).

    Args:
        parts: Per server, its parts as ranges of the flat model.
        buckets: Each bucket's range of the flat model (:func:`bucket_ranges`).

    Returns:
        Per bucket, the parts it completes.

    Raises:
        ValueError: A part lies outside every bucket (the buckets do not
            cover the model).
    """
    plan: list[list[StreamPart]] = [[] for _ in buckets]
    for s, server_parts in enumerate(parts):
        for i, (lo, hi) in enumerate(server_parts):
            pieces = []
            covered = 0
            for b, (blo, bhi) in enumerate(buckets):
                a, z = max(lo, blo), min(hi, bhi)
                if a < z:
                    pieces.append((b, a - blo, z - blo, a))
                    covered += z - a
            if covered != hi - lo:
                raise ValueError(
                    f"part {i} of server {s} ([{lo}, {hi})) is not covered by the buckets"
                )
            pieces.sort(key=lambda piece: piece[3])  # model order
            last = max(b for b, *_ in pieces)
            plan[last].append(
                StreamPart(s, i, lo, hi, tuple((b, a, z) for b, a, z, _ in pieces))
            )
    for row in plan:
        row.sort(key=lambda part: -part.lo)
    return plan


class StreamedPush:
    """One push being streamed to the servers (made by ``PSClient.stream``).

    Args:
        ps: The leaders-and-servers communicator.
        servers: Each server's rank on it.
        plan: :func:`plan_stream`'s plan.
        requests: The round trip's requests so far (reply receives, headers).
        keep: Buffers that must outlive the requests.
        codec: The wire the gradient travels in (the client's, with its
            error feedback); ``None`` or float32: parts go as they lie.
    """

    def __init__(
        self,
        ps: Comm,
        servers: list[int],
        plan: list[list[StreamPart]],
        requests: list,
        keep: list,
        codec: WireCodec | None = None,
    ) -> None:
        self.ps, self.servers, self.plan = ps, servers, plan
        self.codec = codec
        self.requests, self.keep = requests, keep
        self.memory: dict[int, torch.Tensor] = {}
        self.next = 0
        """The next bucket to send."""
        self.copied = 0
        """Elements copied into staging buffers (parts across buckets)."""
        self.sent = 0
        """Parts sent with their gradient."""
        self.replies: list[np.ndarray] = []
        """Each server's reply header (set by the client)."""

    @property
    def sent_all(self) -> bool:
        """Whether every bucket's parts have been sent."""
        return self.next == len(self.plan)

    def send(self, bucket: int, flat: torch.Tensor) -> None:
        """Send the parts bucket ``bucket`` completes (buckets in index order).

        Args:
            bucket: The bucket's index; it must be :attr:`next`.
            flat: Its memory, final (it must not change until the push ends).

        Raises:
            ValueError: Buckets out of order.
        """
        if bucket != self.next:
            raise ValueError(f"bucket {bucket} streamed before bucket {self.next}")
        self.memory[bucket] = flat
        for part in self.plan[bucket]:
            if part.direct:
                b, a, z = part.pieces[0]
                data = self.memory[b][a:z]
            else:
                data = torch.cat([self.memory[b][a:z] for b, a, z in part.pieces])
                self.copied += data.numel()
            if self.codec is not None and self.codec.compact:
                # rounded now that the part is final, into the codec's compact
                # copy of the vector, which the message is sent from
                data = self.codec.encode_part(data, part.lo, part.hi)
            elif not part.direct:
                self.keep.append(data)  # (the staging copy outlives its send)
            self.requests.append(
                self.ps.Isend(data, self.servers[part.server], P.part_tag(part.index))
            )
            self.sent += 1
        self.next += 1

    def cut(self) -> None:
        """Cut the push short: every part not sent yet goes with length 0.

        The servers then apply nothing more of this push, and still answer
        it, so the round trip completes.
        """
        empty = np.zeros(0, dtype=np.float64)
        self.keep.append(empty)
        for row in self.plan[self.next :]:
            for part in row:
                self.requests.append(
                    self.ps.Isend(
                        empty, self.servers[part.server], P.part_tag(part.index)
                    )
                )
        self.next = len(self.plan)

    def finish(self, buffers: torch.Tensor | None, cut: bool = False) -> list:
        """Send the buffers to server 0 (length 0 when ``cut``); returns the requests."""
        if buffers is not None:
            data = np.zeros(0, dtype=np.float64) if cut else buffers
            self.keep.append(data)
            self.requests.append(self.ps.Isend(data, self.servers[0], P.BUF))
        self.memory.clear()
        return self.requests
