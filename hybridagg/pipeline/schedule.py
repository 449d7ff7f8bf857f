"""The order in which one pipeline stage runs its micro-batches (pure logic).

A pipelined group holds consecutive stages of one model replica on its
ranks; a batch is cut into micro-batches that flow forward through the
stages and whose gradients flow back. Each stage runs a list of
:class:`Action` s, forward (``"F"``) or backward (``"B"``) of one
micro-batch; every stage of a group uses the same schedule, so the
messages between neighbours match in order.

``gpipe``
    Every forward, then every backward (Huang et al., 2019). Stage ``s``
    holds the activations of all ``M`` micro-batches at once.
``1f1b``
    One forward, one backward (PipeDream-Flush, Narayanan et al., 2021):
    stage ``s`` of ``S`` runs ``min(S - s - 1, M)`` forwards to fill the
    pipeline, then alternates, then drains the backwards. The same bubble
    as GPipe, but a stage holds at most ``S - s`` micro-batches'
    activations.

Backwards run in the order of their forwards on every stage, so a stage
receives the gradients of its outputs in the order it sent the outputs.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["SCHEDULES", "Action", "schedule"]

SCHEDULES = ("1f1b", "gpipe")
"""The schedules :func:`schedule` knows."""


@dataclass(frozen=True)
class Action:
    """One step of a stage: forward or backward of one micro-batch."""

    kind: str
    """``"F"`` (forward) or ``"B"`` (backward)"""
    micro: int
    """the micro-batch, ``0..M-1``"""


def schedule(name: str, stage: int, stages: int, micro_batches: int) -> list[Action]:
    """The actions of ``stage`` (of ``stages``) over ``micro_batches`` micro-batches.

    Args:
        name: ``"1f1b"`` or ``"gpipe"``.
        stage: This stage, ``0..stages-1``.
        stages: Stages of the pipeline (1: no pipeline, F then B per micro-batch).
        micro_batches: Micro-batches of the batch (0: nothing to do).

    Raises:
        ValueError: An unknown schedule, or a stage outside ``0..stages-1``.
        TypeError: A count is not an int.
    """
    for label, v in (
        ("stage", stage),
        ("stages", stages),
        ("micro_batches", micro_batches),
    ):
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"{label} must be an int, got {v!r}")
    if name not in SCHEDULES:
        raise ValueError(
            f"unknown pipeline schedule {name!r}; choose from {', '.join(SCHEDULES)}"
        )
    if stages < 1:
        raise ValueError(f"stages must be >= 1, got {stages}")
    if not 0 <= stage < stages:
        raise ValueError(f"stage must be in 0..{stages - 1}, got {stage}")
    if micro_batches < 0:
        raise ValueError(f"micro_batches must be >= 0, got {micro_batches}")
    m = micro_batches
    if name == "gpipe":
        return [Action("F", i) for i in range(m)] + [Action("B", i) for i in range(m)]
    warm = min(stages - stage - 1, m)
    out = [Action("F", i) for i in range(warm)]
    for i in range(m - warm):
        out += [Action("F", warm + i), Action("B", i)]
    out += [Action("B", i) for i in range(m - warm, m)]
    return out
