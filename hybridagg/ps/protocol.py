"""Message kinds, tags and header layouts of the parameter-server protocol.

Ranks: on the communicator of the group leaders followed by the servers,
leader ``g`` is rank ``g`` and server ``s`` is rank ``G + s``
(:func:`server_rank`).

Request header, leader -> server (float64, :func:`request_len`: the
:data:`REQUEST_FIELDS` fixed fields, then one learning rate per parameter
group)::

    [kind, arg, samples, flags, seconds_per_sample, reserved, lr of each group...]

``arg`` is the version the gradient was computed from (``PUSH``), the
checkpoint number (``CKPT``), the world rank found dead (``LOST``: the
leader's group lost a member and leaves; ``--on-group-failure continue``),
or with :data:`FLAG_NONFINITE` the group whose loss or gradient was not
finite (``DONE``); ``flags`` holds :data:`FLAG_STOP` (the group asks every
group to stop, e.g. after SIGTERM) and :data:`FLAG_NONFINITE`;
``seconds_per_sample`` is the group's measured compute time per sample
(adaptive batching).

Reply header, server -> leader (float64, :data:`REPLY_LEN`)::

    [version, stop, staleness, lr_scale, checkpoint, advice, nonfinite]

``checkpoint`` is the newest checkpoint server 0 has requested; ``advice``
is a batch size computed by server 0 (adaptive batching; 0: none);
``nonfinite`` is the reason of a stop for a NaN or an infinity: the group
whose loss or gradient was not finite (-1: none).
:class:`Request` and :class:`Reply` write and read these layouts, so no other
module indexes a header.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np

__all__ = [
    "BUF",
    "CKPT",
    "DONE",
    "FINAL",
    "FLAG_NONFINITE",
    "FLAG_STOP",
    "HDR",
    "INIT",
    "LOST",
    "PART_TAG0",
    "PULL",
    "PUSH",
    "REPLY_BUF",
    "REPLY_HDR",
    "REPLY_LEN",
    "REQUEST_FIELDS",
    "WRITTEN",
    "Reply",
    "Request",
    "part_tag",
    "request_len",
    "server_rank",
]

# message kinds (a request's first field)
PUSH, PULL, DONE, CKPT, LOST = 1.0, 2.0, 3.0, 4.0, 5.0
# tags
# (103 and 106 were the one tag of all gradient parts and of all reply parts
# before each part had its own, :func:`part_tag`)
INIT, HDR, _GRAD, BUF, REPLY_HDR, _REPLY_W, REPLY_BUF, FINAL, WRITTEN = range(101, 110)
# fixed fields of a request header, before the learning rates
REQUEST_FIELDS = 6
FLAG_STOP = 1
# DONE: the group stops for a non-finite loss or gradient (``arg``: whose);
# every server then stops every group (never set on a PUSH)
FLAG_NONFINITE = 2


# a part's tag is PART_TAG0 + its index in the server's shard, both ways (a
# gradient part to the server, the weights of that part back): parts of a
# streamed push arrive, and are answered, in backward order (the last
# parameters first), and messages of one tag match the receives in the order
# they were posted, so each part needs a tag of its own (a gradient part of
# length 0 cuts the push short)
PART_TAG0 = 1000


def part_tag(part: int) -> int:
    """The tag of part ``part`` of a push or its reply (:data:`PART_TAG0` + index)."""
    return PART_TAG0 + part


def server_rank(num_groups: int, server: int) -> int:
    """Rank of server ``server`` on the leaders-and-servers communicator."""
    return num_groups + server


def request_len(num_param_groups: int) -> int:
    """Length of a request header for a model of this many parameter groups."""
    return REQUEST_FIELDS + num_param_groups


@dataclass(frozen=True)
class Request:
    """A leader's request header (see the module docstring for the layout).

    Attributes:
        kind: :data:`PUSH`, :data:`PULL`, :data:`DONE`, :data:`CKPT` or
            :data:`LOST`.
        arg: ``PUSH``: the version the gradient came from; ``CKPT``: the
            checkpoint number; ``LOST``: the world rank found dead (-1:
            unknown).
        samples: Samples in the pushed gradient.
        flags: Bit field (:data:`FLAG_STOP`).
        seconds_per_sample: The group's compute time per sample (0: none).
        lrs: Current ``lr`` of each of the user's parameter groups.
    """

    kind: float
    arg: int = 0
    samples: float = 0.0
    flags: int = 0
    seconds_per_sample: float = 0.0
    lrs: tuple[float, ...] = ()

    def encode(self, length: int) -> np.ndarray:
        """A new header of ``length`` elements (missing rates are 0)."""
        head = np.zeros(length, dtype=np.float64)
        head[:REQUEST_FIELDS] = (
            self.kind,
            self.arg,
            self.samples,
            self.flags,
            self.seconds_per_sample,
            0.0,
        )
        head[REQUEST_FIELDS : REQUEST_FIELDS + len(self.lrs)] = self.lrs
        return head

    @classmethod
    def decode(cls, head: np.ndarray) -> Request:
        """Read a received header."""
        return cls(
            kind=float(head[0]),
            arg=int(head[1]),
            samples=float(head[2]),
            flags=int(head[3]),
            seconds_per_sample=float(head[4]),
            lrs=tuple(head[REQUEST_FIELDS:].tolist()),
        )


@dataclass(frozen=True)
class Reply:
    """A server's reply header (see the module docstring for the layout).

    Attributes:
        version: The server's version after this request.
        stop: Every group is to stop (update budget reached, or a stop request).
        staleness: Staleness of the pushed gradient (0 for a pull).
        lr_scale: Factor the server applied to the pushed group's rates.
        checkpoint: Newest checkpoint server 0 has requested.
        advice: The group's batch size from server 0 (0: none).
        nonfinite: Why every group stops, if for a NaN or an infinity: the
            group whose loss or gradient was not finite (``None``: not so).
    """

    version: int
    stop: bool = False
    staleness: int = 0
    lr_scale: float = 0.0
    checkpoint: int = 0
    advice: float = 0.0
    nonfinite: int | None = None

    def encode_into(self, head: np.ndarray) -> np.ndarray:
        """Write the header into ``head`` (:data:`REPLY_LEN` float64); returns it."""
        head[:] = (
            self.version,
            1.0 if self.stop else 0.0,
            self.staleness,
            self.lr_scale,
            self.checkpoint,
            self.advice,
            -1.0 if self.nonfinite is None else self.nonfinite,
        )
        return head

    @classmethod
    def decode(cls, head: np.ndarray) -> Reply:
        """Read a received header."""
        return cls(
            version=int(head[0]),
            stop=bool(head[1]),
            staleness=int(head[2]),
            lr_scale=float(head[3]),
            checkpoint=int(head[4]),
            advice=float(head[5]),
            nonfinite=None if head[6] < 0 else int(head[6]),
        )


# fields of a reply header
REPLY_LEN = len(fields(Reply))
