"""hybridagg.control: the affine share solve and the cost controller (pure logic)."""

from __future__ import annotations

import math
import random

import pytest

from hybridagg.batching import proportional_batches
from hybridagg.control import (
    Candidate,
    CostController,
    ShareSolver,
    affine_shares,
    affine_time,
    best_mix,
    best_static,
    cost_bounds,
    fit_affine,
)


# ------------------------------------------------------------------ affine_shares
def closed_form(slopes, intercepts, total):
    level = (total + sum(c / a for a, c in zip(slopes, intercepts, strict=True))) / sum(
        1 / a for a in slopes
    )
    return level, [(level - c) / a for a, c in zip(slopes, intercepts, strict=True)]


def test_affine_shares_match_the_closed_form_when_nothing_clips():
    rng = random.Random(22)
    checked = 0
    while checked < 200:
        n = rng.randint(1, 8)
        slopes = [rng.uniform(1e-3, 2e-2) for _ in range(n)]
        intercepts = [rng.uniform(0.0, 0.5) for _ in range(n)]
        total = rng.randint(50 * n, 4000)
        level, exact = closed_form(slopes, intercepts, total)
        if min(exact) < 1:
            continue  # a clipping case: covered below
        shares = affine_shares(slopes, intercepts, total)
        assert sum(shares) == total
        for a, c, b, e in zip(slopes, intercepts, shares, exact, strict=True):
            assert abs(b - e) < 1
            assert abs(a * b + c - level) <= a
        assert affine_time(slopes, intercepts, shares) <= level + max(slopes)
        checked += 1


def test_affine_shares_with_zero_intercepts_are_proportional_batches():
    rng = random.Random(7)
    for _ in range(300):
        n = rng.randint(1, 8)
        slopes = [rng.uniform(1e-3, 1e-1) for _ in range(n)]
        total = rng.randint(n, 2000)
        rates = [1 / a for a in slopes]
        zeros = [0.0] * n
        assert affine_shares(slopes, zeros, total) == proportional_batches(rates, total)
        # one-sided bounds: a ceiling (device memory), or a floor
        high = rng.randint(-(-total // n), total)
        assert affine_shares(slopes, zeros, total, high=high) == (
            proportional_batches(rates, total, high=high)
        )
        low = rng.randint(0, total // n)
        assert affine_shares(slopes, zeros, total, low=low) == (
            proportional_batches(rates, total, low=low)
        )
    assert affine_shares([1, 1, 1], [0, 0, 0], 10) == proportional_batches(
        [1, 1, 1], 10
    )


def test_a_fixed_cost_moves_samples_to_the_other_groups():
    # equal speeds, group 1 pays a two-second bubble per batch: the level is
    # 3 s, group 0 takes 300 samples, group 1 only 100
    assert affine_shares([0.01, 0.01], [0.0, 2.0], 400) == [300, 100]
    assert affine_time([0.01, 0.01], [0.0, 2.0], [300, 100]) == pytest.approx(3.0)
    # the proportional split leaves group 1 the slowest
    assert affine_time([0.01, 0.01], [0.0, 2.0], [200, 200]) == pytest.approx(4.0)


def test_clipping_at_bounds_resolves_the_rest():
    # a ceiling: group 0 would take 240, memory allows 200; the other two
    # share the rest so their times are equal
    shares = affine_shares([0.01, 0.01, 0.02], [0.0, 1.0, 0.0], 500, high=200)
    assert shares[0] == 200 and sum(shares) == 500
    assert 0.01 * shares[1] + 1.0 == pytest.approx(0.02 * shares[2], abs=0.02)
    # a group whose fixed cost alone exceeds the level gets nothing with
    # low=0, and costs nothing
    shares = affine_shares([0.01, 0.01, 0.01], [0.0, 0.0, 10.0], 200, low=0)
    assert shares == [100, 100, 0]
    assert affine_time([0.01, 0.01, 0.01], [0.0, 0.0, 10.0], shares) == 1.0
    # with the default floor it keeps one sample
    assert affine_shares([0.01, 0.01, 0.01], [0.0, 0.0, 10.0], 200) == [100, 99, 1]
    # per-group bounds
    assert affine_shares([1, 1], [0, 0], 10, low=[7, 0], high=[10, 10]) == [7, 3]


def test_floor_and_ceiling_in_one_split_find_the_common_level():
    # rates 10, 1, 1: group 0 is capped at 6, group 1 floored at 2. Fixing
    # both at once would leave group 2 with 4 samples and group 1 at 2;
    # the level where the clipped shares sum to 12 is 3, above group 1's floor
    slopes, zeros = [0.1, 1.0, 1.0], [0.0, 0.0, 0.0]
    shares = affine_shares(slopes, zeros, 12, low=[1, 2, 1], high=[6, 12, 12])
    assert shares == [6, 3, 3]
    assert affine_time(slopes, zeros, shares) == pytest.approx(3.0)


def test_affine_shares_within_random_bounds_sit_at_the_water_level():
    rng = random.Random(5)
    for _ in range(300):
        n = rng.randint(1, 6)
        slopes = [rng.uniform(1e-3, 1e-1) for _ in range(n)]
        intercepts = [rng.choice([0.0, rng.uniform(0.0, 5.0)]) for _ in range(n)]
        lows = [rng.randint(0, 20) for _ in range(n)]
        highs = [lo + rng.randint(0, 200) for lo in lows]
        total = rng.randint(sum(lows), sum(highs))
        shares = affine_shares(slopes, intercepts, total, low=lows, high=highs)
        assert sum(shares) == total
        assert all(lo <= b <= hi for lo, b, hi in zip(lows, shares, highs, strict=True))

        # the level by bisection on the clipped real shares
        def filled(t, lows=lows, highs=highs, slopes=slopes, intercepts=intercepts):
            return sum(
                min(max((t - c) / a, lo), hi)
                for a, c, lo, hi in zip(slopes, intercepts, lows, highs, strict=True)
            )

        lo_t, hi_t = -1e3, 1e4
        for _ in range(200):
            mid = (lo_t + hi_t) / 2
            lo_t, hi_t = (mid, hi_t) if filled(mid) < total else (lo_t, mid)
        level = hi_t
        for a, c, lo, b, hi in zip(
            slopes, intercepts, lows, shares, highs, strict=True
        ):
            exact = min(max((level - c) / a, lo), hi)
            assert abs(b - exact) < 1 + 1e-6


def test_affine_shares_hit_the_bounds_exactly_at_their_extremes():
    assert affine_shares([0.1, 1.0], [0.0, 5.0], 10, low=5) == [5, 5]
    assert affine_shares([0.1, 1.0], [0.0, 5.0], 10, high=5) == [5, 5]
    assert affine_shares([0.1, 1.0], [0.0, 0.0], 0, low=0) == [0, 0]


def test_affine_shares_reject_bad_input():
    with pytest.raises(ValueError, match="slopes must be positive"):
        affine_shares([0.1, 0.0], [0, 0], 10)
    with pytest.raises(ValueError, match="slopes must name at least one"):
        affine_shares([], [], 10)
    with pytest.raises(ValueError, match="intercepts must be non-negative"):
        affine_shares([0.1, 0.1], [0, -1], 10)
    with pytest.raises(ValueError, match="intercepts must have one entry"):
        affine_shares([0.1, 0.1], [0], 10)
    with pytest.raises(ValueError, match="cannot hold"):
        affine_shares([0.1, 0.1], [0, 0], 10, high=4)
    with pytest.raises(ValueError, match="cannot hold"):
        affine_shares([0.1, 0.1], [0, 0], 10, low=6)
    with pytest.raises(ValueError, match="low must be >= 0"):
        affine_shares([0.1, 0.1], [0, 0], 10, low=-1)
    with pytest.raises(ValueError, match="high must be >= low"):
        affine_shares([0.1, 0.1], [0, 0], 10, low=[3, 3], high=[2, 10])
    with pytest.raises(ValueError, match="low must have one entry"):
        affine_shares([0.1, 0.1], [0, 0], 10, low=[1])
    with pytest.raises(TypeError, match="total must be an int"):
        affine_shares([0.1, 0.1], [0, 0], 10.0)
    with pytest.raises(TypeError, match=r"high\[1\] must be an int"):
        affine_shares([0.1, 0.1], [0, 0], 10, high=[10, 2.5])
    with pytest.raises(ValueError, match="shares must be non-negative"):
        affine_time([0.1, 0.1], [0, 0], [1, -1])
    with pytest.raises(ValueError, match="shares must have one entry"):
        affine_time([0.1, 0.1], [0, 0], [1])


# ------------------------------------------------------------------ fit_affine
def test_fit_affine_recovers_an_exact_line():
    samples = [32, 64, 96, 128, 64]
    seconds = [0.004 * b + 0.25 for b in samples]
    slope, intercept = fit_affine(samples, seconds)
    assert slope == pytest.approx(0.004)
    assert intercept == pytest.approx(0.25)


def test_fit_affine_with_one_batch_size_is_proportional():
    slope, intercept = fit_affine([64, 64, 64], [1.0, 1.2, 1.4])
    assert (slope, intercept) == (pytest.approx(1.2 / 64), 0.0)


def test_fit_affine_clamps_a_negative_intercept_through_the_origin():
    samples, seconds = [10, 20, 30], [0.9, 2.0, 3.1]  # line: 0.11 b - 0.2
    slope, intercept = fit_affine(samples, seconds)
    assert intercept == 0.0
    assert slope == pytest.approx((9 + 40 + 93) / (100 + 400 + 900))


def test_fit_affine_falls_back_on_a_falling_line():
    slope, intercept = fit_affine([10, 20], [2.0, 1.0])
    assert (slope, intercept) == (pytest.approx(1.5 / 15), 0.0)


def test_fit_affine_rejects_bad_input():
    with pytest.raises(ValueError, match="equal length"):
        fit_affine([1, 2], [1.0])
    with pytest.raises(ValueError, match="non-empty"):
        fit_affine([], [])
    with pytest.raises(ValueError, match="samples must be positive"):
        fit_affine([0, 2], [1.0, 2.0])
    with pytest.raises(ValueError, match="seconds must be positive"):
        fit_affine([1, 2], [1.0, math.nan])


# ------------------------------------------------------------------ ShareSolver
def feed(solver, slopes, intercepts, shares, times=1):
    """Emulated groups: a batch of b samples takes a * b + c seconds."""
    for _ in range(times):
        for g, (a, c, b) in enumerate(zip(slopes, intercepts, shares, strict=True)):
            solver.add(g, b, a * b + c)


def test_share_solver_waits_for_full_windows():
    solver = ShareSolver(2, window=4)
    slopes, intercepts = [0.01, 0.01], [0.0, 2.0]
    feed(solver, slopes, intercepts, [200, 200], times=3)
    solver.add(0, 200, 2.0)
    assert not solver.ready()
    assert solver.decide(400) is None  # group 1 has three of four
    solver.add(1, 200, 4.0)
    assert solver.ready()
    # one size per window: the proportional split (rates 100 and 50 per s)
    assert solver.decide(400) == [267, 133]


def test_share_solver_reaches_the_affine_split_once_windows_hold_two_sizes():
    slopes, intercepts = [0.01, 0.01], [0.0, 2.0]
    solver = ShareSolver(2, window=4, shares=[200, 200])
    feed(solver, slopes, intercepts, solver.shares, times=4)
    first = solver.decide(400)
    assert first == [267, 133]
    feed(solver, slopes, intercepts, first, times=2)
    # the windows now hold 200 and 267 (133): the fit is exact, the level 3 s
    assert solver.fits()[1] == (pytest.approx(0.01), pytest.approx(2.0))
    assert solver.decide(400) == [300, 100]
    # settled: one-size windows at equal times reproduce the split
    feed(solver, slopes, intercepts, [300, 100], times=4)
    assert solver.decide(400) is None
    assert solver.shares == [300, 100]


def test_share_solver_dead_band_and_a_change_of_rates():
    intercepts = [0.5, 0.5, 0.5]
    solver = ShareSolver(3, window=3, deadband=0.2, shares=[300, 300, 150])
    # ten per cent slower on group 2: inside the dead-band, no decision
    feed(solver, [0.01, 0.01, 0.022], intercepts, solver.shares, times=3)
    assert solver.decide(750) is None
    # group 0 becomes three times slower: once its window holds only the
    # new speed, the split follows it
    feed(solver, [0.03, 0.01, 0.02], intercepts, solver.shares, times=3)
    new = solver.decide(750)
    assert new is not None and sum(new) == 750
    assert new[0] < 0.8 * 300 and new[1] > 300
    # a new total always gets a split of that total
    assert sum(solver.decide(600)) == 600


def test_share_solver_decides_alike_whatever_order_a_steps_times_arrive():
    # every rank feeds the same measurements, but not necessarily group by
    # group in the same order: the decisions must not depend on it
    def run(order):
        rng = random.Random(3)
        solver = ShareSolver(4, window=5, shares=[100] * 4)
        out = []
        for _ in range(60):
            times = {
                g: (0.001 * (g + 1) + rng.gauss(0, 1e-4)) * solver.shares[g] + 0.1 * g
                for g in range(4)
            }
            for g in order:
                solver.add(g, solver.shares[g], times[g])
            out.append(solver.decide(400))
        return out

    forward = run([0, 1, 2, 3])
    assert any(d is not None for d in forward)
    assert forward == run([3, 1, 0, 2])


def test_share_solver_rejects_bad_input():
    with pytest.raises(ValueError, match="groups must be >= 1"):
        ShareSolver(0)
    with pytest.raises(ValueError, match="window must be >= 1"):
        ShareSolver(2, window=0)
    with pytest.raises(ValueError, match="deadband must be in"):
        ShareSolver(2, deadband=1.0)
    with pytest.raises(ValueError, match="shares must be 2"):
        ShareSolver(2, shares=[1, 2, 3])
    solver = ShareSolver(2)
    with pytest.raises(ValueError, match=r"group must be in \[0, 2\)"):
        solver.add(2, 10, 1.0)
    with pytest.raises(TypeError, match="group must be an int"):
        solver.add(1.0, 10, 1.0)
    with pytest.raises(ValueError, match="samples must be positive"):
        solver.add(0, 0, 1.0)
    with pytest.raises(ValueError, match="seconds must be positive"):
        solver.add(0, 10, -1.0)
    with pytest.raises(TypeError, match="total must be an int"):
        solver.decide(10.5)


# ------------------------------------------------------------------ cost
FAST = Candidate("fast", batch_time_s=1.0, cost_per_hour=12.0, config="8 ranks")
MID = Candidate("mid", batch_time_s=1.6, cost_per_hour=6.0, config="4 ranks")
SLOW = Candidate("slow", batch_time_s=4.0, cost_per_hour=1.5, config="1 rank")
POOL = [FAST, MID, SLOW]


def simulate(controller, candidates, slots, seed=0):
    rng = random.Random(seed)
    longest = 0.0
    picks = []
    for _ in range(slots):
        x = controller.choose(candidates)
        tau = rng.uniform(30.0, 300.0)
        longest = max(longest, tau)
        controller.observe(x, tau)
        picks.append(x)
    return picks, longest


def test_best_static_and_best_mix():
    assert best_static(POOL, 8.0) is MID
    assert best_static(POOL, 100.0) is FAST
    assert best_static(POOL, 1.0) is None
    # two thirds of the time on mid, one third on fast: 0.75 batches/s
    assert best_mix(POOL, 8.0) == pytest.approx(1 / 0.75)
    assert best_mix(POOL, 8.0, weighting="time") == pytest.approx(1.4)
    assert best_mix(POOL, 12.0) == 1.0
    assert best_mix(POOL, 1.5) == 4.0
    assert best_mix(POOL, 1.0) == math.inf
    # per batch the mix is never slower than the time-weighted mean
    for budget in (2.0, 5.0, 7.0, 11.0):
        assert best_mix(POOL, budget) <= best_mix(POOL, budget, weighting="time")
        assert best_mix(POOL, budget) <= best_static(POOL, budget).batch_time_s


def test_best_mix_can_skip_a_dominated_middle():
    # a middle candidate below the chord of the others in batches per second
    # is never part of the best mix
    poor = Candidate("poor", batch_time_s=3.5, cost_per_hour=6.0)
    lam = (12.0 - 6.0) / (12.0 - 1.5)
    assert best_mix([FAST, poor, SLOW], 6.0) == pytest.approx(
        1 / (lam / 4.0 + (1 - lam) / 1.0)
    )


def test_cost_controller_keeps_the_budget_and_approaches_the_best_mix():
    budget, slots = 8.0, 20000
    gaps, costs = {}, {}
    for v in (0.05, 0.2, 0.5, 5.0, 50.0, 5000.0):
        ctl = CostController(budget, v)
        _, longest = simulate(ctl, POOL, slots)
        bounds = cost_bounds(POOL, budget, v, longest, ctl.elapsed_s)
        # the queue bound, and the overspend it allows
        assert ctl.queue <= bounds.queue + 1e-9
        over = ctl.average_cost_per_hour - budget
        assert over <= 3600 * ctl.queue / ctl.elapsed_s + 1e-9
        assert over <= bounds.cost_excess_per_hour + 1e-9
        # the drift-plus-penalty bound on the time-weighted batch time
        assert ctl.time_weighted_batch_time_s <= (
            best_mix(POOL, budget, weighting="time") + bounds.batch_time_gap_s + 1e-9
        )
        gaps[v] = ctl.average_batch_time_s / best_mix(POOL, budget) - 1
        costs[v] = ctl.average_cost_per_hour
        if v <= 50.0:
            # a long horizon: the overspend allowed is a small fraction
            assert bounds.cost_excess_per_hour <= 0.01 * budget
    # small V wastes budget each time the queue empties, and is slower;
    # larger V approaches the best mix per batch
    assert gaps[0.05] > gaps[0.2] > gaps[0.5] > gaps[5.0]
    assert gaps[0.05] > 0.1
    assert abs(gaps[5.0]) < 0.01 and abs(gaps[50.0]) < 0.01
    # and larger still buys time below the best mix with an overspend of
    # order V / elapsed (within the bound checked above)
    assert gaps[5000.0] < 0 and costs[5000.0] > costs[50.0] > budget


def test_cost_controller_with_room_picks_the_fastest():
    ctl = CostController(100.0, 1.0)
    picks, _ = simulate(ctl, [SLOW, MID, FAST], 500)
    assert all(x is FAST for x in picks)
    assert ctl.queue == 0.0
    assert ctl.average_cost_per_hour == pytest.approx(12.0)
    assert ctl.average_batch_time_s == pytest.approx(1.0)


def test_cost_controller_with_no_budget_settles_on_the_cheapest():
    ctl = CostController(0.0, 10.0)
    picks, _ = simulate(ctl, POOL, 2000)
    assert picks[0] is FAST  # an empty queue: time alone decides
    first_slow = picks.index(SLOW)
    assert all(x is SLOW for x in picks[first_slow:])
    # it switched once the queue made slow's cost outweigh its time
    assert first_slow < 200
    # no candidate is within a zero budget: the queue grows without bound
    assert ctl.queue == pytest.approx(ctl.spent)
    assert cost_bounds(POOL, 0.0, 10.0, 300.0, ctl.elapsed_s).queue == math.inf


def test_cost_controller_ties_go_to_the_first():
    a = Candidate("a", 1.0, 2.0)
    b = Candidate("b", 1.0, 2.0)
    ctl = CostController(1.0, 1.0, queue=5.0)
    assert ctl.choose([a, b]) is a
    assert ctl.choose([b, a]) is b


def test_cost_controller_accounts_and_reports():
    ctl = CostController(6.0, 2.0)
    assert ctl.average_cost_per_hour == 0.0 and ctl.average_batch_time_s == 0.0
    ctl.observe(FAST, 1800.0)  # half an hour at 12/h: 6 spent, 3 over
    assert ctl.spent == pytest.approx(6.0) and ctl.queue == pytest.approx(3.0)
    ctl.observe(SLOW, 3600.0)  # an hour at 1.5/h: 4.5 under, the queue empties
    assert ctl.queue == 0.0
    assert ctl.elapsed_s == 5400.0
    assert ctl.average_cost_per_hour == pytest.approx(7.5 / 1.5)
    assert ctl.batches == pytest.approx(1800.0 + 900.0)
    assert ctl.average_batch_time_s == pytest.approx(5400.0 / 2700.0)
    assert ctl.time_weighted_batch_time_s == pytest.approx((1800 + 4 * 3600) / 5400)
    assert "budget_per_hour=6.0" in repr(ctl) and ctl.V == 2.0


def test_cost_inputs_are_checked():
    with pytest.raises(ValueError, match="candidates must not be empty"):
        CostController(1.0, 1.0).choose([])
    with pytest.raises(TypeError, match=r"candidates\[1\] must be a Candidate"):
        CostController(1.0, 1.0).choose([FAST, "slow"])
    with pytest.raises(ValueError, match="V must be positive"):
        CostController(1.0, 0.0)
    with pytest.raises(ValueError, match="budget_per_hour must be non-negative"):
        CostController(-1.0, 1.0)
    with pytest.raises(ValueError, match="queue must be non-negative"):
        CostController(1.0, 1.0, queue=-2.0)
    with pytest.raises(TypeError, match="V must be a number"):
        CostController(1.0, "1")
    with pytest.raises(ValueError, match="batch_time_s must be positive"):
        Candidate("x", 0.0, 1.0)
    with pytest.raises(ValueError, match="cost_per_hour must be non-negative"):
        Candidate("x", 1.0, -1.0)
    with pytest.raises(TypeError, match="name must be a str"):
        Candidate(3, 1.0, 1.0)
    with pytest.raises(ValueError, match="seconds must be non-negative"):
        CostController(1.0, 1.0).observe(FAST, -1.0)
    with pytest.raises(TypeError, match="candidate must be a Candidate"):
        CostController(1.0, 1.0).observe("fast", 1.0)
    with pytest.raises(ValueError, match="weighting must be"):
        best_mix(POOL, 1.0, weighting="slots")
    with pytest.raises(ValueError, match="elapsed_s must be positive"):
        cost_bounds(POOL, 1.0, 1.0, 10.0, 0.0)
