"""The former home of ``hybridagg train``'s options, kept as an alias.

``bench/ddp_train.py`` still imports :class:`TrainConfig` from here. New code
imports :mod:`hybridagg.train.config` (the configuration) and
:mod:`hybridagg.train.flags` (its command line); this module goes once
nothing imports it.
"""

from __future__ import annotations

from .config import OPTIMIZERS, TrainConfig
from .flags import add_arguments, config_from_args

__all__ = ["OPTIMIZERS", "TrainConfig", "add_arguments", "config_from_args"]
