"""Model parallelism inside a group: stages, their partition and schedule.

A pipelined group holds consecutive stages of one model replica on its
ranks (Ling et al., IEEE TPDS 2024): :mod:`.schedule` orders each stage's
micro-batches (1F1B or GPipe), :mod:`.partition` chooses the stage
boundaries from per-layer compute, each rank's speed, activation sizes and
the link, and :mod:`.stage` runs one rank's stage over MPI point-to-point
through hybridagg's polled waits.
"""

from .crossgroup import CrossGroupReducer, holders, segments
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
from .stage import (
    PipelineStage,
    StagePace,
    StepTimes,
    layer_costs,
    model_layers,
    split_layers,
)
from .timing import batch_time, micro_sizes

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
