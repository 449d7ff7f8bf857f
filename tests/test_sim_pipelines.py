"""Pipelined groups in the profile, the simulator, the planner and plan files.

The simulator's pipelined step is the schedule's exact event simulation
(closed form checked here for equal stages), the analytic model and SimGrid
agree on a pipelined hybrid job, the planner proposes pipelines where a
whole replica does not fit a device, and ``hybridagg train --plan`` runs a
planned pipelined job.
"""

from __future__ import annotations

import json
from dataclasses import replace
from types import SimpleNamespace

import pytest
from train_helpers import output, run_train, summary

from hybridagg.sim import (
    ClusterSpec,
    LinkSpec,
    NodeType,
    ServerPlacement,
    build_job,
    simulate,
)
from hybridagg.sim._simgrid import SimGridMissing, find_extension
from hybridagg.sim.analytic import estimate
from hybridagg.sim.planfile import load_plan, make_plan
from hybridagg.sim.profile import (
    MachineInfo,
    Profile,
    ServerFit,
    UnitCost,
    load_profile,
    save_profile,
)
from hybridagg.sim.search import Objective, exact_search
from hybridagg.sim.space import Candidate, CostModel
from hybridagg.train.config import TrainConfig
from hybridagg.train.models import mlp
from hybridagg.train.profiler import pipeline_unit_costs

try:
    find_extension()
    HAVE_SIMGRID = True
except SimGridMissing:
    HAVE_SIMGRID = False
needs_simgrid = pytest.mark.skipif(
    not HAVE_SIMGRID, reason="SimGrid is not installed (make simgrid)"
)

UNITS = tuple(
    UnitCost(cost=1.0, parameters=1000, output_bytes=4096.0) for _ in range(8)
)
PROFILE = Profile(
    model="m",
    parameters=8000,
    sample_shape=(3,),
    forward_s_per_sample=0.001,
    backward_s_per_sample=0.002,
    parameter_bytes=32000.0,
    activation_bytes_per_sample=0.0,
    server=ServerFit(seconds_per_update=0.0004, seconds_per_byte=2e-10),
    machine=MachineInfo(cores=2, memcpy_Bps=5e9),
    units=UNITS,
)


def options(**kw):
    base = dict(
        mode="hybrid", groups=None, servers=1, batch_size=32, slowdown=None,
        sample_ms=0.0, adaptive_batch=False, adaptive_groups=False, min_batch=1,
        max_batch=None, overlap=False, wire="fp32", steps=40, epochs=None,
        stream_push=False, staleness_bound=None, accumulate=1, amp="none",
        device="cpu", eval_every=None, pipeline_groups=None, micro_batches=4,
        pipeline_schedule="1f1b", pipeline_partition="auto",
    )  # fmt: skip
    base.update(kw)
    return SimpleNamespace(**base)


def devices(n: int, bw: float = 1e9, lat: float = 1e-5, memory=None) -> ClusterSpec:
    node = NodeType(name="g", count=n, devices=1, memory=memory)
    return ClusterSpec(
        name="t", node_types=(node,), intra_node=LinkSpec(bw, lat),
        inter_node=LinkSpec(bw, lat), servers=ServerPlacement(("g",), 1),
    )  # fmt: skip


# ------------------------------------------------------------------ profile
def test_profile_records_the_runs_units_and_checks_them(tmp_path):
    model = mlp((64,), 10)
    units, why = pipeline_unit_costs(model, (64,))
    assert why == "" and len(units) == 3
    assert sum(u.parameters for u in units) == sum(
        p.numel() for p in model.parameters()
    )
    assert [u.output_bytes for u in units] == [128 * 4, 64 * 4, 0.0]
    saved = save_profile(PROFILE, tmp_path / "p.json")
    assert load_profile(saved).units == UNITS
    data = json.loads(saved.read_text())
    for bad, match in [
        ([{"cost": 1, "parameters": 10, "output_bytes": 0}], "hold 10 parameters"),
        ([{"cost": -1, "parameters": 8000, "output_bytes": 0}], r"units\[0\]\.cost"),
        ([{"cost": 1, "parameters": 8000}], r"units\[0\]\.output_bytes"),
        ([{"cost": 0, "parameters": 8000, "output_bytes": 0}], "cost above 0"),
        ("x", "units must be a list"),
    ]:
        (tmp_path / "bad.json").write_text(json.dumps({**data, "units": bad}))
        with pytest.raises(ValueError, match=match):
            load_profile(tmp_path / "bad.json")


# ---------------------------------------------------------------- simulator
def test_equal_stages_take_the_closed_form_1f1b_time():
    # two equal ranks, equal units, free links: the cut is even and a
    # 1F1B batch of M equal micro-batches takes (M + S - 1) x (F + B)
    job = build_job(
        options(groups="0-1", pipeline_groups="0", sample_ms=2.0),
        devices(2, bw=1e15, lat=0.0),
        PROFILE,
    )
    spec = job.pipelines[0]
    assert spec["bounds"] == [0, 4, 8]
    assert spec["parts"] == [16000.0, 16000.0]
    per_micro = 0.002 * 0.5 * 8  # a stage's half of 8 samples' time
    assert job.pipeline_step_seconds(0) == pytest.approx((4 + 2 - 1) * per_micro)
    assert [w["batch"] for w in job.workers] == [32, 0]


def test_the_cut_follows_the_ranks_speeds_as_the_run_sees_them():
    slow = build_job(
        options(groups="0-1", pipeline_groups="0", sample_ms=1.0, slowdown="1:4"),
        devices(2, bw=1e15, lat=0.0),
        PROFILE,
    )
    # 7:1 of equal units at 4x: 7/8 on the fast rank, 4/8 on the slow one
    assert slow.pipelines[0]["bounds"] == [0, 7, 8]
    # a later phase of --slowdown does not re-pace a stage (a run's pace is
    # fixed at the start), so the step is the same in every phase
    phased = build_job(
        options(
            groups="0-1", pipeline_groups="0", sample_ms=1.0, slowdown="1:4@0;1:1@5"
        ),
        devices(2, bw=1e15, lat=0.0),
        PROFILE,
    )
    assert phased.pipelines[0]["bounds"] == [0, 7, 8]
    assert phased.frozen_at(10.0).pipeline_step_seconds(0) == pytest.approx(
        slow.pipeline_step_seconds(0)
    )


def test_a_stage_must_fit_its_device():
    # 8 units of 1,000 parameters: a stage of 4 needs 32,000 bytes (weights
    # and gradient), a whole replica 64,000
    def score(memory, pipelines):
        model = CostModel(devices(4, memory=memory), PROFILE, batch_size=32)
        c = Candidate("hybrid", (4,), "split:2", 1, "g", pipelines=pipelines)
        return model.score(c), model.error(c)

    assert score(40000, "groups")[0] is not None
    plain, why = score(40000, "none")
    assert plain is None and "out of memory" in why
    tight, why = score(20000, "groups")
    assert tight is None and "out of memory" in why


@pytest.mark.parametrize(
    "kw, match",
    [
        (
            {
                "mode": "sync",
                "servers": None,
                "groups": "0-1,2",
                "pipeline_groups": "0",
            },
            "hybrid mode",
        ),
        ({"groups": "0-1,2", "pipeline_groups": "1"}, "of one rank"),
        ({"groups": "0-1,2", "pipeline_groups": "x"}, "group indices"),
        ({"groups": "0-1,2-3", "pipeline_groups": "0"}, "are not pipelines"),
        ({"groups": "0-1,2", "pipeline_groups": "0", "adaptive_batch": True}, "sync"),
        ({"groups": "0-1,2", "pipeline_groups": "0", "overlap": True}, "overlap"),
        ({"groups": "0-1,2", "pipeline_groups": "0", "wire": "bf16"}, "fp32"),
        ({"groups": "0-1,2", "pipeline_groups": "0", "accumulate": 2}, "accumulate"),
    ],
)
def test_what_a_simulated_pipeline_refuses(kw, match):
    with pytest.raises(ValueError, match=match):
        build_job(options(**kw), devices(4 if "2-3" in kw["groups"] else 3), PROFILE)


def test_a_profile_without_units_cannot_simulate_a_pipeline():
    with pytest.raises(ValueError, match="no pipeline units"):
        build_job(
            options(groups="0-1,2", pipeline_groups="0"),
            devices(3),
            replace(PROFILE, units=()),
        )


@needs_simgrid
@pytest.mark.parametrize("servers", [1, 2])
def test_simgrid_and_the_analytic_model_agree_on_a_pipelined_hybrid_job(servers):
    job = build_job(
        options(
            groups="0-1,2",
            pipeline_groups="0",
            slowdown="1:4",
            sample_ms=1.0,
            servers=servers,
            steps=60,
        ),
        devices(3, bw=1e9, lat=1e-5),
        PROFILE,
    )
    predicted = estimate(job)
    simulated = simulate(job)
    assert simulated.samples_per_sec == pytest.approx(
        predicted.samples_per_sec, rel=0.03
    )
    step = job.pipeline_step_seconds(0)
    # a pipelined group's cycle is its schedule's time plus its exchange
    assert step < simulated.group_update_s[0] < step * 1.1
    assert simulated.mean_staleness > 0


# ------------------------------------------------------------------ planner
def _model(memory=None, pipelines=True) -> tuple[CostModel, object]:
    big = replace(PROFILE, parameter_bytes=8e9, activation_bytes_per_sample=0.0)
    model = CostModel(devices(4, bw=1e10, lat=1e-5, memory=memory), big, batch_size=32)
    space = model.default_space(pipelines=pipelines)
    return model, space


def test_the_planner_pipelines_a_model_no_device_can_hold():
    # 8 GB of weights, 12 GiB devices: a whole replica (weights and gradient,
    # 16 GB) does not fit; half of it per stage (8 GB) does
    model, space = _model(memory=12 * 2**30)
    assert "groups" in space.pipelines
    result = exact_search(model, space, Objective("throughput"))
    assert result.best is not None and result.best.pipelines == "groups"
    assert result.best.mode == "hybrid"
    job = model.job(result.best)
    assert all(
        model.stage_memory(p, k) <= 12 * 2**30
        for p in job.pipelines
        if p is not None
        for k in range(len(p["ranks"]))
    )
    off, space_off = _model(memory=12 * 2**30, pipelines=False)
    assert exact_search(off, space_off, Objective("throughput")).best is None


def test_exact_search_with_pipelines_matches_brute_force():
    model, space = _model(memory=40 * 2**30)
    objective = Objective("throughput")
    pruned = exact_search(model, space, objective)
    fresh, _ = _model(memory=40 * 2**30)
    brute = exact_search(fresh, space, objective, prune=False)
    assert pruned.score == brute.score


def test_a_pipelined_plan_file_round_trips_into_train_options(tmp_path):
    model = CostModel(
        devices(3), PROFILE, batch_size=32, workers=3, slowdown="1:4", sample_ms=1.0
    )
    c = Candidate("hybrid", (3,), "split:2", 1, "this-machine", pipelines="groups")
    score = model.score(c)
    assert score is not None, model.error(c)
    plan = make_plan(
        model, c, score, objective="throughput", min_samples_per_sec=None,
        searcher="exact",
    )  # fmt: skip
    assert plan.groups == [[0], [1, 2]] and plan.pipeline_groups == [1]
    assert plan.batch_sizes == [32, 32, 0]
    assert "--pipeline-groups" in plan.train_args()
    path = plan.save(tmp_path / "plan.json")
    loaded = load_plan(path)
    assert loaded.pipeline_groups == [1] and loaded.pipeline_bounds
    cfg = _train_config(["train", "--data", "d.h5", "--plan", str(path)])
    assert cfg.pipeline_groups == "1" and cfg.micro_batches == 4
    assert cfg.groups == plan.train_args()[plan.train_args().index("--groups") + 1]
    with pytest.raises(ValueError, match="--pipeline-groups"):
        _train_config(
            ["train", "--data", "d.h5", "--plan", str(path), "--pipeline-groups", "0"]
        )
    good = json.loads(path.read_text())
    for change, match in [
        ({"pipeline_groups": [0]}, "exactly the groups of several ranks"),
        ({"pipeline_groups": [1, 1]}, "repeats"),
        ({"pipeline_groups": [True]}, "group indices"),
        ({"adaptive_batch": True}, "adaptive_batch"),
        ({"micro_batches": 0}, "micro_batches"),
        ({"pipeline_bounds": [[0, 3, 2]]}, "pipeline_bounds"),
        ({"pipeline_bounds": []}, "one cut per pipelined group"),
        ({"mode": "sync", "servers": 0, "ranks": 3}, "hybrid mode only"),
    ]:
        (tmp_path / "bad.json").write_text(json.dumps({**good, **change}))
        with pytest.raises(ValueError, match=match):
            load_plan(tmp_path / "bad.json")
    # a plan without pipelines pins that too: --pipeline-groups conflicts
    plain = Candidate("hybrid", (3,), "split:2", 1, "this-machine")
    flat = make_plan(
        model, plain, model.score(plain), objective="throughput",
        min_samples_per_sec=None, searcher="exact",
    ).save(tmp_path / "flat.json")  # fmt: skip
    with pytest.raises(ValueError, match="--pipeline-groups"):
        _train_config(
            ["train", "--data", "d.h5", "--plan", str(flat), "--pipeline-groups", "1"]
        )


def _train_config(argv: list[str]) -> TrainConfig:
    from hybridagg.cli import build_parser
    from hybridagg.train.flags import config_from_args, given_fields

    args = build_parser().parse_args(argv)
    args.given_flags = given_fields(argv[1:])
    return config_from_args(args)


# ---------------------------------------------------------------- a real job
@pytest.fixture(scope="module")
def digits(tmp_path_factory):
    from hybridagg.data import convert_digits

    path = tmp_path_factory.mktemp("data") / "digits.h5"
    convert_digits(path, val_fraction=0.2, seed=0, progress=False)
    return str(path)


def test_hybridagg_train_runs_a_planned_pipelined_job(digits, tmp_path):
    units, _ = pipeline_unit_costs(mlp((64,), 10), (64,))
    profile = replace(PROFILE, parameters=sum(u.parameters for u in units), units=units)
    model = CostModel(
        devices(3), profile, batch_size=32, workers=3, slowdown="0:4", sample_ms=0.5
    )
    c = Candidate("hybrid", (3,), "split:2", 1, "this-machine", pipelines="groups")
    plan = make_plan(
        model, c, model.score(c), objective="throughput", min_samples_per_sec=None,
        searcher="exact",
    )  # fmt: skip
    path = plan.save(tmp_path / "plan.json")
    out = tmp_path / "s.json"
    args = ["--data", digits, "--plan", str(path), "--steps", "30", "--no-progress"]
    args += ["--eval-every", "1000", "--summary", str(out)]
    result = run_train(plan.ranks, args, timeout=120)
    assert result.returncode == 0, output(result)[-3000:]
    s = summary(out)
    assert s["pipeline"]["groups"] == [1]
    assert s["mode"] == "hybrid" and s["steps"] >= 30
    # the run's own program cut the group where the plan predicted
    assert s["pipeline"]["bounds"][1] == plan.pipeline_bounds[0]


def test_hybridagg_plan_prints_and_writes_a_pipelined_plan(tmp_path):
    """From the command line: a model no device holds is planned on pipelines."""
    import subprocess
    import sys

    big = replace(PROFILE, parameter_bytes=8e9)
    profile = save_profile(big, tmp_path / "p.json")
    cluster = tmp_path / "c.json"
    cluster.write_text(
        json.dumps(
            {
                "name": "small-devices",
                "links": {
                    "intra_node": {"bandwidth": "10GB/s", "latency": "2us"},
                    "inter_node": {"bandwidth": "10GB/s", "latency": "10us"},
                },
                "node_types": [
                    {"name": "g", "count": 4, "devices": 1, "memory": "12GiB"}
                ],
                "servers": {"node_types": ["g"], "per_node": 1},
            }
        )
    )
    base = [sys.executable, "-m", "hybridagg.cli", "plan", "--cluster", str(cluster)]
    base += ["--profile", str(profile), "--confirm-workers", "0"]
    done = subprocess.run(
        [*base, "--out", str(tmp_path / "plan.json")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "pipelines" in done.stdout and "--pipeline-groups" in done.stdout
    plan = load_plan(tmp_path / "plan.json")
    assert plan.pipeline_groups and plan.mode == "hybrid"
    off = subprocess.run(
        [*base, "--pipelines", "off"], capture_output=True, text=True, timeout=120
    )
    assert off.returncode == 2 and "no configuration fits" in off.stderr
