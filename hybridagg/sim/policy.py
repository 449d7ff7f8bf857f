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
policy drew, or its greedy choice at the end if better.
"""

from __future__ import annotations

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
    if any(greedy[:k]):
        c = space.candidate(greedy)
        tracker.offer(c, model.score(c))
    return tracker.result(
        model.evaluated - before, 0, "rl", model.memory_dropped - dropped
    )
