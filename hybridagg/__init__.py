"""hybridagg: hybrid synchronous/asynchronous aggregation for heterogeneous clusters.

Ranks are split into homogeneous groups that all-reduce synchronously; group
leaders meet at a sharded parameter server asynchronously. See
``docs/architecture.md`` for the layers.

Submodules are imported lazily, so ``import hybridagg`` stays cheap and does
not initialise MPI until something that needs it is used.
"""

from __future__ import annotations

import importlib
from typing import Any

from .version import __version__

_LAZY = {
    "init": "hybridagg.topology",
    "current_topology": "hybridagg.topology",
    "Topology": "hybridagg.topology",
    "DistributedOptimizer": "hybridagg.optimizer",
    "broadcast_parameters": "hybridagg.optimizer",
    "broadcast_optimizer_state": "hybridagg.optimizer",
    "allreduce": "hybridagg.ops",
    "allreduce_": "hybridagg.ops",
    "allgather": "hybridagg.ops",
    "allreduce_async_": "hybridagg.ops",
    "synchronize": "hybridagg.ops",
    "broadcast": "hybridagg.ops",
    "broadcast_": "hybridagg.ops",
    "serve": "hybridagg.ps.server",
    "Compensation": "hybridagg.ps.compensation",
    "Comm": "hybridagg.comm",
    "CommTimeoutError": "hybridagg.comm",
    "RemoteError": "hybridagg.comm",
    "configure_threads": "hybridagg.comm",
    "install_abort_hook": "hybridagg.comm",
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'hybridagg' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
