"""The sharded parameter server of the hybrid and async modes."""

from .compensation import Compensation, damping, lr_scale
from .server import ServerStats, serve

__all__ = ["Compensation", "ServerStats", "damping", "lr_scale", "serve"]
