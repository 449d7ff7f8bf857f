"""Message kinds, tags and header layouts of the parameter-server protocol.

Leader -> server header (float64, ``HEAD + number of parameter groups``)::

    [kind, arg, samples, flags, info, reserved, lr of each parameter group...]

``arg`` is the version the gradient was computed from (``PUSH``) or the
checkpoint number (``CKPT``); ``flags`` holds :data:`FLAG_STOP` (the group
asks every group to stop, e.g. after SIGTERM); ``info`` carries the group's
measured compute seconds per sample (adaptive batching).

Server -> leader reply header (float64, :data:`REPLY_LEN`)::

    [version, stop, staleness, lr_scale, checkpoint, advice]

``checkpoint`` is the newest checkpoint server 0 has requested; ``advice``
is a batch size computed by server 0 (adaptive batching in async mode; 0:
none).
"""

from __future__ import annotations

__all__ = [
    "BUF",
    "CKPT",
    "DONE",
    "FINAL",
    "FLAG_STOP",
    "GRAD",
    "HDR",
    "HEAD",
    "INIT",
    "PULL",
    "PUSH",
    "REPLY_BUF",
    "REPLY_HDR",
    "REPLY_LEN",
    "REPLY_W",
    "WRITTEN",
]

# message kinds (first header element)
PUSH, PULL, DONE, CKPT = 1.0, 2.0, 3.0, 4.0
# tags
INIT, HDR, GRAD, BUF, REPLY_HDR, REPLY_W, REPLY_BUF, FINAL, WRITTEN = range(101, 110)
HEAD = 6
REPLY_LEN = 6
FLAG_STOP = 1
