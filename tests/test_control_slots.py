"""Which groups train under a cost budget: candidates and slots (pure logic)."""

from __future__ import annotations

import itertools
import random

import pytest

from hybridagg.control import (
    Candidate,
    CostController,
    CostSlots,
    GroupChoice,
    affine_shares,
    affine_time,
    group_candidates,
)
from hybridagg.control.slots import EXHAUSTIVE_GROUPS


def test_every_set_of_groups_is_a_candidate_with_the_linear_solves_shares():
    fits = [(0.001, 0.01), (0.004, 0.0), (0.002, 0.005)]
    prices = [8.0, 3.0, 5.0]
    cands = group_candidates(fits, prices, 64)
    assert len(cands) == 7
    assert cands[0].name == "all groups"  # larger sets first
    seen = set()
    for c in cands:
        choice = c.config
        assert isinstance(choice, GroupChoice)
        seen.add(choice.active)
        assert sum(choice.shares) == 64
        assert all(choice.shares[g] == 0 for g in choice.parked)
        assert all(choice.shares[g] >= 1 for g in choice.active)
        assert c.cost_per_hour == pytest.approx(sum(prices[g] for g in choice.active))
        # the shares are the closed-form solve over the active groups alone
        sub = [fits[g] for g in choice.active]
        alone = affine_shares([a for a, _ in sub], [b for _, b in sub], 64)
        assert [choice.shares[g] for g in choice.active] == alone
        assert c.batch_time_s == pytest.approx(
            affine_time([a for a, _ in fits], [b for _, b in fits], choice.shares)
        )
    assert seen == {s for k in (1, 2, 3) for s in itertools.combinations(range(3), k)}


def test_a_set_whose_bounds_cannot_hold_the_batch_is_left_out():
    fits = [(0.001, 0.0), (0.002, 0.0)]
    cands = group_candidates(fits, [1.0, 1.0], 64, high=40)
    assert [c.config.active for c in cands] == [(0, 1)]
    with pytest.raises(ValueError, match="no set of groups"):
        group_candidates(fits, [1.0, 1.0], 100, high=40)


def test_many_groups_take_the_nested_sets_by_samples_per_dollar():
    n = EXHAUSTIVE_GROUPS + 2
    rng = random.Random(3)
    fits = [(rng.uniform(0.001, 0.01), 0.0) for _ in range(n)]
    prices = [rng.uniform(1.0, 9.0) for _ in range(n)]
    cands = group_candidates(fits, prices, 10 * n)
    assert len(cands) == n
    sizes = [len(c.config.active) for c in cands]
    assert sizes == list(range(n, 0, -1))
    for big, small in itertools.pairwise(cands):  # nested
        assert set(small.config.active) < set(big.config.active)
    best = min(range(n), key=lambda g: fits[g][0] * prices[g])
    assert cands[-1].config.active == (best,)  # the most samples per dollar


def test_a_nested_set_is_the_best_set_at_its_own_price_without_intercepts():
    """Zero intercepts, no bounds: a prefix by samples per dollar is the
    fractional knapsack's optimum at its price, so no set that costs as
    much is faster (between prefixes' prices the nested sets are a heuristic)."""
    rng = random.Random(7)
    for _ in range(20):
        n = 6
        fits = [(rng.uniform(0.001, 0.01), 0.0) for _ in range(n)]
        prices = [rng.uniform(1.0, 9.0) for _ in range(n)]
        every = group_candidates(fits, prices, 6000)
        order = sorted(range(n), key=lambda g: (fits[g][0] * prices[g], g))
        for k in range(1, n + 1):
            prefix = tuple(sorted(order[:k]))
            mine = next(c for c in every if c.config.active == prefix)
            rivals = [c for c in every if c.cost_per_hour <= mine.cost_per_hour + 1e-9]
            best = min(c.batch_time_s for c in rivals)
            # (integer shares: within a sample's time of the real optimum)
            assert mine.batch_time_s <= best + max(a for a, _ in fits)


def test_candidates_reject_bad_input():
    with pytest.raises(ValueError, match="at least one group"):
        group_candidates([], [], 8)
    with pytest.raises(ValueError, match="one entry per group"):
        group_candidates([(0.1, 0.0)], [1.0, 2.0], 8)
    with pytest.raises(ValueError, match="non-negative"):
        group_candidates([(0.1, 0.0)], [-1.0], 8)
    with pytest.raises(ValueError, match="slopes"):
        group_candidates([(0.0, 0.0)], [1.0], 8)


def _trace(budget: float, V: float, rounds: int, slot: int = 5) -> CostSlots:
    """A run of two groups whose rounds take the times their candidates predict."""
    fits = [(0.001, 0.004), (0.004, 0.0)]  # a pipeline (with its bubble), a slow rank
    prices = [8.0, 3.0]
    slots = CostSlots(CostController(budget, V), prices, slot, [32, 32])
    for _ in range(rounds):
        shares = slots.current.shares
        seconds = affine_time([a for a, _ in fits], [c for _, c in fits], shares)
        if slots.step(seconds):
            slots.end_slot(group_candidates(fits, prices, 64))
    slots.charge()
    return slots


def test_slots_keep_the_budget_by_parking_and_bringing_back_a_group():
    slots = _trace(budget=10.0, V=1e-3, rounds=4000)
    actives = [r.choice.active for r in slots.records]
    # a group parked, then every group back (the cheapest set is the slow
    # rank alone: with a small V and a queue, the price decides)
    assert any(len(a) == 1 and b == (0, 1) for a, b in itertools.pairwise(actives))
    spent = sum(r.cost_per_hour * r.seconds / 3600 for r in slots.records)
    assert slots.spent == pytest.approx(spent)
    assert slots.elapsed_s == pytest.approx(sum(r.seconds for r in slots.records))
    average = slots.controller.average_cost_per_hour
    # the drift-plus-penalty bound: the queue holds every overspend
    assert average <= 10.0 + 3600 * slots.controller.queue / slots.elapsed_s
    assert average <= 10.0 + 1e-9


def test_slots_with_room_in_the_budget_never_park():
    slots = _trace(budget=20.0, V=1e-3, rounds=500)
    assert {r.choice.active for r in slots.records} == {(0, 1)}


def test_a_larger_V_trades_cost_for_batch_time():
    tight = _trace(budget=10.0, V=1e-4, rounds=4000)
    loose = _trace(budget=10.0, V=10.0, rounds=4000)
    assert loose.controller.average_batch_time_s < tight.controller.average_batch_time_s
    assert (
        loose.controller.average_cost_per_hour > tight.controller.average_cost_per_hour
    )


def test_a_slot_before_the_groups_are_measured_keeps_every_group():
    slots = CostSlots(CostController(1.0, 1.0), [8.0, 3.0], 2, [32, 32])
    assert not slots.step(0.5)
    assert slots.step(0.5)
    assert slots.end_slot(None).active == (0, 1)
    (record,) = slots.records
    assert record.seconds == 1.0 and record.steps == 2 and record.predicted_s is None
    assert slots.spent == pytest.approx(11.0 / 3600)
    assert slots.charge() is None  # nothing since


def test_slots_reject_bad_input():
    ctl = CostController(1.0, 1.0)
    with pytest.raises(ValueError, match="slot_steps"):
        CostSlots(ctl, [1.0], 0, [8])
    with pytest.raises(ValueError, match="prices for"):
        CostSlots(ctl, [1.0, 2.0], 1, [8])
    slots = CostSlots(ctl, [1.0], 1, [8])
    with pytest.raises(ValueError, match="seconds"):
        slots.step(float("nan"))
    with pytest.raises(TypeError, match="GroupChoice"):
        slots.step(1.0)
        slots.end_slot([Candidate("x", 1.0, 1.0, None)])
