"""Building a pipelined job's stage on each rank: layers, cuts, pace.

Every rank builds the whole model from the run's seed (so every group
starts from the same weights), cuts it into pipeline units, measures each
unit's floating-point operations and output size on one sample
(:func:`plan_units`), then chooses every group's stage bounds from those,
the ranks' speeds and the links measured between neighbouring stages (the
same on every rank: the same inputs and a deterministic program), keeps
its own stage's layers and lets the rest go (:func:`cut_stage`).
Building the whole model first is what lets every rank compute every
group's cut; a model too large for one rank's memory would need a
meta-device build, which this does not do yet.

A unit is a layer with parameters plus the parameter-free layers after it
(activations, flatten): every stage then owns a part of the flat model,
which is what it exchanges with the servers or sums across groups.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import nn

from ...pipeline import (
    FORWARD_SHARE,
    Link,
    StagePace,
    best_partition,
    even_partition,
    layer_costs,
    model_layers,
)
from ..config import TrainConfig
from ..pacing import module_costs
from .layout import PipelineLayout
from .meta import check_meta_model, materialize_unit

__all__ = [
    "StageBuild",
    "UnitPlan",
    "build_stage",
    "cut_stage",
    "measure_model_seconds",
    "partition_seconds",
    "pipeline_units",
    "plan_units",
    "times_the_model",
]


def pipeline_units(layers: list[nn.Module]) -> list[list[int]]:
    """Indices of the layers in each unit: a layer with parameters and the
    parameter-free layers after it (those before the first join it).

    Raises:
        ValueError: No layer has parameters.
    """
    units: list[list[int]] = []
    leading: list[int] = []
    for i, layer in enumerate(layers):
        has = any(True for _ in layer.parameters())
        if has:
            units.append([*leading, i])
            leading = []
        elif units:
            units[-1].append(i)
        else:
            leading.append(i)
    if not units:
        raise ValueError("a pipelined model needs a layer with parameters")
    return units


@dataclass
class StageBuild:
    """This rank's stage and what every rank agreed about the job's cuts.

    Attributes:
        module: This rank's layers.
        units: The model's units (each an ``nn.Sequential``); the units this
            rank does not hold are left empty, so it keeps only its layers.
        group_bounds: Every group's stage bounds over the units.
        unit_seconds: Each unit's cost (floating-point operations on one
            sample; parameters where none is counted), the partition's input.
        unit_numels: Parameters of each unit.
        pace: This stage's emulated compute (``None``: not paced).
        share: This stage's part of the model's cost.
    """

    module: nn.Sequential
    units: list[nn.Sequential]
    group_bounds: list[tuple[int, ...]]
    unit_seconds: list[float]
    unit_numels: list[int]
    pace: StagePace | None
    share: float


def _check_model(model: nn.Module) -> None:
    floating = [n for n, b in model.named_buffers() if b.is_floating_point()]
    if floating:
        raise ValueError(
            "--pipeline-groups needs a model without floating buffers (BatchNorm's "
            f"running statistics travel with the whole model); this one has {floating[:3]}"
        )
    params = [p for layer in model_layers(model) for p in layer.parameters()]
    if len({id(p) for p in params}) != len(params):
        raise ValueError(
            "--pipeline-groups needs a model whose pipeline layers share no "
            "parameter (tied weights would live on two stages)"
        )
    outside = {id(p) for p in model.parameters()} - {id(p) for p in params}
    if outside:
        raise ValueError(
            f"{len(outside)} of the model's parameters lie in none of its pipeline "
            "layers: no stage would train them"
        )


def measure_model_seconds(model: nn.Module, sample: torch.Tensor, n: int = 32) -> float:
    """Seconds per sample of the whole model's forward and backward here (best of 3)."""
    batch = sample.expand(n, *sample.shape[1:]).contiguous()
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        model(batch).float().sum().backward()
        best = min(best, time.perf_counter() - t0)
    model.zero_grad(set_to_none=True)
    return best / n


@dataclass
class UnitPlan:
    """The model cut into units, and what the partition needs of each.

    Attributes:
        model: The whole model, built from the run's seed.
        units: Each unit as an ``nn.Sequential`` of the model's layers.
        flops: Each unit's floating-point operations on one sample
            (parameters where none is counted).
        numels: Parameters of each unit.
        sizes: Bytes per sample crossing each boundary between units.
        sample: One zero sample (with its batch dimension).
    """

    model: nn.Module
    units: list[nn.Sequential]
    flops: list[float]
    numels: list[int]
    sizes: list[float]
    sample: torch.Tensor

    @property
    def meta(self) -> bool:
        """Whether the model is on the meta device (``--pipeline-init meta``)."""
        return any(p.is_meta for p in self.model.parameters())


def plan_units(model: nn.Module, sample_shape: tuple[int, ...]) -> UnitPlan:
    """Cut ``model`` into units and measure them on one sample (local, deterministic).

    Raises:
        ValueError: A model the job cannot pipeline.
    """
    _check_model(model)
    layers = model_layers(model)
    device = next(model.parameters()).device
    if device.type == "meta":
        check_meta_model(model, layers)
    index = pipeline_units(layers)
    units = [nn.Sequential(*(layers[i] for i in unit)) for unit in index]
    sample = torch.zeros((1, *sample_shape), device=device)
    flops = layer_costs(model, module_costs(model, sample))
    numels = [sum(p.numel() for p in u.parameters()) for u in units]
    seconds = [sum(flops[i] for i in unit) for unit in index]
    if not any(s > 0 for s in seconds):
        seconds = [float(n) for n in numels]  # (no counted operation: by size)
    # per sample, what crosses each boundary (the partition's messages)
    sizes = []
    with torch.no_grad():
        x = sample
        for i, unit in enumerate(units[:-1]):
            try:
                x = unit(x)
            except (RuntimeError, ValueError, TypeError, IndexError) as exc:
                # (the whole forward fits: the pipeline layers do not compose)
                reason = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
                raise ValueError(
                    f"the model's pipeline layers do not compose: unit {i} "
                    f"({type(unit[0]).__name__}) cannot take "
                    + ("one sample" if i == 0 else f"unit {i - 1}'s output")
                    + f" of shape {tuple(x.shape)}: {type(exc).__name__}: {reason}"
                ) from None
            sizes.append(float(x.numel() * x.element_size()))
    return UnitPlan(model, units, seconds, numels, sizes, sample)


def times_the_model(cfg: TrainConfig) -> bool:
    """Whether the start-up probe times the whole model on every rank: the
    cut weighs links (``auto``), ``--sample-ms`` does not give the time, and
    every rank holds the whole model (``--pipeline-init seed``)."""
    return (
        cfg.pipeline_partition == "auto"
        and cfg.sample_ms <= 0
        and cfg.pipeline_init == "seed"
    )


def partition_seconds(cfg: TrainConfig, measured: float | None) -> float | None:
    """The whole model's seconds per sample the cut weighs links against.

    ``--sample-ms`` when given (every rank knows it); else ``measured``, a
    time every rank agreed on; ``None`` when neither (the cut then takes
    the links as free: compute in operations has no common unit with them).
    """
    if cfg.sample_ms > 0:
        return cfg.sample_ms / 1000.0
    return measured


def cut_stage(
    cfg: TrainConfig,
    layout: PipelineLayout,
    rank: int,
    plan: UnitPlan,
    *,
    links: dict[int, list[Link]] | None = None,
    seconds_per_sample: float | None = None,
) -> StageBuild:
    """Every group's bounds over ``plan``'s units, and this rank's stage.

    Args:
        cfg: The run's options (partition, --slowdown, --sample-ms,
            --batch-size, --micro-batches).
        layout: The job's groups.
        rank: This worker's world rank.
        plan: The units (:func:`plan_units`).
        links: Each pipelined group's links between neighbouring stages
            (:func:`hybridagg.pipeline.probe.neighbour_links`), by group
            index; ``None`` or a group left out: free links.
        seconds_per_sample: The whole model's agreed seconds per sample
            (:func:`partition_seconds`), which puts compute and links in
            one unit; ``None``: links are not weighed.

    Raises:
        ValueError: A group with more stages than the model has units.
    """
    units, seconds, sizes = plan.units, plan.flops, plan.sizes
    slowdown = cfg.parsed_slowdown()
    micro = max(1, -(-cfg.batch_size // cfg.micro_batches))
    scale = None if seconds_per_sample is None else seconds_per_sample / sum(seconds)
    bounds = []
    for g, ranks in enumerate(layout.groups):
        if len(ranks) > len(units):
            raise ValueError(
                f"group {g} has {len(ranks)} ranks but model {cfg.model!r} has "
                f"only {len(units)} pipeline units (layers with parameters)"
            )
        if len(ranks) == 1:
            bounds.append((0, len(units)))
        elif cfg.pipeline_partition == "even":
            bounds.append(tuple(even_partition(seconds, len(ranks))))
        else:
            speeds = [1.0 / slowdown.factor(r) for r in ranks]
            link: Link | list[Link] = Link()
            costs = seconds
            if scale is not None and links and g in links:
                link, costs = links[g], [f * scale for f in seconds]
            part = best_partition(costs, speeds, sizes, link, micro)
            bounds.append(tuple(part.bounds))
    g, k = layout.group_of(rank), layout.stage_of(rank)
    lo, hi = bounds[g][k], bounds[g][k + 1]
    if plan.meta:  # this rank's units only get memory and weights
        for i in range(lo, hi):
            materialize_unit(units[i], cfg.seed, i)
    share = sum(seconds[lo:hi]) / sum(seconds)
    pace = None
    if cfg.sample_ms > 0 or slowdown.factor(rank) != 1.0:
        # --sample-ms is the whole model's time per sample; without it, the
        # real time measured here, stretched by the factor (as a whole
        # replica's pacer stretches its measured step)
        base = (
            cfg.sample_ms / 1000.0
            if cfg.sample_ms > 0
            else measure_model_seconds(plan.model, plan.sample)
        )
        per_sample = base * share * slowdown.factor(rank)
        forward = FORWARD_SHARE * per_sample
        pace = StagePace(forward_s=forward, backward_s=per_sample - forward)
    return StageBuild(
        module=nn.Sequential(*units[lo:hi]),
        # (the other units' layers are let go with the model)
        units=[u if lo <= i < hi else nn.Sequential() for i, u in enumerate(units)],
        group_bounds=bounds,
        unit_seconds=seconds,
        unit_numels=plan.numels,
        pace=pace,
        share=share,
    )


def build_stage(
    cfg: TrainConfig,
    layout: PipelineLayout,
    rank: int,
    model: nn.Module,
    sample_shape: tuple[int, ...],
) -> StageBuild:
    """:func:`plan_units` then :func:`cut_stage` with free links (no MPI).

    Args:
        cfg: The run's options (partition, --slowdown, --sample-ms).
        layout: The job's groups.
        rank: This worker's world rank.
        model: The whole model, built from the run's seed.
        sample_shape: One sample's shape (without the batch dimension).

    Raises:
        ValueError: A model the job cannot pipeline, or a group with more
            stages than the model has units.
    """
    return cut_stage(cfg, layout, rank, plan_units(model, sample_shape))
