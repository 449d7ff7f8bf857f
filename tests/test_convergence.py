"""The convergence table and ``hybridagg plan --objective time``: interpolation
against hand values, bad files, the predicted time to the target, the
searchers under the time objective, and the command line."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
from test_sim import PACED

from hybridagg.sim.convergence import (
    ConvergenceTable,
    MixedCell,
    fit_staleness_weight,
    group_drift,
    group_staleness,
    load_convergence,
    time_to_target,
    updates_of,
)
from hybridagg.sim.job import machine_cluster
from hybridagg.sim.planfile import load_plan
from hybridagg.sim.planner import compare_searchers
from hybridagg.sim.policy import reinforce_search
from hybridagg.sim.profile import Profile, save_profile
from hybridagg.sim.search import Objective, exact_search
from hybridagg.sim.space import Candidate, CostModel, Space

#: U(16, 0) = 100, U(16, 4) = 200, U(64, 0) = 40, U(64, 4) = 120; undamped
#: runs, so a point's drift is its staleness and values are easy by hand
HAND = ConvergenceTable(
    ((16, 0, 100), (16, 4, 200), (64, 0, 40), (64, 4, 120)), damping="none"
)
#: equal workers under the default damping: drift tau / (1 + tau), so the
#: points sit at drift 0, 0.5, 0.75 and 0.875
INV = ConvergenceTable(((32, 0, 50), (32, 1, 70), (32, 3, 100), (32, 7, 300)))


# ------------------------------------------------------------- interpolation
@pytest.mark.parametrize(
    ("batch", "tau", "updates"),
    [
        (16, 0, 100),  # a point
        (64, 4, 120),
        (16, 2, 150),  # halfway in tau
        (64, 1, 60),
        (16, 6, 400),  # beyond: progress 1/100 -> 1/200 over 4, on to 1/400 at 6
        (16, 9, math.inf),  # beyond: progress 0 at 8, floored there
        (32, 0, 70),  # halfway in log B: log 32 is halfway between log 16, log 64
        (32, 2, 115),  # both: (150 + 80) / 2
        (128, 2, 80),  # clamped above the largest B
        (1000, 0, 40),
        (8, 0, 200),  # below the smallest B: its samples (1,600) held
        (4, 2, 600),  # 150 updates of 16 = 2,400 samples, in updates of 4
    ],
)
def test_updates_to_target_interpolates_by_hand(batch, tau, updates):
    assert HAND.updates_to_target(batch, tau) == pytest.approx(updates, rel=1e-12)


def test_a_batch_measured_at_one_staleness_is_flat_in_staleness():
    table = ConvergenceTable(((32, 0, 50), (128, 0, 20), (128, 3, 80)), damping="none")
    assert table.updates_to_target(32, 7) == 50
    # between B 32 and 128 at tau 1.5: (50 + 50) / 2
    assert table.updates_to_target(64, 1.5) == pytest.approx(50)


def test_a_points_drift_is_its_staleness_damped():
    assert [INV.drift(t) for t in (0, 1, 3, 7)] == pytest.approx([0, 0.5, 0.75, 0.875])
    assert HAND.drift(3) == 3
    sqrt = ConvergenceTable(INV.points, damping="sqrt")
    assert sqrt.drift(3) == pytest.approx(1.5)
    # a point reads back at its staleness and at its drift alike
    assert INV.updates_to_target(32, 3) == INV.updates_to_target(32, drift=0.75) == 100


@pytest.mark.parametrize(
    ("drift", "updates"),
    [
        (0.0, 50),
        (0.625, 85),  # halfway between drift 0.5 (70) and 0.75 (100)
        (0.875, 300),
        # beyond: progress 1/100 at 0.75, 1/300 at 0.875, on along that
        # line (steeper than the fall to zero at 1.75): 1/500 at 0.9, zero
        # at 0.9375
        (0.9, 500),
        (0.9375, math.inf),
        (3.2, math.inf),
    ],
)
def test_updates_along_drift_and_beyond_the_table(drift, updates):
    assert INV.updates_to_target(32, drift=drift) == pytest.approx(updates, rel=1e-12)


def test_progress_beyond_the_table_falls_to_zero_at_twice_its_drift():
    # U falls from tau 1 to tau 3 (drift 0.5 to 0.75): past the last point
    # the progress does not rise; it falls to zero at drift 1.5
    rising = ConvergenceTable(((32, 0, 50), (32, 1, 70), (32, 3, 60)))
    assert rising.updates_to_target(32, drift=0.75) == 60
    assert rising.updates_to_target(32, drift=1.0) == pytest.approx(90)  # 1/60 x 2/3
    assert rising.updates_to_target(32, drift=1.5) == math.inf
    # one point at drift 0.5: zero at 1
    one = ConvergenceTable(((32, 1, 70),))
    assert one.updates_to_target(32, drift=0.75) == pytest.approx(140)
    assert one.updates_to_target(32, drift=3) == math.inf
    # a batch measured at drift 0 alone says nothing about staleness: flat
    assert ConvergenceTable(((32, 0, 50),)).updates_to_target(32, drift=3) == 50


def test_a_batch_between_two_whose_updates_buy_nothing_buys_nothing():
    table = ConvergenceTable(((16, 0, 100), (16, 7, 110), (64, 0, 40), (64, 1, 400)))
    # drift 0.8: B 64's progress is gone (zero at 0.5 + 1/400 / slope),
    # B 16's is not
    assert math.isfinite(table.updates_to_target(16, drift=0.8))
    assert table.updates_to_target(64, drift=0.8) == math.inf
    assert table.updates_to_target(32, drift=0.8) == math.inf


def test_updates_to_target_refuses_bad_arguments():
    with pytest.raises(ValueError, match="batch must be > 0"):
        HAND.updates_to_target(0, 0)
    with pytest.raises(ValueError, match="staleness must be >= 0"):
        HAND.updates_to_target(16, -1)
    with pytest.raises(ValueError, match="staleness must be finite"):
        HAND.updates_to_target(16, math.nan)
    with pytest.raises(ValueError, match="drift must be >= 0"):
        HAND.updates_to_target(16, drift=-0.5)
    with pytest.raises(ValueError, match="drift must be finite"):
        HAND.updates_to_target(16, drift=math.inf)
    with pytest.raises(ValueError, match="damping must be one of inverse, sqrt, none"):
        ConvergenceTable(HAND.points, damping="linear")


# ------------------------------------------------------------------- the file
@pytest.mark.parametrize(
    ("data", "message"),
    [
        ([1, 2], "expected a JSON object with 'points'"),
        ({"points": []}, "'points' must be a non-empty list"),
        ({"points": [3]}, "point 0 must be an object"),
        ({"points": [{"batch": 16, "updates": 5}]}, "point 0 lacks staleness"),
        ({"points": [{"batch": 0, "staleness": 0, "updates": 5}]}, "batch must be > 0"),
        ({"points": [{"batch": 16, "staleness": -1, "updates": 5}]}, "staleness must be >= 0"),
        ({"points": [{"batch": 16, "staleness": 0, "updates": 0}]}, "updates must be > 0"),
        ({"points": [{"batch": 16, "staleness": 0, "updates": "5"}]}, "updates must be a number"),
        ({"points": [{"batch": True, "staleness": 0, "updates": 5}]}, "batch must be a number"),
        ({"points": [{"batch": 16, "staleness": 0, "updates": 5},
                     {"batch": 16, "staleness": 0, "updates": 6}]}, "appears twice"),
        ({"points": [{"batch": 16, "staleness": 0, "updates": 5}],
          "target_accuracy": 2}, "target_accuracy must be in"),
        ({"points": [{"batch": 16, "staleness": 0, "updates": 5}],
          "eval_every": 0}, "eval_every must be an integer >= 1"),
        ({"points": [{"batch": 16, "staleness": 0, "updates": 5}],
          "eval_every": "5"}, "eval_every must be an integer >= 1"),
        ({"points": [{"batch": 16, "staleness": 0, "updates": 5}],
          "damping": "linear"}, "damping must be one of"),
        ({"points": [{"batch": 16, "staleness": 0, "updates": 5}],
          "staleness_weight": 1.5}, r"staleness_weight must be in \[0, 1\]"),
        ({"points": [{"batch": 16, "staleness": 0, "updates": 5}],
          "staleness_weight": "0.5"}, r"staleness_weight must be in \[0, 1\]"),
    ],
)  # fmt: skip
def test_bad_convergence_files_are_refused(tmp_path, data, message):
    path = tmp_path / "c.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=message) as err:
        load_convergence(path)
    assert str(path) in str(err.value)


def test_missing_and_unreadable_files_are_refused(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_convergence(tmp_path / "none.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="cannot be read as JSON"):
        load_convergence(bad)


def test_a_file_reads_back_and_extra_keys_are_ignored(tmp_path):
    path = tmp_path / "c.json"
    data = {**HAND.as_dict(), "records": [{"seed": 0}], "command": "x"}
    data["points"][0]["workers"] = 1  # bench/convergence.py's extra keys
    path.write_text(json.dumps(data))
    assert load_convergence(path) == HAND


def test_a_file_holds_a_table_per_validation_cadence(tmp_path):
    """``points`` at the file's ``eval_every``; ``tables`` the same runs at others."""
    path = tmp_path / "c.json"
    five = {"eval_every": 5, "points": [{"batch": 16, "staleness": 0, "updates": 7}]}
    path.write_text(json.dumps({**HAND.as_dict(), "tables": [five]}))
    assert load_convergence(path) == HAND and HAND.eval_every == 1
    assert load_convergence(path, 1) == HAND
    at5 = load_convergence(path, 5)
    assert at5.eval_every == 5 and at5.points == ((16, 0, 7),)
    assert at5.damping == "none"  # the file's rule, for every table in it
    with pytest.raises(ValueError, match=r"no table at --eval-every 10 \(it has 1, 5;"):
        load_convergence(path, 10)
    # an older file (no eval_every, no damping) was measured validating
    # every update, under the default damping
    data = HAND.as_dict()
    del data["eval_every"], data["damping"]
    path.write_text(json.dumps(data))
    assert load_convergence(path, 1) == ConvergenceTable(HAND.points)
    with pytest.raises(ValueError, match=f"convergence file {path}: no table at"):
        load_convergence(path, 5)
    path.write_text(json.dumps({**HAND.as_dict(), "tables": 5}))
    with pytest.raises(ValueError, match="'tables' must be a list"):
        load_convergence(path, 5)
    bad = {"eval_every": 5, "points": [{"batch": 16, "staleness": 0, "updates": 0}]}
    path.write_text(json.dumps({**HAND.as_dict(), "tables": [bad]}))
    with pytest.raises(ValueError, match="point 0: updates must be > 0"):
        load_convergence(path, 5)


# ------------------------------------------------------ the time to the target
def test_group_staleness_is_the_other_groups_updates_in_a_cycle():
    assert group_staleness([1.0] * 4) == pytest.approx([3.0] * 4)
    assert group_staleness([1.0, 2.0]) == pytest.approx([0.5, 2.0])
    assert group_staleness([5.0]) == [0.0]
    with pytest.raises(ValueError, match="cycles must be > 0"):
        group_staleness([1.0, 0.0])


def test_group_drift_is_the_other_groups_updates_damped():
    # equal groups: (k - 1) / k under the default rule, staleness undamped
    assert group_drift([1.0] * 4) == pytest.approx([0.75] * 4)
    assert group_drift([1.0] * 4, "none") == pytest.approx(group_staleness([1.0] * 4))
    # a fast group (tau 0.25, damped 0.8) and a 4x slower one (tau 4, 0.2)
    assert group_drift([1.0, 4.0]) == pytest.approx([0.05, 3.2])
    with pytest.raises(ValueError, match="damping rule must be one of"):
        group_drift([1.0, 2.0], "linear")


def test_a_slow_groups_updates_past_the_tables_drift_buy_nothing():
    # the fast group at drift 0.05 (U 52), the slow one at 3.2 (nothing)
    assert time_to_target(INV, "async", [32, 32], [1.0, 4.0]) == pytest.approx(52)
    # keyed by staleness (4, clamped at the table's 7) the slow group's
    # updates would have counted
    steep = ConvergenceTable(((32, 0, 50), (32, 1, 1000)))
    assert time_to_target(steep, "async", [32] * 4, [1.0] * 4) == math.inf
    assert time_to_target(steep, "sync", [32] * 4, [1.0] * 4) == 50


def test_time_to_target_by_hand():
    # sync: one update of 64 samples per 0.5 s step, at staleness 0
    assert time_to_target(HAND, "sync", [32, 32], [0.5, 0.4]) == pytest.approx(20)
    # async, two groups of 16 every second: tau 1, U = 125; 2 updates/s
    assert time_to_target(HAND, "async", [16, 16], [1.0, 1.0]) == pytest.approx(62.5)
    # a fast group (64 every 0.5 s, tau 0.25: U 45) and a slow one (16 every
    # 2 s, tau 4: U 200): progress 1/22.5 + 1/400 per second
    assert time_to_target(HAND, "hybrid", [64, 16], [0.5, 2.0]) == pytest.approx(
        1 / (1 / 22.5 + 1 / 400)
    )
    with pytest.raises(ValueError, match="one cycle per group"):
        time_to_target(HAND, "async", [16], [1.0, 1.0])


# ------------------------------------------- an update's own staleness beside its drift
def _weighted(table: ConvergenceTable, w: float) -> ConvergenceTable:
    return ConvergenceTable(table.points, table.target_accuracy, table.eval_every,
                            table.damping, w)  # fmt: skip


def test_the_staleness_weight_blends_the_two_readings_geometrically():
    # staleness 3 at drift 0.5: read at drift 0.5 (70) and at staleness 3's
    # own drift among equal workers, 0.75 (100)
    assert INV.updates_to_target(32, 3, drift=0.5) == 70  # weight 0: drift alone
    assert _weighted(INV, 1).updates_to_target(32, 3, drift=0.5) == 100
    half = _weighted(INV, 0.5)
    assert half.updates_to_target(32, 3, drift=0.5) == pytest.approx(math.sqrt(7000))
    # equal workers: staleness and drift agree, so the weight changes nothing
    assert half.updates_to_target(32, 3, drift=0.75) == pytest.approx(100)
    # either reading buying nothing buys nothing
    assert half.updates_to_target(32, 0, drift=3) == math.inf
    # the staleness alone still reads at its drift
    assert half.updates_to_target(32, 3) == 100
    with pytest.raises(ValueError, match="give the staleness beside the drift"):
        half.updates_to_target(32, drift=0.5)
    for bad in (-0.1, 1.01, True, "0.5", math.nan):
        with pytest.raises(ValueError, match=r"staleness_weight must be in \[0, 1\]"):
            _weighted(INV, bad)


def test_time_to_target_weighs_a_fast_groups_own_staleness_by_hand():
    # a fast group (tau 0.25: drift 0.2 among equal workers; its drift 0.05)
    # and a 4x slower one (drift 3.2: nothing): U = sqrt(52 x 58)
    half = _weighted(INV, 0.5)
    fast = math.sqrt(52 * 58)
    assert time_to_target(half, "async", [32, 32], [1.0, 4.0]) == pytest.approx(fast)
    # updates made meanwhile: every group's, 1 + 1/4 a second
    assert updates_of(half, "async", [32, 32], [1.0, 4.0]) == pytest.approx(1.25 * fast)
    # sync: one update of 64 (clamped to B 32's 50) per slowest cycle
    assert updates_of(INV, "sync", [32, 32], [1.0, 2.0]) == pytest.approx(50)


#: mixed runs: 1x + 4x, the headline (1, 1, 4, 4), the uneven cluster's
#: three speeds in async and grouped by speed in hybrid
MIXED = (
    ("async", (32, 32), (1, 4)),
    ("async", (32,) * 4, (1, 1, 4, 4)),
    ("async", (32,) * 8, (1, 1, 2, 2, 2, 4, 4, 4)),
    ("hybrid", (64, 96, 96), (1, 2, 4)),
)


def test_fitting_the_weight_recovers_the_one_the_runs_followed():
    truth = _weighted(INV, 0.3)
    cells = [MixedCell(m, b, c, updates_of(truth, m, b, c)) for m, b, c in MIXED]
    weight, predicted = fit_staleness_weight(INV, cells)
    assert weight == pytest.approx(0.3)
    assert predicted == pytest.approx([c.updates for c in cells])
    # the weight matters here: drift alone predicts fewer updates
    assert updates_of(INV, *MIXED[2]) < cells[2].updates
    with pytest.raises(ValueError, match="needs mixed cells"):
        fit_staleness_weight(INV, [])
    steep = ConvergenceTable(((32, 0, 50), (32, 1, 1000)))
    with pytest.raises(ValueError, match="no staleness weight gets every mixed cell"):
        fit_staleness_weight(steep, [MixedCell("async", (32,) * 4, (1,) * 4, 90)])


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("sync", (32,), (1,), 50), "mode must be hybrid or async"),
        (("async", (32, 32), (1,), 50), "one cycle per group"),
        (("async", (), (), 50), "one cycle per group"),
        (("async", (32, 32), (1, 0), 50), "must be > 0"),
        (("async", (32, 32), (1, 4), 0), "updates must be > 0"),
    ],
)
def test_bad_mixed_cells_are_refused(args, message):
    with pytest.raises(ValueError, match=message):
        MixedCell(*args)


def test_a_files_staleness_weight_per_cadence(tmp_path):
    point = [{"batch": 16, "staleness": 0, "updates": 7}]
    data = {"points": point, "staleness_weight": 0.4, "tables": [
        {"eval_every": 5, "points": point, "staleness_weight": 0.2},
        {"eval_every": 10, "points": point}]}  # fmt: skip
    path = tmp_path / "w.json"
    path.write_text(json.dumps(data))
    assert load_convergence(path).staleness_weight == 0.4
    assert load_convergence(path, 5).staleness_weight == 0.2
    assert load_convergence(path, 10).staleness_weight == 0.4  # the file's
    table = _weighted(INV, 0.25)
    assert ConvergenceTable.from_dict(table.as_dict()) == table
    # older files: drift alone
    path.write_text(json.dumps({"points": point}))
    assert load_convergence(path).staleness_weight == 0


# ---------------------------------------------------------- the planner's use
# (paced: the emulated workers' own compute is next to nothing, as the digits')
BIG = Profile(**{**PACED.__dict__, "parameters": 10_000_000})
#: staleness hurts a lot, larger updates help
STALE = ConvergenceTable(((32, 0, 100), (32, 3, 1000), (128, 0, 30), (128, 3, 300)))
#: samples to the target 4,096 whatever the batch and staleness (measured
#: far enough that no group's drift is beyond the table)
FREE = ConvergenceTable(
    tuple((b, t, 4096 / b) for b in (32, 64, 128) for t in (0, 1000)), damping="none"
)


def _model(table: ConvergenceTable | None) -> CostModel:
    """4 emulated workers, 2-3 four times slower (bench/planned.py's headline)."""
    return CostModel(machine_cluster(BIG, 4, 0), BIG, batch_size=32, workers=4,
                     slowdown="2-3:4", sample_ms=1.0, convergence=table)  # fmt: skip


def test_the_time_objective_prefers_fewer_larger_fresher_updates():
    space = _model(None).default_space()
    fast = exact_search(_model(STALE), space, Objective("throughput"))
    soon = exact_search(_model(STALE), space, Objective("time"))
    assert fast.best.mode == "async"  # the most samples/s: every worker alone
    assert soon.best.mode == "sync"  # one update of 128 samples at staleness 0
    assert soon.score.time_to_target_s < fast.score.time_to_target_s
    assert soon.score.samples_per_sec < fast.score.samples_per_sec
    # without sync, hybrid's updates of two workers beat async's of one
    no_sync = Space(**{**space.__dict__, "modes": ("hybrid", "async")})
    assert exact_search(_model(STALE), no_sync, Objective("time")).best.mode == "hybrid"


def test_when_only_samples_count_time_is_samples_over_throughput():
    model = _model(FREE)
    space = Space(**{**model.default_space().__dict__, "batches": ("equal",)})
    scored = 0
    for c in space.candidates_on((4,)):
        s = model.score(c)
        if s is not None:
            scored += 1
            assert s.time_to_target_s == pytest.approx(4096 / s.samples_per_sec)
    assert scored > 5
    fast = exact_search(model, space, Objective("throughput"))
    soon = exact_search(model, space, Objective("time"))
    assert fast.score == soon.score


def test_exact_search_under_time_is_brute_force_and_matches_it():
    model = _model(STALE)
    space = model.default_space()
    exact = exact_search(model, space, Objective("time"))
    assert exact.pruned == 0  # no bound holds for time (search.py's module)
    times = [
        s.time_to_target_s
        for n in space.node_choices()
        for c in space.candidates_on(n)
        if (s := model.score(c)) is not None
    ]
    assert exact.score.time_to_target_s == min(times)
    brute = exact_search(_model(STALE), space, Objective("time"), prune=False)
    assert brute.score == exact.score


def test_reinforce_under_time_is_close_to_exact_and_deterministic():
    space = _model(None).default_space()
    runs = [
        reinforce_search(_model(STALE), space, Objective("time"), seed=1, rounds=40)
        for _ in range(2)
    ]
    assert runs[0].best == runs[1].best
    report = compare_searchers(_model(STALE), space, Objective("time"), seeds=2,
                               rounds=40)  # fmt: skip
    assert report["max_gap"] <= 0.05
    assert report["exact"]["time_to_target_s"] > 0


def test_the_time_objective_needs_the_table():
    model = _model(None)
    with pytest.raises(ValueError, match="--objective time needs --convergence"):
        exact_search(model, model.default_space(), Objective("time"))
    with pytest.raises(ValueError, match="--objective time needs --convergence"):
        reinforce_search(model, model.default_space(), Objective("time"), rounds=1)
    with pytest.raises(ValueError, match="goes with --objective cost"):
        Objective("time", 10.0)


# ------------------------------------------------------------- command line
def _plan(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "hybridagg.cli", "plan", *args],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip


def test_command_plans_for_time_and_refuses_half_the_pair(tmp_path):
    prof = save_profile(BIG, tmp_path / "p.json")
    table = tmp_path / "c.json"
    table.write_text(json.dumps(STALE.as_dict()))
    common = ["--profile", str(prof), "-n", "4", "--slowdown", "2-3:4",
              "--sample-ms", "1", "--confirm-workers", "0"]  # fmt: skip
    alone = _plan(*common, "--objective", "time")
    assert alone.returncode == 2 and "needs --convergence FILE" in alone.stderr
    stray = _plan(*common, "--convergence", str(table))
    assert stray.returncode == 2
    assert "--convergence goes with --objective time" in stray.stderr
    out = tmp_path / "plan.json"
    done = _plan(*common, "--objective", "time", "--convergence", str(table),
                 "--json", str(out))  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "predicted time to target" in done.stdout
    assert "validating every 1 updates" in done.stdout
    data = json.loads(out.read_text())
    assert data["objective"] == "time" and data["mode"] == "sync"
    assert data["eval_every"] == 1
    assert data["predicted_time_to_target_s"] > 0
    assert data["sync_time_to_target_s"] == data["predicted_time_to_target_s"]
    assert load_plan(out).predicted_time_to_target_s == pytest.approx(
        data["predicted_time_to_target_s"]
    )
    # the table at the cadence the job validates at; one the file lacks
    slower = {**STALE.as_dict(), "eval_every": 5}
    table.write_text(json.dumps({**STALE.as_dict(), "tables": [slower]}))
    at5 = _plan(*common, "--objective", "time", "--convergence", str(table),
                "--eval-every", "5", "--json", str(out))  # fmt: skip
    assert at5.returncode == 0, at5.stderr
    assert json.loads(out.read_text())["eval_every"] == 5
    missing = _plan(*common, "--objective", "time", "--convergence", str(table),
                    "--eval-every", "3")  # fmt: skip
    assert missing.returncode == 2 and "no table at --eval-every 3" in missing.stderr
    orphan = _plan(*common, "--eval-every", "5")
    assert orphan.returncode == 2
    assert "--eval-every goes with --convergence" in orphan.stderr
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"points": []}))
    refused = _plan(*common, "--objective", "time", "--convergence", str(bad))
    assert refused.returncode == 2 and "'points' must be a non-empty list" in (
        refused.stderr
    )


def test_plan_flags_are_exactly_the_published_ones():
    from hybridagg.train.config.simulation import PLAN_CONCERNS, PlanConfig
    from hybridagg.train.flags import option_strings

    assert sorted(option_strings(PlanConfig, PLAN_CONCERNS)) == [
        "--batch-choices", "--batch-size", "--classes", "--cluster",
        "--confirm-band", "--confirm-workers", "--convergence", "--data", "--eval-every", "--json", "--lr",
        "--micro-batches", "--min-samples-per-sec", "--model", "--momentum",
        "--objective", "--optimizer", "--out", "--pipelines", "--profile", "--rounds", "--sample-ms",
        "--sample-shape", "--searcher", "--seed", "--sim-timeout", "--slowdown",
        "--warmup-updates", "--weight-decay", "--wire", "--workers", "-n",
    ]  # fmt: skip


def _uneven(table: ConvergenceTable | None) -> CostModel:
    """8 emulated workers of three speeds (bench/planned.py's uneven-8)."""
    return CostModel(machine_cluster(BIG, 8, 0), BIG, batch_size=32, workers=8,
                     slowdown="0-1:1,2-4:2,5-7:4", sample_ms=2.0,
                     convergence=table)  # fmt: skip


def test_the_emulated_space_keeps_whole_speed_classes_fastest_first():
    model = _uneven(None)
    assert model.worker_counts() == (2, 5, 8)
    space = model.default_space()
    assert space.nodes == ((2, 5, 8),)
    five = Candidate("async", (5,), "each", 1, "this-machine")
    assert model.slowdown_for(five) == "2-4:2"  # renumbered from 0
    assert model.slowdown_for(Candidate("sync", (2,))) is None  # all at speed 1
    assert model.slowdown_for(Candidate("sync", (8,))) == "0-1:1,2-4:2,5-7:4"
    job = model.job(five)
    assert len(job.workers) == 5
    # the ideal is the kept workers' rates alone: 2 at 32 samples per 64 ms,
    # 3 at 32 per 128 ms
    assert job.ideal_samples_per_sec() == pytest.approx(2 * 500 + 3 * 250)
    with pytest.raises(ValueError, match="1 to 8 of this machine's workers, not 9"):
        model.cluster_for(Candidate("sync", (9,)))
    # speed classes that are not runs of ranks: the fastest keep rank order
    mixed = CostModel(machine_cluster(BIG, 4, 0), BIG, workers=4,
                      slowdown="0:4,1:2,2:1,3:2", sample_ms=1.0)  # fmt: skip
    assert mixed.worker_counts() == (1, 3, 4)
    assert mixed.slowdown_for(Candidate("sync", (3,))) == "0:2,2:2"
    changing = CostModel(machine_cluster(BIG, 4, 0), BIG, workers=4,
                         slowdown="2-3:4@0;0-1:4@5", sample_ms=1.0)  # fmt: skip
    assert changing.worker_counts() == (4,)


def test_the_time_objective_leaves_slow_stale_workers_idle_when_staleness_costs():
    # updates grow tenfold with 3 versions of staleness: async on the 5
    # fastest (less stale) beats async on all 8; when only samples count,
    # every worker's samples are worth having
    stale = ConvergenceTable(((32, 0, 100), (32, 3, 1000), (32, 7, 3000)))
    only = Space(nodes=((2, 5, 8),), modes=("async",), servers=(1,),
                 server_types=("this-machine",), batches=("equal",))  # fmt: skip
    soon = exact_search(_uneven(stale), only, Objective("time"))
    assert soon.best.nodes != (8,)
    free = ConvergenceTable(tuple((32, t, 128) for t in (0, 3, 7)))
    assert exact_search(_uneven(free), only, Objective("time")).best.nodes == (8,)
