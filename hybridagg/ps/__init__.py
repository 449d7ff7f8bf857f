"""The sharded parameter server of the hybrid and async modes.

The compensation rules are pure logic and imported eagerly; the server itself
(:func:`serve`, :class:`ServerStats`) loads torch and MPI, so it is imported
on first use: the training configuration reads ``DAMPING_RULES`` from
:mod:`hybridagg.ps.compensation` without paying for either.
"""

from __future__ import annotations

import importlib
from typing import Any

from .compensation import Compensation, damping, lr_scale
from .sizing import ServerSizing, servers_needed

__all__ = [
    "Compensation",
    "ServerSizing",
    "ServerStats",
    "damping",
    "lr_scale",
    "serve",
    "servers_needed",
]

_LAZY = {"ServerStats": ".server", "serve": ".server"}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
