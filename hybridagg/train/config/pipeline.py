"""Pipelined groups: which groups hold stages of one replica, and how they run (pure logic)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ...pipeline.groups import parse_pipeline_groups
from ...pipeline.schedule import SCHEDULES
from .aggregation import HOW
from .fields import Concern, option

__all__ = [
    "PARTITIONS",
    "PIPELINE_INCOMPATIBLE",
    "PIPELINE_INITS",
    "SCHEDULE_NAMES",
    "PipelineOptions",
    "parse_pipeline_groups",
]

# the schedules the stage executor runs (hybridagg.pipeline imports its torch
# executors lazily, so reading them here costs nothing)
SCHEDULE_NAMES = SCHEDULES
PARTITIONS = ("auto", "even")
PIPELINE_INITS = ("seed", "meta")

# Options a job with pipelined groups refuses, and why: each names what the
# pipelined step does not carry yet, so a user learns it at once, never by a
# run that ignores the option.
PIPELINE_INCOMPATIBLE: dict[str, str] = {
    "checkpoint": "checkpoints (a stage's part of a cut)",
    "adaptive_groups": "adaptive groups",
    "overlap": "--overlap",
    "stream_push": "--stream-push",
    "save_model": "--save-model (no rank holds the whole model)",
    "tensorboard": "TensorBoard",
    "chunk_counter": "--chunk-counter (the stages' loader draws from a window)",
}


@dataclass(frozen=True, kw_only=True)
class PipelineOptions(Concern):
    """Model parallelism inside groups: pipelined stages over micro-batches."""

    help_group: ClassVar[str] = HOW

    pipeline_groups: str | None = None
    """groups whose ranks hold consecutive stages of one model replica (all,
    or indices such as 0,2); the other groups must be one rank each, holding
    a whole replica; across groups, data parallel as --mode says"""

    micro_batches: int = option(4, at_least=1)
    """micro-batches per step of a pipelined group (a batch that does not
    divide evenly is cut as torch.tensor_split cuts it)"""

    pipeline_schedule: str = option("1f1b", choices=SCHEDULE_NAMES)
    """the order of a stage's forwards and backwards: 1f1b (at most as many
    activations held as stages) or gpipe (every forward, then every backward)"""

    pipeline_partition: str = option("auto", choices=PARTITIONS)
    """where the stages cut the model: auto (the exact dynamic program over
    per-layer costs measured at start-up, each rank's --slowdown speed, the
    activations' sizes and the links between neighbouring stages, measured
    at start-up) or even (the compute shared equally, blind to the ranks'
    speeds and the links)"""

    pipeline_init: str = option("seed", choices=PIPELINE_INITS)
    """how the ranks get their weights: seed (every rank builds the whole
    model from --seed, so the job starts from a whole replica's weights,
    then keeps its stage) or meta (the model is built on the meta device,
    without memory, and each rank makes and initialises only its own units,
    from --seed and each unit's index: no rank ever holds the whole model;
    the weights follow the same distributions, not the same values)"""

    def _check(self) -> None:
        spec = self.pipeline_groups
        if spec is not None and not spec.strip():
            raise ValueError("--pipeline-groups must name groups (or all)")

    @property
    def pipelined(self) -> bool:
        """Whether any group is a pipeline."""
        return self.pipeline_groups is not None
