"""Training driver: ``hybridagg train`` and its parts.

:func:`train` runs a job on every rank; :class:`TrainConfig` (``config/``) holds and checks
its options, ``flags`` makes the command line from it; ``models``, ``emulation``, ``metrics``, ``checkpoint`` and
``evaluate`` are the pieces it wires together; ``resume`` decides whether a run starts
fresh or resumes, and from which checkpoint. The configuration is pure and
imported eagerly; :func:`train` (torch, MPI) on first use.
"""

from __future__ import annotations

from typing import Any

from .config import TrainConfig

__all__ = ["TrainConfig", "train"]


def __getattr__(name: str) -> Any:
    if name != "train":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from .driver import train

    globals()["train"] = train
    return train
