"""What the polled waits know about the liveness of the other ranks.

A :class:`~hybridagg.comm.heartbeat.Heartbeat` (or any object with the same
two members) registers itself here as this process's *watch*. The waits of
:mod:`hybridagg.comm.waits` consult it on every back-off sleep:

* ``failure``: a peer was declared dead or stuck; the wait raises that
  :class:`~hybridagg.runtime.outcomes.PeerFailure` at once instead of
  running into ``HYBRIDAGG_TIMEOUT``.
* ``solo_seconds()``: seconds, on a clock that only runs while some rank of
  the job is in a declared *solo phase* (rank 0's validation, a checkpoint
  commit, the final merge). A wait does not count that time against its
  timeout: the peer it waits on may be waiting, directly or through a chain
  of others, for the rank doing the solo work, which the heartbeat shows to
  be alive and which keeps its own deadline
  (``HYBRIDAGG_SOLO_WORK_TIMEOUT``).

The deadlines themselves are pure functions of the registry's values, here
so that they are unit-tested without MPI.
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Iterator
from typing import Protocol

from ..runtime import envvars
from ..runtime.outcomes import PeerFailure

__all__ = [
    "Watch",
    "beat_period",
    "current",
    "failure_timeout",
    "install",
    "silence_limit",
    "solo",
    "solo_work_timeout",
    "uninstall",
]


class Watch(Protocol):
    """What a wait asks about the other ranks."""

    failure: PeerFailure | None
    """The failure declared in this job, or ``None``."""

    def solo_seconds(self) -> float:
        """Seconds (monotonic, from any origin) spent with a solo phase running."""
        ...


_lock = threading.Lock()
_current: Watch | None = None


def install(watch: Watch) -> None:
    """Make ``watch`` the one the waits of this process consult.

    Raises:
        RuntimeError: Another watch is installed (one heartbeat per process).
    """
    global _current
    with _lock:
        if _current is not None and _current is not watch:
            raise RuntimeError("a liveness watch is already installed in this process")
        _current = watch


def uninstall(watch: Watch) -> None:
    """Remove ``watch`` if it is the one installed (otherwise do nothing)."""
    global _current
    with _lock:
        if _current is watch:
            _current = None


def current() -> Watch | None:
    """The installed watch, or ``None`` (no heartbeat: waits use plain timeouts)."""
    return _current


@contextlib.contextmanager
def solo(name: str) -> Iterator[None]:
    """Declare solo work ``name`` on this rank to the installed watch, if any.

    The training driver wraps rank 0's validation, checkpoint writes and
    commits and the final merge in it, without knowing whether a heartbeat
    runs (none: a plain block).
    """
    watch = current()
    declare = getattr(watch, "solo", None)
    if declare is None:
        yield
        return
    with declare(name):
        yield


def _positive_seconds(name: str) -> float:
    value = envvars.get_float(name)
    if value is None or not (value > 0 and math.isfinite(value)):
        raise ValueError(f"{name} must be a finite positive number, got {value}")
    return value


def failure_timeout() -> float:
    """``HYBRIDAGG_FAILURE_TIMEOUT`` in seconds.

    Raises:
        ValueError: It is not a finite positive number.
    """
    return _positive_seconds("HYBRIDAGG_FAILURE_TIMEOUT")


def solo_work_timeout() -> float:
    """``HYBRIDAGG_SOLO_WORK_TIMEOUT`` in seconds.

    Raises:
        ValueError: It is not a finite positive number.
    """
    return _positive_seconds("HYBRIDAGG_SOLO_WORK_TIMEOUT")


# A beat every tenth of the failure timeout: a silence of several periods
# is needed before a verdict, so one late beat (a busy node, a long GIL
# hold) is no false alarm, while the message rate stays negligible (one
# 8-byte message per rank per period). The bounds keep a tiny timeout from
# flooding the network and a huge one from reacting to a death late.
_PERIODS_PER_TIMEOUT = 10
_MIN_PERIOD_S = 0.05
_MAX_PERIOD_S = 1.0


def beat_period(timeout: float) -> float:
    """Seconds between two heartbeats of a rank, for a failure timeout.

    Raises:
        ValueError: ``timeout`` is not a finite positive number.
    """
    if not (timeout > 0 and math.isfinite(timeout)):
        raise ValueError(f"failure timeout must be finite and positive, got {timeout}")
    return min(_MAX_PERIOD_S, max(_MIN_PERIOD_S, timeout / _PERIODS_PER_TIMEOUT))


def silence_limit(timeout: float) -> float:
    """Seconds without a heartbeat after which a peer is declared dead or stuck.

    The last beat of a peer that dies came up to one period before its
    death, and the watcher looks a quarter period late at most, so a limit
    of ``timeout - 2 periods`` (at least one period) declares it within
    ``timeout`` of the death.
    """
    period = beat_period(timeout)
    return max(period, timeout - 2.0 * period)
