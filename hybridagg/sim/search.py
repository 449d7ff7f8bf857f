"""The planner's objectives and its exact searcher (pure logic).

Objectives: ``throughput`` (the most samples/s; the cheaper of equals),
``cost`` (HeterPS's: the cheapest configuration whose samples/s reach
``min_samples_per_sec``; the faster of equals) and ``time`` (the shortest
predicted time to the target accuracy, which needs the cost model's
convergence table: :mod:`.convergence`; the faster, then the cheaper, of
equals).

:func:`exact_search` visits every candidate of a :class:`~.space.Space`
except those a bound proves cannot win: a node combination whose ideal
samples/s (every worker computing, nothing else: no candidate on those
nodes is faster) is below the best found, or below the required rate; and,
for cost, one whose worker nodes alone cost more than the best found.
Combinations are visited best-bound first (throughput) or cheapest first
(cost), so the bounds bite early. With ``prune=False`` it is brute force,
which the tests compare it with.

Under ``time`` no node set is pruned: the ideal samples/s bounds a
configuration's rate, not its time to the target, which also depends on
how many updates its batches and staleness need; and the table, clamped
below its smallest batch, gives no floor on the samples to the target that
would turn the rate bound into a time bound. The exact searcher is then
brute force over the space (the planner's spaces on this machine's
emulation are a few hundred to a few thousand configurations; beyond ``AUTO_EXACT_LIMIT``
``auto`` picks the policy anyway).
"""

from __future__ import annotations

from dataclasses import dataclass

from .space import Candidate, CostModel, Score, Space

__all__ = ["OBJECTIVES", "Objective", "SearchResult", "Tracker", "exact_search"]

OBJECTIVES = ("throughput", "cost", "time")


@dataclass(frozen=True)
class Objective:
    """What the planner optimises.

    Attributes:
        kind: ``throughput``, ``cost`` or ``time``.
        min_samples_per_sec: With ``cost``: the rate a plan must reach.
    """

    kind: str = "throughput"
    min_samples_per_sec: float | None = None

    def __post_init__(self) -> None:
        if self.kind not in OBJECTIVES:
            raise ValueError(
                f"--objective must be one of {', '.join(OBJECTIVES)}, got {self.kind!r}"
            )
        if self.kind == "cost":
            if self.min_samples_per_sec is None or not self.min_samples_per_sec > 0:
                raise ValueError(
                    "--objective cost needs --min-samples-per-sec X (X > 0): the "
                    "throughput the cheapest plan must reach"
                )
        elif self.min_samples_per_sec is not None:
            raise ValueError("--min-samples-per-sec goes with --objective cost")

    def check(self, model: CostModel) -> None:
        """Whether ``model`` can score this objective.

        Raises:
            ValueError: ``time`` with a cost model that has no convergence
                table.
        """
        if self.kind == "time" and model.convergence is None:
            raise ValueError(
                "--objective time needs --convergence FILE (a convergence table: "
                "bench/convergence.py --json)"
            )

    def feasible(self, score: Score) -> bool:
        """Whether ``score`` meets the constraint (always, for throughput;
        for time, whenever it has a time)."""
        if self.kind == "time":
            return score.time_to_target_s is not None
        return self.kind == "throughput" or (
            score.samples_per_sec >= float(self.min_samples_per_sec or 0.0)
        )

    def key(self, score: Score) -> tuple[float, ...]:
        """Larger is better: feasibility first, then the objective, then the
        other figure as the tie-break."""
        if self.kind == "throughput":
            return (1.0, score.samples_per_sec, -score.cost_per_hour)
        if self.kind == "time":
            if score.time_to_target_s is None:
                return (0.0, score.samples_per_sec, -score.cost_per_hour)
            return (
                1.0,
                -score.time_to_target_s,
                score.samples_per_sec,
                -score.cost_per_hour,
            )
        if self.feasible(score):
            return (1.0, -score.cost_per_hour, score.samples_per_sec)
        return (0.0, score.samples_per_sec, -score.cost_per_hour)


@dataclass(frozen=True)
class SearchResult:
    """A searcher's answer.

    Attributes:
        best: The best candidate (``None``: nothing fits, or nothing meets
            the constraint).
        score: Its score.
        fastest: The fastest candidate scored (what to report when the
            constraint cannot be met).
        fastest_score: Its score.
        evaluated: Candidates the cost model scored.
        pruned: Node combinations a bound skipped.
        searcher: ``exact``, ``brute force`` or ``rl``.
        memory_dropped: Candidates scored and dropped: a device (or a node
            of shared cores) would need more than its node type's memory.
    """

    best: Candidate | None
    score: Score | None
    fastest: Candidate | None
    fastest_score: Score | None
    evaluated: int
    pruned: int
    searcher: str
    memory_dropped: int = 0


class Tracker:
    """The best and the fastest candidates seen so far under an objective."""

    def __init__(self, objective: Objective) -> None:
        self.objective = objective
        self.best: tuple[Candidate, Score] | None = None
        self.fastest: tuple[Candidate, Score] | None = None

    def offer(self, c: Candidate, score: Score | None) -> None:
        """Consider ``c`` (ignored when it does not fit)."""
        if score is None:
            return
        if self.fastest is None or (score.samples_per_sec, -score.cost_per_hour) > (
            self.fastest[1].samples_per_sec,
            -self.fastest[1].cost_per_hour,
        ):
            self.fastest = (c, score)
        if not self.objective.feasible(score):
            return
        if self.best is None or self.objective.key(score) > self.objective.key(
            self.best[1]
        ):
            self.best = (c, score)

    def result(
        self, evaluated: int, pruned: int, searcher: str, memory_dropped: int = 0
    ) -> SearchResult:
        """The search's answer (see :class:`SearchResult`)."""
        best, score = self.best or (None, None)
        fastest, fastest_score = self.fastest or (None, None)
        return SearchResult(
            best,
            score,
            fastest,
            fastest_score,
            evaluated,
            pruned,
            searcher,
            memory_dropped,
        )


def exact_search(
    model: CostModel, space: Space, objective: Objective, *, prune: bool = True
) -> SearchResult:
    """The best candidate of ``space`` (see the module).

    Raises:
        ValueError: ``time`` without the model's convergence table.
    """
    objective.check(model)
    combos = space.node_choices()
    bounds = {n: model.upper_bound(n) for n in combos}
    price = {n: model.node_price(n) for n in combos}
    if objective.kind != "cost":
        combos.sort(key=lambda n: (-bounds[n], price[n], n))
    else:
        combos.sort(key=lambda n: (price[n], -bounds[n], n))
    tracker = Tracker(objective)
    before, dropped = model.evaluated, model.memory_dropped
    pruned = 0
    for nodes in combos:
        if prune and _cannot_win(objective, tracker, bounds[nodes], price[nodes]):
            pruned += 1
            continue
        for c in space.candidates_on(nodes):
            if prune and objective.kind == "cost" and tracker.best is not None:
                try:
                    if model.cost_per_hour(c) > tracker.best[1].cost_per_hour:
                        continue  # cannot be cheaper (servers' own nodes add)
                except ValueError:
                    continue  # does not fit: score() would say so too
            tracker.offer(c, model.score(c))
    return tracker.result(
        model.evaluated - before,
        pruned,
        "exact" if prune else "brute force",
        model.memory_dropped - dropped,
    )


def _cannot_win(
    objective: Objective, tracker: Tracker, bound: float, price: float
) -> bool:
    """Whether no candidate with this samples/s bound and node price can beat
    the best so far (or meet the constraint); never under ``time`` (no bound
    holds: see the module)."""
    if objective.kind == "time":
        return False
    if objective.kind == "cost":
        if bound < float(objective.min_samples_per_sec or 0.0):
            return True
        if tracker.best is None:
            return False
        best = tracker.best[1]
        return price > best.cost_per_hour or (
            price == best.cost_per_hour and bound <= best.samples_per_sec
        )
    if tracker.best is None:
        return False
    best = tracker.best[1]
    return bound < best.samples_per_sec or (
        bound == best.samples_per_sec and price >= best.cost_per_hour
    )
