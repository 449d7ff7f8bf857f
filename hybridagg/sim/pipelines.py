"""Pipelined groups in a simulation: their cut and their step (pure logic).

A group named by ``--pipeline-groups`` holds consecutive stages of one
model replica on its ranks, as in ``hybridagg train``
(:mod:`hybridagg.train.pipelined`): the profile's pipeline units
(:attr:`~.profile.Profile.units`, the units a run cuts) are split among
the ranks in order, by the exact dynamic program over each unit's time,
each rank's speed, the bytes crossing each boundary and the link between
neighbouring stages (``--pipeline-partition auto``) or evenly by compute
(``even``), the run's own :mod:`hybridagg.pipeline.partition` on the
simulation's numbers. The group trains ``--batch-size`` samples a step in
``--micro-batches`` micro-batches; its step is the schedule's exact event
simulation (:func:`hybridagg.pipeline.batch_time`): a stage's compute is
its units' share of the whole model's time on its rank (the run's pacing
rule), and a message over a boundary costs the link's latency plus its
bytes over the link's bandwidth, on the receiver. In hybrid mode each
stage exchanges only its own units' part with the servers; the servers
count one update per group step.

What this leaves to a run: the stages' messages do not contend with other
traffic on their links, and compute that executes on shared cores is not
stretched by the other ranks there (a pipelined job is paced by
``--sample-ms`` here, which sleeps).
"""

from __future__ import annotations

import itertools
import math
from typing import Any

from ..pipeline import (
    FORWARD_SHARE,
    Link,
    batch_time,
    best_partition,
    even_partition,
    micro_sizes,
)
from ..pipeline.groups import layout_conflicts, parse_pipeline_groups

__all__ = ["pipeline_groups", "pipeline_spec", "pipeline_step_seconds"]


def pipeline_groups(spec: str | None, groups: list[list[int]]) -> tuple[int, ...]:
    """The groups ``--pipeline-groups`` names (``all``, or indices like ``0,2``),
    checked as a run checks them (:mod:`hybridagg.pipeline.groups`): each
    named group has two ranks or more and every other group is one rank.

    Raises:
        ValueError: A malformed spec, an index that is not a group, a
            repeated one, a named group of one rank, or an unnamed group of
            several.
    """
    named = parse_pipeline_groups(spec, len(groups))
    if not named:
        return ()
    lone, wide = layout_conflicts(groups, named)
    if lone:
        raise ValueError(
            f"--pipeline-groups names group(s) {lone} of one rank: a pipeline "
            "needs two ranks or more"
        )
    if wide:
        raise ValueError(
            f"group(s) {wide} have several ranks but are not pipelines: with "
            "--pipeline-groups every other group is one rank holding a whole replica"
        )
    return named


def pipeline_spec(
    *,
    ranks: list[int],
    units: list[dict[str, float]],
    seconds: list[float],
    speeds: list[float],
    model_seconds: float,
    links: list[tuple[float, float]],
    batch: int,
    micro_batches: int,
    schedule: str,
    partition: str,
    wire_bytes: float,
) -> dict[str, Any]:
    """One pipelined group's cut and what its step needs (plain values).

    Args:
        ranks: The group's ranks, stage order.
        units: The profile's units (``cost``, ``parameters``, ``output_bytes``).
        seconds: Each rank's seconds per sample of the whole model at the
            run's start (its speed and slowdown in it): what paces its stage.
        speeds: Each rank's speed as the run's cut sees it (``1 /`` its
            ``--slowdown`` factor at the start).
        model_seconds: The whole model's seconds per sample the run's cut
            weighs links against (``--sample-ms``, or the ranks' measured
            median).
        links: ``(latency_s, bandwidth_Bps)`` between neighbouring stages.
        batch: Samples per group step (``--batch-size``).
        micro_batches: ``--micro-batches``.
        schedule: ``--pipeline-schedule``.
        partition: ``--pipeline-partition`` (``auto`` or ``even``).
        wire_bytes: Bytes per parameter on the wire.

    Raises:
        ValueError: More stages than units.
    """
    stages = len(ranks)
    if stages > len(units):
        raise ValueError(
            f"a pipelined group of {stages} ranks needs {stages} pipeline units; "
            f"the profile's model has {len(units)}"
        )
    raw = [u["cost"] for u in units]
    total = sum(raw)
    shares = [c / total for c in raw]
    sizes = [u["output_bytes"] for u in units[:-1]]
    if partition == "even":
        bounds = even_partition(raw, stages)  # (the run's raw costs: its ties)
    else:
        scale = model_seconds / total  # (the run's scale, in its order)
        costs = [c * scale for c in raw]
        hops = [Link(latency_s=lat, bandwidth_Bps=bw) for lat, bw in links]
        micro = max(1, -(-batch // micro_batches))
        bounds = best_partition(costs, speeds, sizes, hops, micro).bounds
    cut = list(bounds)
    params = [
        sum(u["parameters"] for u in units[a:b]) for a, b in itertools.pairwise(cut)
    ]
    return {
        "ranks": list(ranks),
        "seconds": list(seconds),
        "bounds": cut,
        "shares": [sum(shares[a:b]) for a, b in itertools.pairwise(cut)],
        "boundary_bytes": [units[b - 1]["output_bytes"] for b in cut[1:-1]],
        "links": [list(link) for link in links],
        "parts": [p * wire_bytes for p in params],
        "parameters": params,
        "micro": micro_sizes(batch, micro_batches),
        "schedule": schedule,
    }


def pipeline_step_seconds(spec: dict[str, Any]) -> float:
    """Seconds of one step of a pipelined group (see the module): each stage
    paced by its rank's time per sample at the start, as a run paces it.

    Args:
        spec: The group's :func:`pipeline_spec`.
    """
    compute = [
        share * s for share, s in zip(spec["shares"], spec["seconds"], strict=True)
    ]
    # (the forward's share of a stage's time: the run's pacing rule)
    forward = [FORWARD_SHARE * c for c in compute]
    backward = [c - f for c, f in zip(compute, forward, strict=True)]
    comm = [
        (float(lat), nbytes / float(bw) if math.isfinite(bw) else 0.0)
        for (lat, bw), nbytes in zip(spec["links"], spec["boundary_bytes"], strict=True)
    ]
    return batch_time(forward, backward, comm, spec["micro"], spec["schedule"])
