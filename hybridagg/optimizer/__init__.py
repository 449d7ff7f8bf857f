"""The user-facing optimizer: a factory over its synchronous and server-backed
implementations, and the broadcasts that start a job from one set of weights."""

from .backends import init_torch_distributed
from .base import DistributedOptimizer
from .broadcast import broadcast_optimizer_state, broadcast_parameters
from .server import ServerOptimizer
from .sync import SyncOptimizer

__all__ = [
    "DistributedOptimizer",
    "ServerOptimizer",
    "SyncOptimizer",
    "broadcast_optimizer_state",
    "broadcast_parameters",
    "init_torch_distributed",
]
