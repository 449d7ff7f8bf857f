"""``hybridagg plan``: search, then confirm the choice on the simulator.

:func:`make_model` reads the cluster (or this machine's emulation),
:func:`search` runs the chosen searcher over the cost model's default
space, :func:`confirm` simulates the chosen configuration with SimGrid (at
most ``confirm_workers`` workers: a 64-rank simulation takes seconds), and
:func:`plan` does all three for ``hybridagg plan``'s options.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Protocol

from .cluster import load_cluster
from .job import machine_cluster
from .planfile import Plan, make_plan
from .policy import reinforce_search
from .profile import Profile
from .search import Objective, SearchResult, exact_search
from .space import Candidate, CostModel, Space

__all__ = ["AUTO_EXACT_LIMIT", "PlanOptions", "confirm", "make_model", "plan", "search"]

AUTO_EXACT_LIMIT = 20_000
"""``--searcher auto`` searches exactly up to this many raw configurations."""

CONFIRM_UPDATES = 20
"""Updates per group the confirming simulation runs."""


class PlanOptions(Protocol):
    """``hybridagg plan``'s options that the planner reads."""

    cluster: str | None
    workers: int | None
    batch_size: int
    slowdown: str | None
    sample_ms: float
    wire: str
    objective: str
    min_samples_per_sec: float | None
    searcher: str
    seed: int
    rounds: int
    confirm_workers: int
    sim_timeout: float


def make_model(options: PlanOptions, profile: Profile) -> CostModel:
    """The cost model of the options' cluster (or this machine's emulation)."""
    if options.cluster is not None:
        cluster = load_cluster(options.cluster)
    else:
        cluster = machine_cluster(profile, int(options.workers or 2), 0)
        cluster = replace(cluster, name=f"this machine, {options.workers} workers")
    return CostModel(
        cluster,
        profile,
        batch_size=options.batch_size,
        workers=options.workers if options.cluster is None else None,
        slowdown=options.slowdown,
        sample_ms=options.sample_ms,
        wire=options.wire,
    )


def search(
    model: CostModel,
    space: Space,
    objective: Objective,
    searcher: str = "auto",
    *,
    seed: int = 0,
    rounds: int = 150,
) -> SearchResult:
    """Run ``searcher`` (``exact``, ``rl``, or ``auto``: exact up to
    :data:`AUTO_EXACT_LIMIT` configurations)."""
    if searcher == "auto":
        searcher = "exact" if space.size <= AUTO_EXACT_LIMIT else "rl"
    if searcher == "exact":
        return exact_search(model, space, objective)
    if searcher == "rl":
        return reinforce_search(model, space, objective, seed=seed, rounds=rounds)
    raise ValueError(f"--searcher must be auto, exact or rl, got {searcher!r}")


def confirm(model: CostModel, c: Candidate, *, timeout: float) -> dict[str, Any]:
    """Simulate ``c`` with SimGrid (``CONFIRM_UPDATES`` updates per group).

    Raises:
        SimGridMissing: SimGrid is not installed.
        TimeoutError, RuntimeError: The simulation failed.
    """
    from .simulate import simulate

    probe = model.job(c)
    steps = CONFIRM_UPDATES * (1 if c.mode == "sync" else len(probe.groups))
    return simulate(model.job(c, steps=steps), timeout=timeout).as_dict()


def plan(options: PlanOptions, profile: Profile) -> tuple[Plan, SearchResult, str]:
    """Choose a plan for ``options`` (see the module); also the searcher's
    result and a note on the confirmation (empty when it ran).

    Raises:
        ValueError: Bad options, or no configuration meets the objective
            (the message gives the fastest one found).
    """
    from ._simgrid import SimGridMissing

    model = make_model(options, profile)
    space = model.default_space()
    objective = Objective(options.objective, options.min_samples_per_sec)
    result = search(
        model,
        space,
        objective,
        options.searcher,
        seed=options.seed,
        rounds=options.rounds,
    )
    full = tuple(max(c) for c in space.nodes)
    if result.best is None or result.score is None:
        fastest = result.fastest_score
        if objective.kind == "cost" and fastest is None:  # every node set pruned
            raise ValueError(
                f"no configuration reaches {options.min_samples_per_sec:g} "
                f"samples/s: every worker of the cluster computing, nothing "
                f"else, gives {model.upper_bound(full):.1f}"
            )
        if fastest is None or result.fastest is None:
            raise ValueError(f"no configuration fits cluster {model.cluster.name}")
        raise ValueError(
            f"no configuration reaches {options.min_samples_per_sec:g} samples/s; "
            f"the fastest found ({result.fastest.describe()}) predicts "
            f"{fastest.samples_per_sec:.1f} samples/s"
        )
    chosen = make_plan(
        model,
        result.best,
        result.score,
        objective=options.objective,
        min_samples_per_sec=options.min_samples_per_sec,
        searcher=result.searcher,
        evaluated=result.evaluated,
    )
    sync = model.score(Candidate("sync", full))
    chosen = replace(
        chosen, sync_samples_per_sec=None if sync is None else sync.samples_per_sec
    )
    note = ""
    if options.confirm_workers and chosen.workers <= options.confirm_workers:
        try:
            simulated = confirm(model, result.best, timeout=options.sim_timeout)
            chosen = replace(
                chosen, simulated_samples_per_sec=simulated["samples_per_sec"]
            )
        except SimGridMissing as exc:
            note = f"not confirmed: {exc}"
        except (TimeoutError, RuntimeError) as exc:
            note = f"not confirmed: the simulation failed: {exc}"
    elif options.confirm_workers:
        note = (
            f"not confirmed: {chosen.workers} workers > --confirm-workers "
            f"{options.confirm_workers}"
        )
    else:
        note = "not simulated (--confirm-workers 0)"
    return chosen, result, note
