"""The planner's policy for large spaces, trained with REINFORCE (HeterPS's way).

A factored softmax policy: one vector of logits per decision of the
:class:`~.space.Space` (node counts per type, mode, grouping, servers, their
node type, batch rule), the decisions drawn independently. Each round
draws a batch of configurations, scores them with the analytic
:class:`~.space.CostModel` (cached: the policy revisits the same ones), and
moves the logits along ``(reward - mean reward of the batch) x grad log
pi`` (REINFORCE with the batch's mean as the baseline), with Adam. Seeded:
the same seed gives the same plan.

Rewards, larger is better, every feasible configuration above every
infeasible one: ``throughput``: samples/s over the space's best bound;
``cost``: a configuration that meets the rate earns ``1 - cost / max
cost`` (in ``[0, 1]``), one that does not ``-1 + 0.5 x rate / required``;
one that does not fit, ``-1``. The answer is the best configuration the
policy drew, or better, found by improving its greedy choice and the best
draw of each mode a decision (or two node counts) at a time on the
analytic model (:func:`_climb`: coordinate ascent, a policy's answer
refined by local search). Why: a factored policy settles on one mode
early, and the cheapest plan of another mode may be a few single changes away from that
mode's best draw while no single change leads there from the policy's
answer (three-speeds-priced at 1,500 samples/s: the policy settled on sync
at 22 per hour; hybrid on fewer nodes costs 18).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from .search import Objective, SearchResult, Tracker
from .space import CostModel, Score, Space

__all__ = ["reinforce_search"]


def _reward(
    objective: Objective,
    score: Score | None,
    scale: float,
    max_cost: float,
    floor_s: float = 1.0,
) -> float:
    if score is None:
        return -1.0
    if objective.kind == "throughput":
        return score.samples_per_sec / scale
    if objective.kind == "time":
        t = score.time_to_target_s
        return -1.0 if t is None or not t > 0 else floor_s / t
    need = float(objective.min_samples_per_sec or 1.0)
    if score.samples_per_sec >= need:
        return 1.0 - score.cost_per_hour / max_cost if max_cost > 0 else 1.0
    return -1.0 + 0.5 * min(1.0, score.samples_per_sec / need)


def reinforce_search(
    model: CostModel,
    space: Space,
    objective: Objective,
    *,
    rounds: int = 150,
    batch: int = 16,
    lr: float = 0.1,
    seed: int = 0,
) -> SearchResult:
    """Train the policy against ``model`` and return the best it found.

    Args:
        model: The analytic cost model.
        space: The decisions and their choices.
        objective: What to optimise.
        rounds: Policy updates.
        batch: Configurations drawn per update.
        lr: Adam's learning rate.
        seed: Seeds the draws (the same seed, the same answer).

    Raises:
        ValueError: Bad ``rounds`` or ``batch``; ``time`` without the
            model's convergence table.
    """
    import torch

    if rounds < 1 or batch < 2:
        raise ValueError(f"rounds must be >= 1 and batch >= 2, got {rounds}, {batch}")
    objective.check(model)
    decisions = space.decisions()
    k = len(space.nodes)
    # scales for the reward: the best bound, the dearest configuration
    full = tuple(max(c) for c in space.nodes)
    scale = max(model.upper_bound(full), 1e-12)
    max_cost = model.node_price(full) + sum(
        t.count * t.price_per_hour for t in model.cluster.node_types if t.devices == 0
    )
    floor_s = 1.0
    if model.convergence is not None:
        fewest = min(b * u for b, _, u in model.convergence.points)
        floor_s = fewest / scale
    generator = torch.Generator().manual_seed(seed)
    logits = [
        torch.zeros(len(choices), dtype=torch.float64, requires_grad=True)
        for _, choices in decisions
    ]
    optimizer = torch.optim.Adam(logits, lr=lr)
    tracker = Tracker(objective)
    before, dropped = model.evaluated, model.memory_dropped
    # the best draw of each mode (where the ascent starts)
    drawn: dict[Any, tuple[tuple[float, ...], tuple[Any, ...]]] = {}

    for _ in range(rounds):
        # one draw of every decision for the whole batch at once
        picks = [
            torch.multinomial(
                torch.softmax(lg.detach(), 0),
                batch,
                replacement=True,
                generator=generator,
            )
            for lg in logits
        ]
        rewards = []
        for b in range(batch):
            choice: list[Any] = [
                decisions[i][1][int(p[b])] for i, p in enumerate(picks)
            ]
            c = space.candidate(tuple(choice))
            score = model.score(c)
            tracker.offer(c, score)
            rewards.append(_reward(objective, score, scale, max_cost, floor_s))
            mode = choice[k]
            if score is not None and (
                mode not in drawn or objective.key(score) > drawn[mode][0]
            ):
                drawn[mode] = (objective.key(score), tuple(choice))
        advantage = torch.tensor(rewards, dtype=torch.float64)
        advantage -= advantage.mean()  # the batch's mean reward as the baseline
        spread = float(advantage.std())
        if spread > 0:  # rewards' scale differs by objective: keep steps alike
            advantage /= spread
        log_prob = sum(
            torch.log_softmax(lg, 0)[p] for lg, p in zip(logits, picks, strict=True)
        )
        loss = -(advantage * log_prob).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    greedy = tuple(
        decisions[i][1][int(torch.argmax(lg.detach()))] for i, lg in enumerate(logits)
    )
    for start in (greedy, *(choice for _, choice in drawn.values())):
        if any(start[:k]):
            _climb(model, space, objective, decisions, start, tracker)
    return tracker.result(
        model.evaluated - before, 0, "rl", model.memory_dropped - dropped
    )


def _climb(
    model: CostModel,
    space: Space,
    objective: Objective,
    decisions: list[tuple[str, tuple[Any, ...]]],
    start: tuple[Any, ...],
    tracker: Tracker,
    sideways: int = 8,
) -> None:
    """Coordinate ascent from the decisions ``start``: change one decision
    (or two node counts by one step each) to the choice that improves the
    objective most, until none does; where
    none improves, step to a configuration scored alike not visited yet (at
    most ``sideways`` such steps: plans alike in cost and rate differ in
    what a next change can reach). Every configuration scored is offered to
    ``tracker``."""
    k = len(space.nodes)

    def key(choice: tuple[Any, ...]) -> tuple[float, ...]:
        c = space.candidate(choice)
        score = model.score(c)
        tracker.offer(c, score)
        return (-1.0,) if score is None else objective.key(score)

    def moves(current: tuple[Any, ...]) -> Iterator[tuple[Any, ...]]:
        for i, (_, choices) in enumerate(decisions):
            for choice in choices:
                yield current[:i] + (choice,) + current[i + 1 :]
        # a node of one type for one of another, or one more (fewer) of two:
        # one step of two node counts at once
        for i in range(k):
            for j in range(i + 1, k):
                a, b = decisions[i][1], decisions[j][1]
                x, y = a.index(current[i]), b.index(current[j])
                for dx, dy in ((-1, 1), (1, -1), (1, 1), (-1, -1)):
                    if 0 <= x + dx < len(a) and 0 <= y + dy < len(b):
                        moved = list(current)
                        moved[i], moved[j] = a[x + dx], b[y + dy]
                        yield tuple(moved)

    current, best = start, key(start)
    visited = {space.candidate(start)}
    while True:
        step, level = None, None
        for moved in moves(current):
            if moved == current or not any(moved[:k]):
                continue
            got = key(moved)
            if got > best:
                step, best = moved, got
            elif (
                got == best and level is None and space.candidate(moved) not in visited
            ):
                level = moved
        if step is None and (level is None or sideways == 0):
            return
        if step is None:
            step, sideways = level, sideways - 1
        current = step
        visited.add(space.candidate(current))
