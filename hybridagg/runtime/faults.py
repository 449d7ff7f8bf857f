"""Fault injection for tests: ``HYBRIDAGG_FAULT=kill:R:N`` SIGKILLs rank R at its N-th step.

A worker counts its steps, a server its updates (the server's version). The
kill is a real ``SIGKILL`` of the process: no handler runs, no file is
closed, no MPI call is made, as when a node dies. (``checkpoint:N:R``, the
other kind, is read by :mod:`hybridagg.train.checkpoint`.)
"""

from __future__ import annotations

import os
import signal

from . import envvars

__all__ = ["kill_at", "parse_kill"]


def parse_kill(spec: str | None) -> tuple[int, int] | None:
    """``(rank, n)`` of a ``kill:R:N`` spec; ``None`` for no spec or another kind.

    Raises:
        ValueError: A ``kill:`` spec that is not ``kill:R:N`` with ``R >= 0``
            and ``N >= 1``.
    """
    if not spec or not spec.startswith("kill:"):
        return None
    parts = spec.split(":")
    try:
        if len(parts) != 3:
            raise ValueError
        rank, n = int(parts[1]), int(parts[2])
    except ValueError:
        raise ValueError(
            f"HYBRIDAGG_FAULT={spec!r}: expected kill:RANK:N (integers)"
        ) from None
    if rank < 0 or n < 1:
        raise ValueError(f"HYBRIDAGG_FAULT={spec!r}: RANK must be >= 0 and N >= 1")
    return rank, n


def kill_at(rank: int, count: int) -> None:
    """SIGKILL this process if ``HYBRIDAGG_FAULT`` names ``rank`` at ``count``."""
    target = parse_kill(envvars.get_str("HYBRIDAGG_FAULT"))
    if target is not None and target == (rank, count):
        os.kill(os.getpid(), signal.SIGKILL)
