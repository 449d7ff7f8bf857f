"""``hybridagg plan``: search, then confirm the choice on the simulator.

:func:`make_model` reads the cluster (or this machine's emulation),
:func:`search` runs the chosen searcher over the cost model's default
space, :func:`confirm` simulates the chosen configuration with SimGrid (at
most ``confirm_workers`` workers: a 64-rank simulation takes seconds), and
:func:`plan` does all three for ``hybridagg plan``'s options, with the best
synchronous all-reduce configuration scored beside (:func:`best_sync`).
Under ``--objective throughput`` the configurations the analytic model
predicts within ``--confirm-band`` of the choice (:func:`contenders`: its
error band; at most :data:`CONFIRM_MOST`) are simulated too, and the fastest
simulated is the plan (:func:`confirm_best`): the model ranks thousands of
configurations cheaply, the simulator decides between those it cannot tell
apart.

:func:`compare_searchers` runs the exact searcher and the REINFORCE policy
on one space and reports the policy's gap (``bench/planner.py``'s table).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import replace
from typing import Any, Protocol

from .cluster import load_cluster
from .convergence import load_convergence
from .job import machine_cluster
from .planfile import Plan, make_plan
from .policy import reinforce_search
from .profile import Profile
from .search import Objective, SearchResult, exact_search
from .space import Candidate, CostModel, Score, Space, parse_batch_choices

__all__ = [
    "AUTO_EXACT_LIMIT",
    "CONFIRM_BAND",
    "CONFIRM_MOST",
    "PlanRequest",
    "best_sync",
    "compare_searchers",
    "confirm",
    "confirm_best",
    "contenders",
    "gap",
    "make_model",
    "plan",
    "resolve_searcher",
    "search",
]

AUTO_EXACT_LIMIT = 20_000
"""``--searcher auto`` searches exactly up to this many raw configurations."""

CONFIRM_UPDATES = 20
"""Updates per group the confirming simulation runs."""

CONFIRM_MOST = 8
"""At most this many configurations are simulated to confirm a throughput plan."""

CONFIRM_BAND = 0.15
"""``--confirm-band``'s default: the analytic model's error band (its median
error over the spaces simulated exhaustively, bench/RESULTS.md, is 1-12%)."""


class PlanRequest(Protocol):
    """``hybridagg plan``'s options that the planner reads (the configuration
    :class:`hybridagg.train.config.simulation.PlanConfig` is one)."""

    cluster: str | None
    workers: int | None
    batch_size: int
    batch_choices: str | None
    slowdown: str | None
    sample_ms: float
    wire: str
    objective: str
    min_samples_per_sec: float | None
    convergence: str | None
    eval_every: int | None
    pipelines: str
    micro_batches: int
    searcher: str
    seed: int
    rounds: int
    confirm_workers: int
    confirm_band: float
    sim_timeout: float


def make_model(options: PlanRequest, profile: Profile) -> CostModel:
    """The cost model of the options' cluster (or this machine's emulation),
    with the options' convergence table when they name one.

    Raises:
        ValueError: A bad cluster or convergence file.
    """
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
        # the optimizer the profile's server times were measured with
        optimizer=profile.notes.get("optimizer"),
        convergence=(
            None
            if options.convergence is None
            else load_convergence(
                options.convergence, getattr(options, "eval_every", None)
            )
        ),
        micro_batches=int(getattr(options, "micro_batches", 4)),
    )


def resolve_searcher(space: Space, searcher: str = "auto") -> str:
    """``auto`` as ``exact`` up to :data:`AUTO_EXACT_LIMIT` raw configurations,
    ``rl`` beyond (the default space of the 1,024-GPU example is beyond);
    another name as itself."""
    if searcher == "auto":
        return "exact" if space.size <= AUTO_EXACT_LIMIT else "rl"
    return searcher


def search(
    model: CostModel,
    space: Space,
    objective: Objective,
    searcher: str = "auto",
    *,
    seed: int = 0,
    rounds: int = 150,
) -> SearchResult:
    """Run ``searcher`` (``exact``, ``rl``, or ``auto``: see
    :func:`resolve_searcher`)."""
    searcher = resolve_searcher(space, searcher)
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


def contenders(
    model: CostModel,
    space: Space,
    best: Candidate,
    score: Score,
    band: float,
    *,
    most: int = CONFIRM_MOST,
) -> list[tuple[Candidate, Score]]:
    """``best`` and the configurations of ``space`` the analytic model
    predicts within ``band`` of its samples/s, the fastest first (at most
    ``most``). Of configurations predicted alike (the same samples/s and
    cost: e.g. batches by speed in groups of one speed) one stands for all.
    Node sets whose ideal samples/s is below the band are skipped."""
    floor = (1 - band) * score.samples_per_sec
    seen = {(score.samples_per_sec, score.cost_per_hour)}
    near = []
    for nodes in space.node_choices():
        if model.upper_bound(nodes) < floor:
            continue  # (no configuration on these nodes is faster than that)
        for c in space.candidates_on(nodes):
            s = model.score(c)
            if s is not None and s.samples_per_sec >= floor and c != best:
                near.append((c, s))
    near.sort(key=lambda cs: (-cs[1].samples_per_sec, cs[1].cost_per_hour,
                              cs[0].describe()))  # fmt: skip
    out = [(best, score)]
    for c, s in near:
        if (s.samples_per_sec, s.cost_per_hour) not in seen and len(out) < most:
            seen.add((s.samples_per_sec, s.cost_per_hour))
            out.append((c, s))
    return out


def confirm_best(
    model: CostModel,
    pool: list[tuple[Candidate, Score]],
    *,
    timeout: float,
) -> tuple[Candidate, Score, dict[str, Any], int]:
    """Simulate every configuration of ``pool`` (the first is the search's
    choice) and return the fastest simulated (the cheaper of equals), its
    analytic score, its simulation and how many simulated.

    Raises:
        SimGridMissing: SimGrid is not installed.
        TimeoutError, RuntimeError: The first one's simulation failed (a
            later one that fails is left out).
    """
    results = []
    for i, (c, s) in enumerate(pool):
        try:
            results.append((c, s, confirm(model, c, timeout=timeout)))
        except (TimeoutError, RuntimeError):
            if i == 0:
                raise
    # (ranked by the second half's rate: the analytic model's steady state,
    # and a long run's, without the start-up of every leader pushing at once)
    c, s, simulated = max(
        results,
        key=lambda r: (r[2]["steady_samples_per_sec"], -r[1].cost_per_hour),
    )
    return c, s, simulated, len(results)


def best_sync(
    model: CostModel, space: Space, objective: Objective
) -> tuple[Candidate, Score] | None:
    """The best synchronous all-reduce configuration of ``space`` under
    ``objective`` (exact search over sync alone), or its fastest when none
    meets the objective's rate; ``None`` when no sync configuration fits."""
    result = exact_search(model, replace(space, modes=("sync",)), objective)
    if result.best is not None and result.score is not None:
        return result.best, result.score
    if result.fastest is not None and result.fastest_score is not None:
        return result.fastest, result.fastest_score
    return None


def plan(options: PlanRequest, profile: Profile) -> tuple[Plan, SearchResult, str]:
    """Choose a plan for ``options`` (see the module); also the searcher's
    result and a note on the confirmation (empty when it ran).

    Raises:
        ValueError: Bad options, or no configuration meets the objective
            (the message gives the fastest one found).
    """
    from ._simgrid import SimGridMissing

    model = make_model(options, profile)
    space = model.default_space(
        batch_sizes=parse_batch_choices(options.batch_choices),
        pipelines=getattr(options, "pipelines", "auto") != "off",
    )
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
    sync = best_sync(model, space, objective)

    def plan_of(c: Candidate, score: Score) -> Plan:
        chosen = make_plan(
            model,
            c,
            score,
            objective=options.objective,
            min_samples_per_sec=options.min_samples_per_sec,
            searcher=result.searcher,
            evaluated=result.evaluated,
            cluster_file=options.cluster,
        )
        return replace(
            chosen,
            sync_samples_per_sec=None if sync is None else sync[1].samples_per_sec,
            sync_cost_per_hour=None if sync is None else sync[1].cost_per_hour,
            sync_time_to_target_s=None if sync is None else sync[1].time_to_target_s,
            memory_dropped=result.memory_dropped,
        )

    chosen = plan_of(result.best, result.score)
    note = ""
    limit = options.confirm_workers
    band = float(getattr(options, "confirm_band", 0.0))
    if limit and chosen.workers <= limit:
        pool = [(result.best, result.score)]
        if objective.kind == "throughput" and band > 0:
            # configurations the analytic model cannot tell from the choice
            # (within its error band) are decided by the simulator
            pool = [
                (c, sc)
                for c, sc in contenders(model, space, result.best, result.score, band)
                if len(model.job(c).workers) <= limit
            ]
        try:
            best, score, simulated, count = confirm_best(
                model, pool, timeout=options.sim_timeout
            )
            if best != result.best:
                chosen = plan_of(best, score)
            chosen = replace(
                chosen, simulated_samples_per_sec=simulated["steady_samples_per_sec"]
            )
            if count > 1:
                note = (
                    f"the fastest simulated of {count} configurations predicted "
                    f"within {band:.0%} of the best"
                )
        except SimGridMissing as exc:
            note = f"not confirmed: {exc}"
        except (TimeoutError, RuntimeError) as exc:
            note = f"not confirmed: the simulation failed: {exc}"
    elif limit:
        note = (
            f"not confirmed: {chosen.workers} workers > --confirm-workers "
            f"{options.confirm_workers}"
        )
    else:
        note = "not simulated (--confirm-workers 0)"
    return chosen, result, note


def gap(objective: Objective, exact: Score, found: Score | None) -> float:
    """How much worse ``found`` is than ``exact`` (0: as good; ``inf``: it
    found nothing, or nothing that meets the rate): the cost over exact's,
    less one (``cost``), the predicted time to the target over exact's, less
    one (``time``), or one less the samples/s over exact's
    (``throughput``)."""
    if found is None:
        return float("inf")
    if objective.kind == "time":
        if found.time_to_target_s is None or exact.time_to_target_s is None:
            return float("inf")
        return found.time_to_target_s / exact.time_to_target_s - 1
    if objective.kind == "cost":
        if not objective.feasible(found):
            return float("inf")
        return found.cost_per_hour / exact.cost_per_hour - 1
    return 1 - found.samples_per_sec / exact.samples_per_sec


def compare_searchers(
    model: CostModel,
    space: Space,
    objective: Objective,
    *,
    seeds: int = 5,
    rounds: int = 150,
) -> dict[str, Any]:
    """The exact searcher and the REINFORCE policy (``seeds`` seeds, each on a
    fresh cache) on one space.

    Returns:
        A record: ``objective``, ``min_samples_per_sec``, ``configurations``
        (the space's raw size), ``exact`` (``plan``, ``cost_per_hour``,
        ``samples_per_sec``, ``evaluated``, ``pruned_node_sets``,
        ``memory_dropped``, ``wall_s``), ``rl`` (per seed: ``seed``,
        ``gap``, ``cost_per_hour``, ``samples_per_sec``, ``evaluated``,
        ``wall_s``, ``plan``), ``median_gap`` and ``max_gap``.

    Raises:
        ValueError: The exact searcher finds no configuration that meets
            the objective.
    """

    def fresh() -> CostModel:  # each searcher on an empty cache: fair wall times
        return replace(model, _cache={}, _errors={}, _memory=set())

    start = time.perf_counter()
    exact = exact_search(fresh(), space, objective)
    exact_s = time.perf_counter() - start
    if exact.best is None or exact.score is None:
        raise ValueError("the exact searcher finds no configuration to compare with")
    runs = []
    for seed in range(seeds):
        start = time.perf_counter()
        rl = reinforce_search(fresh(), space, objective, seed=seed, rounds=rounds)
        runs.append(
            {
                "seed": seed,
                "gap": gap(objective, exact.score, rl.score),
                "cost_per_hour": rl.score.cost_per_hour if rl.score else None,
                "samples_per_sec": rl.score.samples_per_sec if rl.score else None,
                "time_to_target_s": rl.score.time_to_target_s if rl.score else None,
                "evaluated": rl.evaluated,
                "wall_s": time.perf_counter() - start,
                "plan": rl.best.describe() if rl.best else None,
            }
        )
    gaps = [r["gap"] for r in runs]
    return {
        "objective": objective.kind,
        "min_samples_per_sec": objective.min_samples_per_sec,
        "configurations": space.size,
        "exact": {
            "plan": exact.best.describe(),
            "cost_per_hour": exact.score.cost_per_hour,
            "samples_per_sec": exact.score.samples_per_sec,
            "time_to_target_s": exact.score.time_to_target_s,
            "evaluated": exact.evaluated,
            "pruned_node_sets": exact.pruned,
            "memory_dropped": exact.memory_dropped,
            "wall_s": exact_s,
        },
        "rl": runs,
        "median_gap": statistics.median(gaps),
        "max_gap": max(gaps),
    }
