"""hybridagg's log messages: Python ``logging``, tagged with the rank, rank 0's by default.

Every module logs to a child of the ``hybridagg`` logger
(``logging.getLogger(__name__)``). :func:`configure` gives that logger one
handler on stderr that prefixes each line with ``[rank R]`` and, by
default, lets only rank 0's records through: in a job of N ranks every rank
runs the same code, and N copies of each message bury the one that differs.
A record logged with ``extra={"any_rank": True}`` passes on every rank (an
error only the failing rank knows). ``HYBRIDAGG_LOG_RANKS=all`` shows every
rank's.

``hybridagg train`` configures it from ``--log-level``; a script that uses
the library gets it from :func:`hybridagg.init`, at ``HYBRIDAGG_LOG_LEVEL``
(default ``warning``), unless the script configured ``logging`` itself
(a handler on the root or the ``hybridagg`` logger): then hybridagg's
records go to the script's handlers untouched.

Not everything is a log record: the final table and, with
``--on-group-failure continue``, each rank's status line go to stdout and
stderr as plain lines that scripts parse; the messages of a rank that is
being aborted (``comm/process.py``, the heartbeat's thread) are written
straight to stderr, since a handler's lock may be held by the thread that
is stuck.
"""

from __future__ import annotations

import logging
import sys

from . import envvars

__all__ = ["LEVELS", "LOGGER", "RankFilter", "configure", "level_of"]

LOGGER = "hybridagg"
"""The name of hybridagg's root logger."""

LEVELS = ("debug", "info", "warning", "error")
"""The level names ``--log-level`` and ``HYBRIDAGG_LOG_LEVEL`` accept."""

_MARK = "_hybridagg_handler"


def level_of(name: str, what: str = "HYBRIDAGG_LOG_LEVEL") -> int:
    """The ``logging`` level of a name in :data:`LEVELS` (any case).

    Raises:
        ValueError: Not one of them; names ``what``.
    """
    key = str(name).strip().lower()
    if key not in LEVELS:
        raise ValueError(f"{what} must be one of {', '.join(LEVELS)}, got {name!r}")
    return getattr(logging, key.upper())


def _ranks_setting() -> bool:
    """Whether every rank's records are shown (``HYBRIDAGG_LOG_RANKS``)."""
    value = (envvars.get_str("HYBRIDAGG_LOG_RANKS") or "0").strip().lower()
    if value not in ("0", "all"):
        raise ValueError(f"HYBRIDAGG_LOG_RANKS must be 0 or all, got {value!r}")
    return value == "all"


class RankFilter(logging.Filter):
    """Tags each record with the rank; drops other ranks' unless told not to.

    Args:
        rank: This process's rank.
        every_rank: Let every rank's records through (else rank 0's, and
            those logged with ``extra={"any_rank": True}``).
    """

    def __init__(self, rank: int, every_rank: bool) -> None:
        super().__init__()
        self.rank, self.every_rank = int(rank), bool(every_rank)

    def filter(self, record: logging.LogRecord) -> bool:
        record.rank = self.rank
        return (
            self.rank == 0
            or self.every_rank
            or bool(getattr(record, "any_rank", False))
        )


def configure(
    rank: int,
    level: str | None = None,
    *,
    every_rank: bool | None = None,
    force: bool = True,
) -> logging.Logger:
    """Show hybridagg's log records on stderr as ``[rank R] message``.

    Idempotent: a second call replaces the handler the first installed.

    Args:
        rank: This process's rank (the tag, and whose records pass).
        level: A name of :data:`LEVELS` (default ``HYBRIDAGG_LOG_LEVEL``).
        every_rank: Show every rank's records (default
            ``HYBRIDAGG_LOG_RANKS``).
        force: Install the handler even if the script configured
            ``logging`` itself, or replace the one installed before
            (``False``: keep an installed one as it is; leave a script's own
            set-up alone and only set the level).

    Returns:
        The ``hybridagg`` logger.

    Raises:
        ValueError: A bad level or ``HYBRIDAGG_LOG_RANKS``, naming it.
    """
    logger = logging.getLogger(LOGGER)
    ours = [h for h in logger.handlers if getattr(h, _MARK, False)]
    theirs = logging.getLogger().handlers or [
        h for h in logger.handlers if not getattr(h, _MARK, False)
    ]
    if not force and ours:  # (hybridagg train configured it from its flags)
        return logger
    if level is None:
        value = level_of(envvars.get_str("HYBRIDAGG_LOG_LEVEL") or "warning")
    else:
        value = level_of(level, "--log-level")
    every = _ranks_setting() if every_rank is None else every_rank
    logger.setLevel(value)
    if theirs and not force:  # the script's own logging set-up receives them
        logger.propagate = True
        return logger
    for h in ours:
        logger.removeHandler(h)
    handler = logging.StreamHandler(sys.stderr)
    setattr(handler, _MARK, True)
    handler.addFilter(RankFilter(rank, every))
    handler.setFormatter(logging.Formatter("[rank %(rank)s] %(message)s"))
    logger.addHandler(handler)
    # the script's own root handlers would print each record a second time
    logger.propagate = False
    return logger
