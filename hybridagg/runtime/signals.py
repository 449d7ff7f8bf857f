"""Stop requests from the batch system: SIGTERM and SIGUSR1 set a flag.

Slurm sends a signal before a job's time limit (``--signal``) and SIGTERM
when it ends a job; ``hybridagg train`` turns either into a checkpoint and a
clean stop. The handlers are installed first thing by the command line,
before torch is imported (several seconds), so an early warning is not lost.
This module imports nothing heavy.
"""

from __future__ import annotations

import signal
import threading

__all__ = ["stop_flag"]

_FLAG: threading.Event | None = None


def stop_flag() -> threading.Event:
    """The process's stop flag, installing the handlers on first use (main thread)."""
    global _FLAG
    if _FLAG is None:
        _FLAG = threading.Event()
        flag = _FLAG

        def handler(signum, frame) -> None:
            flag.set()

        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGUSR1):
                signal.signal(sig, handler)
    return _FLAG
