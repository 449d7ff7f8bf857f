"""Test-only fault injection for the training loop (``HYBRIDAGG_FAULT``).

A test makes a worker die (``kill:N:R``, SIGKILL: no clean-up, no message)
or get stuck while alive (``stop:N:R``, SIGSTOP) at its step ``N``, or
makes rank 0's validation slow (``slow-validation:S``), to check that the
job notices within its deadlines. (``checkpoint:N:R`` is read by
:mod:`hybridagg.train.checkpoint`.) Nothing happens when the variable is
unset, which is always the case outside tests.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable

from ..runtime import envvars

__all__ = ["at_step", "parse_fault", "slow_validation"]

_SIGNALS = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP}


def parse_fault(spec: str | None) -> tuple[str, tuple[float, ...]] | None:
    """``"kill:5:3"`` -> ``("kill", (5.0, 3.0))``; ``None`` for an empty spec.

    Raises:
        ValueError: The spec is malformed (names the variable).
    """
    if not spec:
        return None
    kind, *args = spec.split(":")
    try:
        values = tuple(float(a) for a in args)
    except ValueError:
        raise ValueError(
            f"HYBRIDAGG_FAULT={spec!r}: arguments must be numbers"
        ) from None
    want = {"checkpoint": 2, "kill": 2, "stop": 2, "slow-validation": 1}
    if kind not in want or len(values) != want[kind]:
        raise ValueError(
            f"HYBRIDAGG_FAULT={spec!r}: expected checkpoint:N:R, kill:N:R, "
            "stop:N:R or slow-validation:S"
        )
    return kind, values


def at_step(rank: int) -> Callable[[int], None] | None:
    """The injection of ``kill:N:R`` or ``stop:N:R`` for worker ``rank``, if any.

    Returns:
        ``None`` (nothing to inject here), or a function of the step count
        that signals this process when it reaches ``N``.
    """
    fault = parse_fault(envvars.get_str("HYBRIDAGG_FAULT"))
    if fault is None or fault[0] not in _SIGNALS or int(fault[1][1]) != rank:
        return None
    when, sig = int(fault[1][0]), _SIGNALS[fault[0]]

    def inject(step: int) -> None:
        if step == when:
            # the test measures from this line's time to the job's end
            sys.stderr.write(
                f"HYBRIDAGG_FAULT: rank {rank} {fault[0]} at step {step} "
                f"at {time.time():.3f}\n"
            )
            sys.stderr.flush()
            os.kill(os.getpid(), sig)

    return inject


def slow_validation() -> None:
    """Injects ``slow-validation:S``: sleeps ``S`` seconds (rank 0's validation)."""
    fault = parse_fault(envvars.get_str("HYBRIDAGG_FAULT"))
    if fault is not None and fault[0] == "slow-validation":
        time.sleep(fault[1][0])
