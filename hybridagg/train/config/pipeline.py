"""Pipelined groups: which groups hold stages of one replica, and how they run (pure logic)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

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

# hybridagg.pipeline.SCHEDULES, which imports torch (tests/test_train_pipeline.py
# checks that the two agree)
SCHEDULE_NAMES = ("1f1b", "gpipe")
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
}


def parse_pipeline_groups(spec: str | None, num_groups: int) -> tuple[int, ...]:
    """The groups ``--pipeline-groups`` names, ascending.

    Args:
        spec: ``all``, or group indices separated by commas (``0,2``);
            ``None``: none.
        num_groups: The job's groups.

    Raises:
        ValueError: An index that is not a group of the job, a repeated one,
            or a malformed spec.
    """
    if spec is None:
        return ()
    text = spec.strip()
    if text == "all":
        return tuple(range(num_groups))
    try:
        picked = [int(part) for part in text.split(",")]
    except ValueError:
        raise ValueError(
            f"--pipeline-groups takes 'all' or group indices like 0,2; got {spec!r}"
        ) from None
    if len(set(picked)) != len(picked):
        raise ValueError(f"--pipeline-groups repeats a group: {spec!r}")
    bad = [g for g in picked if not 0 <= g < num_groups]
    if bad:
        raise ValueError(
            f"--pipeline-groups names group(s) {bad}; the job has groups "
            f"0-{num_groups - 1}"
        )
    return tuple(sorted(picked))


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
