"""Model parallelism inside a group: stages, their partition and schedule.

A pipelined group holds consecutive stages of one model replica on its
ranks (Ling et al., IEEE TPDS 2024): :mod:`.schedule` orders each stage's
micro-batches (1F1B or GPipe), :mod:`.partition` chooses the stage
boundaries from per-layer compute, each rank's speed, activation sizes and
the link, and :mod:`.stage` runs one rank's stage over MPI point-to-point
through hybridagg's polled waits.

The pure modules (partition, schedule, timing) are imported here; the
executors that need torch and MPI (:mod:`.stage`, :mod:`.crossgroup`) on
first use, so the simulator and the planner (whose engine runs in a process
without MPI) can cost a pipeline without initialising either.
"""

from __future__ import annotations

import importlib
from typing import Any

from .partition import (
    FORWARD_SHARE,
    Link,
    Partition,
    analytic_cut,
    best_partition,
    brute_force_partition,
    continuous_bottleneck,
    even_partition,
    stage_times,
    timing_inputs,
)
from .schedule import SCHEDULES, Action, schedule
from .timing import batch_time, micro_sizes

_LAZY = {
    "CrossGroupReducer": "hybridagg.pipeline.crossgroup",
    "holders": "hybridagg.pipeline.crossgroup",
    "segments": "hybridagg.pipeline.crossgroup",
    "PipelineStage": "hybridagg.pipeline.stage",
    "StagePace": "hybridagg.pipeline.stage",
    "StepTimes": "hybridagg.pipeline.stage",
    "layer_costs": "hybridagg.pipeline.stage",
    "model_layers": "hybridagg.pipeline.stage",
    "split_layers": "hybridagg.pipeline.stage",
}

__all__ = [
    "FORWARD_SHARE",
    "SCHEDULES",
    "Action",
    "CrossGroupReducer",
    "Link",
    "Partition",
    "PipelineStage",
    "StagePace",
    "StepTimes",
    "analytic_cut",
    "batch_time",
    "best_partition",
    "brute_force_partition",
    "continuous_bottleneck",
    "even_partition",
    "holders",
    "layer_costs",
    "micro_sizes",
    "model_layers",
    "schedule",
    "segments",
    "split_layers",
    "stage_times",
    "timing_inputs",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
