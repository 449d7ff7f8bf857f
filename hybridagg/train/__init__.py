"""Training driver: ``hybridagg train`` and its parts.

:func:`train` runs a job on every rank; :class:`TrainConfig` holds and checks
its options; ``models``, ``emulation``, ``metrics``, ``checkpoint`` and
``evaluate`` are the pieces it wires together.
"""

from .driver import train
from .options import TrainConfig

__all__ = ["TrainConfig", "train"]
