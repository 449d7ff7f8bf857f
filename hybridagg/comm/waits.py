"""Polled waits: every wait on MPI goes through :func:`wait_until`.

A rank blocked in ``MPI_Recv`` or ``MPI_Allreduce`` on a peer that is busy
spins a full core for the whole wait (Open MPI, with or without
oversubscription), which on a node whose ranks share cores steals time from
the ranks doing real work. So hybridagg posts every operation non-blocking
and completes it here: a short spin, then sleeps whose length is a fixed
fraction of the time already waited, so the overshoot past completion stays
a small share of the operation's own duration. Every wait has a timeout and
raises :class:`CommTimeoutError` naming the operation and peer.

With a heartbeat running (:mod:`hybridagg.comm.liveness`), a wait raises the
:class:`~hybridagg.runtime.outcomes.PeerFailure` it declared at the next
poll, and time during which some rank was in a declared solo phase does not
count against the timeout: ``HYBRIDAGG_TIMEOUT`` then bounds how long a peer
that is alive may leave a wait unanswered outside such phases. An MPI error
reporting a failed process (ULFM) becomes a ``PeerFailure`` naming it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence

from mpi4py import MPI

from ..runtime import envvars
from ..runtime.outcomes import ExitCode
from . import liveness
from .failures import peer_failure_from

__all__ = [
    "CommTimeoutError",
    "check_timeout",
    "default_timeout",
    "wait",
    "wait_until",
]


class CommTimeoutError(TimeoutError):
    """A wait on MPI did not complete within its timeout (a stuck peer: exit 5)."""

    exit_code = ExitCode.ABORTED


def default_timeout() -> float:
    """Return ``HYBRIDAGG_TIMEOUT`` in seconds.

    Raises:
        ValueError: It is not a finite positive number.
    """
    value = envvars.get_float("HYBRIDAGG_TIMEOUT")
    if value is None or not (value > 0 and math.isfinite(value)):
        raise ValueError(
            f"HYBRIDAGG_TIMEOUT must be a finite positive number, got {value}"
        )
    return value


def check_timeout(value: float, what: str = "timeout") -> float:
    """Return ``value`` as a float if it is a finite positive number of seconds.

    A NaN or infinite timeout would never expire (NaN compares false), so a
    wait given one could hang; every wait has a timeout.

    Raises:
        ValueError: It is not a finite positive number; names ``what``.
    """
    seconds = float(value)
    if not (seconds > 0 and math.isfinite(seconds)):
        raise ValueError(f"{what} must be a finite positive number, got {value}")
    return seconds


def _poll_params() -> tuple[float, float]:
    # (the defaults live in the registry)
    spin = envvars.get_float("HYBRIDAGG_POLL_SPIN_US")
    cap = envvars.get_float("HYBRIDAGG_POLL_MAX_SLEEP_US")
    return max(spin, 0.0) * 1e-6, max(cap, 1.0) * 1e-6


def _reduce_timer_slack() -> None:
    """Ask Linux for 1 us timer slack (default 50 us) so short sleeps stay short.

    A polled wait sleeps for tens of microseconds between tests; with the
    default slack each such sleep lasts at least ~60 us, which adds straight
    to the latency of small messages. Best effort: ignored where unsupported.
    """
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(29, 1000, 0, 0, 0)  # PR_SET_TIMERSLACK, nanoseconds
    except (OSError, AttributeError):
        pass


_reduce_timer_slack()

# The sleep after t seconds of waiting is t * _BACKOFF_FRACTION (capped), so
# the time a wait overshoots completion stays within a few percent of t.
_BACKOFF_FRACTION = 1.0 / 32.0
_MIN_SLEEP_S = 10e-6


def wait_until(
    done: Callable[[], bool],
    *,
    what: str,
    timeout: float | None = None,
    activity: Callable[[], int] | None = None,
    spin: float | None = None,
    max_sleep: float | None = None,
    max_sleep_for: float | None = None,
) -> float:
    """Wait until ``done()`` is true without burning a core.

    Calls ``done`` in a tight loop for ``HYBRIDAGG_POLL_SPIN_US``, then sleeps
    between calls for ``idle / 32`` (at least 10 us, at most
    ``HYBRIDAGG_POLL_MAX_SLEEP_US``), where ``idle`` is the time since the
    wait began or since ``activity()`` last changed. ``done`` is expected to
    drive MPI progress (``MPI_Test``), which it does on every call. A
    multi-stage operation (the ring all-reduce) reports each completed stage
    through ``activity``, so it is tested at full speed while data moves and
    backs off only while it waits for a peer.

    Args:
        done: Returns true when the awaited thing has happened.
        what: Names the operation and peer for the timeout message.
        timeout: Seconds before giving up (default ``HYBRIDAGG_TIMEOUT``).
        activity: A counter that grows whenever the operation advances.
        spin: Seconds to spin before sleeping, instead of
            ``HYBRIDAGG_POLL_SPIN_US``: for waits known to be short (every
            peer has arrived), where a sleep woken late would cost more
            than the wait.
        max_sleep: Seconds, a lower back-off cap than
            ``HYBRIDAGG_POLL_MAX_SLEEP_US`` (never a higher one): for a
            service whose reaction time adds to its clients' latency (a
            parameter server waiting for the next push).
        max_sleep_for: Seconds of idleness after which ``max_sleep`` no
            longer applies and the back-off grows to the general cap: a
            service idle that long is rarely woken, and every wake costs
            CPU time, while the overshoot stays within 1/32 of the wait.

    Returns:
        Seconds waited.

    Raises:
        CommTimeoutError: ``done`` stayed false for ``timeout`` seconds (not
            counting time during which some rank was in a solo phase).
        PeerFailure: The heartbeat declared a peer dead or stuck, or (while
            a heartbeat runs) MPI reported a failed process.
    """
    try:
        return _wait_until(
            done, what, timeout, activity, spin, max_sleep, max_sleep_for
        )
    except MPI.Exception as exc:
        # Only a job a heartbeat watches (hybridagg train, aborting on a
        # failure) wants MPI's failure errors as a PeerFailure; code that
        # survives failures (--on-group-failure continue) handles MPI's own
        # error classes, so they reach it unchanged.
        if liveness.current() is None:
            raise
        failure = peer_failure_from(exc, what=what)
        if failure is None:
            raise
        raise failure from exc


def _wait_until(
    done: Callable[[], bool],
    what: str,
    timeout: float | None,
    activity: Callable[[], int] | None,
    spin: float | None,
    max_sleep: float | None,
    max_sleep_for: float | None,
) -> float:
    start = time.perf_counter()
    if done():
        return 0.0
    watch = liveness.current()
    solo_start = watch.solo_seconds() if watch is not None else 0.0
    timeout = default_timeout() if timeout is None else check_timeout(timeout)
    default_spin, cap = _poll_params()
    spin = default_spin if spin is None else spin
    low = cap if max_sleep is None else min(cap, max(_MIN_SLEEP_S, max_sleep))
    lift = float("inf") if max_sleep_for is None else max_sleep_for
    since, seen = start, activity() if activity is not None else 0
    while True:
        if done():
            return time.perf_counter() - start
        now = time.perf_counter()
        if activity is not None:
            current = activity()
            if current != seen:
                since, seen = now, current
        idle = now - since
        if idle >= spin:
            if watch is not None and watch.failure is not None:
                raise watch.failure
            if now - start >= timeout and (
                watch is None
                or now - start - (watch.solo_seconds() - solo_start) >= timeout
            ):
                rank = MPI.COMM_WORLD.Get_rank() if MPI.Is_initialized() else -1
                raise CommTimeoutError(
                    f"rank {rank}: {what} did not complete within {timeout:g} s "
                    "(raise HYBRIDAGG_TIMEOUT if the peer is legitimately slow)"
                )
            limit = low if idle < lift else cap
            time.sleep(min(limit, max(_MIN_SLEEP_S, idle * _BACKOFF_FRACTION)))


def wait(
    requests: MPI.Request | Sequence[MPI.Request],
    *,
    what: str,
    timeout: float | None = None,
    poll: Callable[[], object] | None = None,
) -> float:
    """Complete one or several MPI requests through :func:`wait_until`.

    With several requests, each one that completes counts as activity, so a
    train of messages that arrive one after another (the parts of a
    parameter-server reply) is received at full speed, not one per back-off
    sleep: MPI moves a large message only inside the receiver's test calls.

    Args:
        requests: A request or a sequence of requests.
        what: Operation and peer or group, for the timeout message.
        timeout: Seconds (default ``HYBRIDAGG_TIMEOUT``).
        poll: Called before every test: a service this rank keeps answering
            while it waits (server 0's chunk counter).

    Returns:
        Seconds waited.
    """
    reqs = [requests] if isinstance(requests, MPI.Request) else list(requests)
    if not reqs:
        return 0.0
    completed = [0]
    activity = None
    if len(reqs) == 1:
        test = reqs[0].Test
    else:

        def test() -> bool:
            index = MPI.Request.Testsome(reqs)
            if index:
                completed[0] += len(index)
            return all(r == MPI.REQUEST_NULL for r in reqs)

        activity = lambda: completed[0]  # noqa: E731
    done = test
    if poll is not None:

        def done() -> bool:
            poll()
            return bool(test())

    return wait_until(done, what=what, timeout=timeout, activity=activity)
