"""The benchmark scripts' pure parts: the headline's summary, the step breakdown."""

import contextlib
import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"


def load(name):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (dataclasses look their module up)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def hetero():
    return load("hetero")


def record(mode, level, seed, ttt, sps=1000.0):
    return {
        "mode": mode,
        "level": level,
        "seed": seed,
        "time_to_target_s": ttt,
        "samples_per_sec": sps,
        "efficiency": 0.5,
        "final_accuracy": 0.95,
        "mean_staleness": 0.0,
    }


def test_level_specs(hetero):
    assert hetero.level_spec("8", 3.0) == "0-1:1,2-3:8"
    assert hetero.level_spec("change", 2.5) == "0-1:1,2-3:4@0;0-1:4,2-3:1@2.5"


def test_cells_give_medians_ranges_and_the_cut_against_sync(hetero):
    records = [record("sync", "8", s, t) for s, t in enumerate([6.0, 8.0, 7.0])]
    records += [record("fast-pair", "8", s, t) for s, t in enumerate([1.0, 2.0, None])]
    rows = {c["mode"]: c for c in hetero.cells(records)}
    assert rows["sync"]["ttt"] == (7.0, 6.0, 8.0)
    assert rows["sync"]["cut_vs_sync"] == pytest.approx(0.0)
    # a seed that never reached the target is left out of the median, and said
    assert rows["fast-pair"]["ttt"] == (1.5, 1.0, 2.0)
    assert rows["fast-pair"]["reached"] == 2 and rows["fast-pair"]["runs"] == 3
    assert rows["fast-pair"]["cut_vs_sync"] == pytest.approx(1 - 1.5 / 7.0)
    table = hetero.markdown(hetero.cells(records), 0.9)
    assert "| 8x | fast-pair | 1.50 [1.00-2.00] (2/3 reached) | 79% |" in table
    # the cores' bound beside samples/s, "-" where a run has none (DDP)
    assert "| 1000 [1000-1000] | - | - | - | 0.50 [0.50-0.50] | - |" in table
    records[0]["cores_bound_samples_per_sec"] = 4000.0
    rows = {c["mode"]: c for c in hetero.cells(records)}
    assert rows["sync"]["cores_bound"] == (4000.0, 4000.0, 4000.0)


def test_every_mode_is_known_and_fast_pair_runs_on_two_ranks(hetero):
    assert hetero.MODES["fast-pair"][0] == 2
    assert {"sync", "hybrid", "async", "ddp", "horovod"} <= set(hetero.MODES)
    with pytest.raises(SystemExit, match="unknown --modes"):
        hetero.main(["--modes", "sync,warp"])


def step(rank, t, batch, group=0, role="leader", comm=0.004):
    return {
        "event": "step",
        "rank": rank,
        "t": t,
        "group": group,
        "role": role,
        "batch": batch,
        "compute_s": 0.001,
        "pace_s": 0.031,
        "comm_s": comm,
        "reduce_s": 0.0005,
        "data_wait_s": None,
    }


def test_steps_gives_medians_per_group_and_role_without_empty_steps(tmp_path, capsys):
    steps = load("steps")
    lines = [
        step(0, 0.036 * i, 32, comm=0.004 if i % 5 else 0.03) for i in range(1, 11)
    ]
    lines.append(step(0, 0.5, 0))  # an empty end-of-epoch step: left out
    lines += [step(2, 0.26 * i, 32, group=1, role="worker") for i in range(1, 4)]
    lines.append({"event": "eval", "rank": 0, "t": 0.4, "accuracy": 0.9})
    path = tmp_path / "m.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in lines))
    rows = {(r["group"], r["role"]): r for r in steps.summarize(path)}
    fast, slow = rows[(0, "leader")], rows[(1, "worker")]
    assert fast["ranks"] == [0] and fast["steps"] == 10
    assert fast["comm_ms"] == pytest.approx(4.0)  # the median, not the mean
    assert fast["period_ms"] == pytest.approx(36.0)
    assert fast["data_wait_ms"] == 0.0
    assert fast["samples_per_sec_per_rank"] == pytest.approx(32 / 0.036)
    assert slow["period_ms"] == pytest.approx(260.0)
    assert steps.main([str(path)]) == 0
    assert "| m.jsonl | 1 | worker | 2 | 3 | 260.00 |" in capsys.readouterr().out
    single = tmp_path / "one.jsonl"
    single.write_text(json.dumps(step(0, 0.1, 32)))
    (row,) = steps.summarize(single)
    assert row["period_ms"] is None and row["samples_per_sec_per_rank"] is None
    assert row["comm_ms"] == pytest.approx(4.0)
    assert "| one.jsonl | 0 | leader | 0 | 1 | - |" in steps.markdown([row])
    empty = tmp_path / "e.jsonl"
    empty.write_text(json.dumps({"event": "eval"}))
    with pytest.raises(SystemExit, match="no step records"):
        steps.main([str(empty)])


def test_reaction_times_the_decision_and_the_first_balanced_step(tmp_path, capsys):
    reaction = load("reaction")

    def paced(rank, n, t, busy):
        return {"event": "step", "rank": rank, "step": n, "t": t, "batch": 8,
                "compute_s": 0.0, "pace_s": busy}  # fmt: skip

    # two ranks; at t=1.0 rank 0 turns 4x slower; steps 0-9 end every 0.1 s,
    # step 10 starts at 1.0 and takes 0.4 s (rank 0) against 0.1 (rank 1),
    # step 11 too, then a decision and balanced steps of 0.25 s
    lines, t = [], 0.0
    for n in range(14):
        slow = n in (10, 11)
        period = 0.4 if slow else (0.1 if n < 10 else 0.25)
        t += period
        lines.append(paced(0, n, t, period))
        lines.append(paced(1, n, t, 0.1 if slow else period * 0.96))
        if n == 11:
            lines.append({"event": "batch", "rank": 0, "t": t + 0.001})
    lines.insert(0, {"event": "batch", "rank": 0, "t": 0.05})  # before: ignored
    path = tmp_path / "r.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in lines))
    row = reaction.reaction(path, change_at=1.0)
    assert row["decision_s"] == pytest.approx(0.801)
    assert row["decision_steps"] == 2
    assert row["balanced_s"] == pytest.approx(0.8)  # step 12 starts at 1.8
    # 4% apart is not balanced at a tolerance of 0; no change, no decision
    assert reaction.reaction(path, change_at=1.0, tolerance=0.0)["balanced_s"] is None
    assert reaction.reaction(path, change_at=9.0)["decision_s"] is None
    assert reaction.main([str(path), "--change-at", "1"]) == 0
    assert "| 0.801 | 2 | 0.800 |" in capsys.readouterr().out


def test_run_cell_gives_fast_pair_two_unslowed_ranks_and_skips_the_change_level(
    hetero, monkeypatch, tmp_path
):
    import argparse
    import types

    from hybridagg.runtime import runner

    calls = []

    def fake_run_job(argv, timeout, env):
        calls.append(argv)
        out = Path(argv[argv.index("--out") + 1])
        out.write_text(
            json.dumps([{"time_to_target_s": 1.0, "samples": 640, "steps": 10}])
        )
        return types.SimpleNamespace(returncode=0, stdout="", stderr="")

    monkeypatch.setattr(runner, "run_job", fake_run_job)
    args = argparse.Namespace(
        data="d.h5",
        epochs=1,
        lr=0.05,
        batch_size=32,
        sample_ms=1.0,
        target_accuracy=0.9,
        eval_every=5,
        change_at=3.0,
        train_extra="",
        timeout=60,
        seeds=1,
        model="resnet50-twin",
        cluster=None,
        ps_capacity=None,
        wire="fp32",
    )
    assert hetero.run_cell("fast-pair", "change", args, tmp_path) == []
    assert calls == []
    (rec,) = hetero.run_cell("fast-pair", "8", args, tmp_path)
    assert rec == {
        "time_to_target_s": 1.0,
        "samples": 640,
        "steps": 10,
        "mode": "fast-pair",
        "level": "8",
        "seed": 0,
        "of_own_bound": None,  # the fake summary holds no rate to bound
    }
    argv = calls[-1]
    assert argv[argv.index("--slowdown") + 1] == "0-1:1"
    assert argv[argv.index("-n") : argv.index("-n") + 2] == ["-n", "2"]
    hetero.run_cell("hybrid", "8", args, tmp_path)
    argv = calls[-1]
    assert argv[argv.index("--slowdown") + 1] == "0-1:1,2-3:8"
    assert argv[argv.index("-n") : argv.index("-n") + 2] == ["-n", "5"]
    assert argv[argv.index("--model") + 1] == "resnet50-twin"
    # on an emulated cluster every job goes through hybridagg-run --cluster,
    # and a mode with servers gets the bound of the servers' host's link
    from hybridagg.data import convert_digits

    args.data, args.model = str(tmp_path / "d.h5"), "mlp"
    convert_digits(args.data, val_fraction=0.2, seed=0, progress=False)
    args.cluster = str(Path(__file__).parent.parent / "examples" / "cluster.toml")
    (rec,) = hetero.run_cell("hybrid", "8", args, tmp_path)
    argv = calls[-1]
    assert Path(argv[0]).name == "hybridagg-run"
    assert argv[1:5] == ["--cluster", args.cluster, "-n", "5"]
    ps_link = 10e9 / 8  # the example's servers' host: 10 Gbit/s
    expected = ps_link / hetero.model_bytes("mlp", args.data) * 640 / 10
    assert rec["link_bound_samples_per_sec"] == pytest.approx(expected)
    assert argv[argv.index("--wire") + 1] == "fp32"
    # a compact wire passes through to train, and halves the bytes per update
    args.wire = "bf16"
    (rec,) = hetero.run_cell("hybrid", "8", args, tmp_path)
    assert calls[-1][calls[-1].index("--wire") + 1] == "bf16"
    assert rec["link_bound_samples_per_sec"] == pytest.approx(2 * expected, rel=1e-6)
    args.wire = "fp32"
    (rec,) = hetero.run_cell("sync", "8", args, tmp_path)
    assert "link_bound_samples_per_sec" not in rec  # no servers
    # with bench/ps.py's capacity at this model's size, the servers' bound
    size = hetero.model_bytes("mlp", args.data)
    cap = [
        {
            "leaders": 2,
            "servers": 1,
            "capacity_bytes": size,
            "kernel": "fused",
            "updates_per_sec": 50.0,
        },
    ]
    args.ps_capacity = str(tmp_path / "ps.json")
    Path(args.ps_capacity).write_text(json.dumps(cap))
    (rec,) = hetero.run_cell("hybrid", "8", args, tmp_path)
    assert rec["servers_bound_samples_per_sec"] == pytest.approx(50.0 * 640 / 10)
    (rec,) = hetero.run_cell("async", "8", args, tmp_path)
    assert rec["servers_bound_samples_per_sec"] is None  # 4 leaders: not measured
    # a capacity measured on another wire says nothing about this one
    args.wire = "bf16"
    (rec,) = hetero.run_cell("hybrid", "8", args, tmp_path)
    assert rec["servers_bound_samples_per_sec"] is None


def test_the_servers_bound_uses_capacity_at_the_models_size_and_leaders(hetero):
    cap = [
        {
            "leaders": 2,
            "servers": 1,
            "capacity_bytes": 2**20,
            "kernel": "fused",
            "updates_per_sec": 900.0,
        },
        {
            "leaders": 2,
            "servers": 1,
            "capacity_bytes": 94_000_000,
            "kernel": "loop",
            "updates_per_sec": 6.0,
        },
        {
            "leaders": 2,
            "servers": 1,
            "capacity_bytes": 94_000_000,
            "kernel": "fused",
            "updates_per_sec": 13.0,
        },
        {
            "leaders": 4,
            "servers": 1,
            "capacity_bytes": 94_000_000,
            "kernel": "fused",
            "updates_per_sec": 16.0,
        },
    ]
    # 13 updates/s of 64 samples, the fused kernel's figure at 2 leaders
    assert hetero.servers_bound(cap, 90_000_000, 2, 1, 6400, 100) == 13.0 * 64
    assert hetero.servers_bound(cap, 90_000_000, 4, 1, 3200, 100) == 16.0 * 32
    assert hetero.servers_bound(cap, 90_000_000, 3, 1, 3200, 100) is None
    assert hetero.servers_bound(cap, 90_000_000, 2, 2, 3200, 100) is None
    assert hetero.servers_bound(cap, 40_000_000, 2, 1, 3200, 100) is None  # size
    assert hetero.servers_bound(cap, 90_000_000, 2, 1, 0, 0) is None
    assert hetero.mode_groups("hybrid") == (2, 1)
    assert hetero.mode_groups("async+adaptive") == (4, 1)
    assert hetero.mode_groups("sync") == (0, 0)


def test_a_runs_own_bound_is_the_least_of_its_ideal_and_bounds(hetero):
    rec = {"samples_per_sec": 100.0, "efficiency": 0.1}  # ideal 1000
    assert hetero.own_bound(rec) == pytest.approx(1000.0)
    rec["cores_bound_samples_per_sec"] = 150.0
    rec["link_bound_samples_per_sec"] = 400.0
    rec["servers_bound_samples_per_sec"] = None
    assert hetero.own_bound(rec) == 150.0
    assert hetero.own_bound({"samples_per_sec": 1.0}) is None


def test_the_link_bound_is_updates_the_link_carries_times_their_samples(hetero):
    # 1.25 GB/s over 100 MB of parameters: 12.5 updates/s of 64 samples
    assert hetero.link_bound(1.25e9, 100_000_000, samples=6400, updates=100) == 800.0
    assert hetero.link_bound(1.25e9, 100_000_000, samples=0, updates=0) is None


def test_model_bytes_are_the_zoo_models_float32_parameters(hetero, tmp_path):
    from hybridagg.data import convert_digits

    data = tmp_path / "d.h5"
    convert_digits(data, val_fraction=0.2, seed=0, progress=False)
    # the zoo's MLP on the digits: 64-128-64-10 with biases
    n = 64 * 128 + 128 + 128 * 64 + 64 + 64 * 10 + 10
    assert hetero.model_bytes("mlp", str(data)) == 4 * n


def test_ps_capacity_runs_each_kernel_at_the_given_model_size(tmp_path, capsys):
    """bench/ps.py's capacity jobs: one record per (leaders, kernel), as asked."""
    ps = load("ps")
    out = tmp_path / "cap.json"
    argv = ["--only", "capacity", "--leaders", "1", "--seconds", "0.5"]
    argv += ["--nap-ms", "0", "--capacity-bytes", "65536", "--kernels", "fused,loop"]
    assert ps.main([*argv, "--json", str(out)]) == 0
    recs = json.loads(out.read_text())
    assert [(r["leaders"], r["kernel"], r["capacity_bytes"]) for r in recs] == [
        (1, "fused", 65536),
        (1, "loop", 65536),
    ]
    assert all(r["updates_per_sec"] > 0 for r in recs)
    assert "64 KiB" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="--kernels"):
        ps.main(["--only", "capacity", "--kernels", "fast"])


def test_ps_busy_spins_beside_each_job_and_marks_its_records(tmp_path, monkeypatch):
    """bench/ps.py --busy N: N spinning processes while each job runs, gone
    after it, and every record says how many."""
    ps = load("ps")
    seen = []
    real = ps.spinning

    @contextlib.contextmanager
    def watched(count):
        with real(count) as spinners:
            seen.append([proc.poll() for proc in spinners])  # running: None
            yield spinners
        seen.append([proc.poll() is not None for proc in spinners])

    monkeypatch.setattr(ps, "spinning", watched)
    out = tmp_path / "busy.json"
    argv = ["--only", "latency", "--servers", "1", "--min", "4096", "--max", "4096"]
    assert ps.main([*argv, "--reps", "2", "--busy", "1", "--json", str(out)]) == 0
    recs = json.loads(out.read_text())
    assert recs and all(r["busy"] == 1 for r in recs)
    assert seen == [[None], [True]]
    with pytest.raises(SystemExit, match="--busy"):
        ps.main([*argv, "--busy", "-1"])


def test_adaptive_pairs_are_compared_at_equal_training_time(hetero):
    curve_a = [[2.0, 0.5], [4.0, 0.7], [6.0, 0.8]]
    curve_b = [[1.5, 0.6], [3.5, 0.85], [5.0, 0.9]]  # ends first, at 5 s
    recs = [
        {**record("async", "4", 0, 3.0), "accuracy_curve": curve_a},
        {**record("async+adaptive", "4", 0, 3.0), "accuracy_curve": curve_b},
        {**record("sync", "4", 0, 3.0), "accuracy_curve": curve_a},  # no pair
    ]
    assert hetero.accuracy_at(curve_a, 5.0) == 0.7
    assert hetero.accuracy_at(curve_a, 1.0) is None
    (row,) = hetero.equal_time(recs)
    assert row["modes"] == ("async", "async+adaptive") and row["t"] == 5.0
    assert (row["base"], row["adaptive"]) == (0.7, 0.9)
    assert row["gain_points"] == pytest.approx(20.0)
    table = hetero.equal_time_markdown([row])
    assert "| 4x | async vs async+adaptive | 1 | 5.0 | 0.700 | 0.900 | +20.0 |" in table
    assert hetero.equal_time_markdown([]) == ""


def test_eight_workers_keep_the_shapes_of_four(hetero):
    assert hetero.layout("hybrid", 4) == hetero.MODES["hybrid"]
    assert hetero.layout("hybrid", 8) == (
        9,
        ["--mode", "hybrid", "--groups", "0-3,4-7", "--servers", "1"],
    )
    assert hetero.layout("async", 8)[0] == 9
    assert hetero.layout("sync", 8)[0] == 8 and hetero.layout("ddp", 8)[0] == 8
    assert hetero.layout("fast-pair", 8)[0] == 4
    assert hetero.level_spec("4", 3.0, 8) == "0-3:1,4-7:4"
    assert hetero.level_spec("change", 2.0, 2) == "0:1,1:4@0;0:4,1:1@2"
    assert hetero.mode_groups("hybrid", 8) == (2, 1)
    assert hetero.mode_groups("async", 8) == (8, 1)
    with pytest.raises(SystemExit, match="--workers must be even"):
        hetero.halves(5)


def test_mnist1d_arrays_join_both_parts_with_a_channel(tmp_path):
    m = load("mnist1d_data")
    rng = np.random.default_rng(0)
    data = {
        "x": rng.normal(size=(8, 40)),
        "y": np.arange(8) % 10,
        "x_test": rng.normal(size=(2, 40)),
        "y_test": np.array([3, 4]),
    }
    x, y = m.to_arrays(data)
    assert x.shape == (10, 1, 40) and x.dtype == np.float32
    assert y.tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 3, 4] and y.dtype == np.int64
    with pytest.raises(ValueError, match="expected"):
        m.to_arrays({**data, "y_test": np.array([1])})


def test_batch_scaling_rows_give_the_gain_of_larger_updates():
    bs = load("batch_scaling")

    def run(batch, seed, updates, steps=50):
        return {
            "batch_size": batch,
            "seed": seed,
            "updates_to_target": updates,
            "steps": steps,
            "final_accuracy": 0.9 + seed / 100,
        }

    records = [run(32, s, u) for s, u in enumerate((20, 24, 22))]
    # twice the samples, half the updates on two seeds; one seed never got there
    records += [run(64, 0, 10), run(64, 1, 12), run(64, 2, None)]
    table = bs.rows(records, 32)
    assert [r["batch"] for r in table] == [32, 64]
    first, second = table
    assert first["updates"] == 22 and first["updates_range"] == (20, 24)
    assert first["gain"] == 1.0 and first["samples"] == 22 * 32
    # the missed seed counts as its steps plus one: a lower bound, marked
    assert second["missed"] == 1 and second["updates"] == 12
    assert second["updates_range"] == (10, 51)
    assert second["gain"] == pytest.approx(22 / 12) and second["perfect_gain"] == 2
    text = bs.markdown(table, 0.9)
    assert "1 missed: lower bound" in text and "| 64 |" in text
    with pytest.raises(SystemExit, match="--batches"):
        bs.main(["--batches", "32,x"])


def test_plot_writes_a_png(hetero, tmp_path):
    """--png (the plots extra): both panels drawn from the cells, one PNG."""
    records = [
        record(mode, level, s, t)
        for mode in ("sync", "hybrid")
        for level in ("2", "8")
        for s, t in enumerate([6.0, 7.0] if mode == "sync" else [3.0, None])
    ]
    png = tmp_path / "hetero.png"
    hetero.plot(hetero.cells(records), str(png), 0.9)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _small_pipeline_plan(name):
    pipeline = load("pipeline")
    args = pipeline.argparse.Namespace(
        batch=32, micro=4, sample_ms=2.0, layers=4, profile_width=64,
        profile_heads=2, standin_width=16, V=[0.1], cost_budget=12.0, profile=None,
    )  # fmt: skip
    prof = pipeline.profile_model(args)
    return pipeline, pipeline.plan_setting(args, name, prof)


def test_pipeline_bench_plans_cuts_shares_and_skips_what_does_not_fit():
    _, pairs = _small_pipeline_plan("pairs")
    assert pairs["analytic_cut"] == pytest.approx(0.6)
    runs = {
        r["config"]: r["candidates"][0] for r in pairs["runs"] if "controller" not in r
    }
    # the fast first stage holds more layers than the slow second one
    lo, cut, hi = runs["auto"]["bounds"][0]
    assert cut - lo > hi - cut
    assert runs["even"]["bounds"][0] == [0, 3, 6]
    predicted = {k: c["predicted_batch_time_s"] for k, c in runs.items()}
    assert predicted["best-static"] <= predicted["auto"] < predicted["even"]
    assert sum(runs["auto"]["shares"]) == 32
    ctl = next(r for r in pairs["runs"] if "controller" in r)
    names = [c["name"] for c in ctl["candidates"]]
    assert names[0] == "auto" and "park 2,3" in names
    costs = {c["name"]: c["cost_per_hour"] for c in ctl["candidates"]}
    assert costs["auto"] == 14.0 and costs["park 2,3"] == 8.0
    _, mixed = _small_pipeline_plan("mixed")
    assert not mixed["skipped"]  # a small model fits every rank
    assert mixed["analytic_cut_per_group"][0] == pytest.approx(0.0)


def test_pipeline_bench_runs_every_configuration_and_reprints_its_json(
    tmp_path, capsys
):
    pipeline = load("pipeline")
    out = tmp_path / "p.json"
    argv = ["--settings", "pairs", "--layers", "4", "--profile-width", "64",
            "--profile-heads", "2", "--standin-width", "16", "--batch", "16",
            "--micro", "2", "--sample-ms", "1", "--steps", "2", "--warmup", "2",
            "--V", "0.01", "--slots", "3", "--slot-steps", "1", "--json", str(out)]  # fmt: skip
    assert pipeline.main(argv) == 0
    recs = json.loads(out.read_text())
    assert [r["config"] for r in recs] == [
        "dp", "dp-adaptive", "even", "auto", "best-static", "ctl-V0.01",
    ]  # fmt: skip
    price = {"auto": 14.0, "park 2": 11.0, "park 3": 11.0, "park 2,3": 8.0}
    for r in recs:
        assert r["batch_time_s"] > 0 and r["samples_per_sec"] > 0
        if "slots" not in r:
            assert r["cost_per_hour"] == 14.0  # every rank active
            continue
        # the controller's cost: each slot's active ranks at its seconds
        spent = sum(price[s["choice"]] * s["seconds"] for s in r["slots"])
        elapsed = sum(s["seconds"] for s in r["slots"])
        assert r["cost_per_hour"] == pytest.approx(spent / elapsed)
        bound = 12.0 + 3600 * r["slots"][-1]["queue"] / elapsed
        assert r["cost_per_hour"] <= bound + 1e-9
    printed = capsys.readouterr().out
    assert pipeline.main(["--from-json", str(out)]) == 0
    assert capsys.readouterr().out.strip() == printed.strip()


def test_pipelined_train_bench_bounds_and_a_short_run(tmp_path, capsys):
    """bench/pipelined_train.py: its bounds, and one pair of real jobs."""
    bench = load("pipelined_train")
    b = bench.bounds_of(12)
    # whole units cannot beat infinitely divisible layers; both near 60%
    assert 0.5 < b["best_unit_cut"] <= b["analytic_cut"] < 0.6
    out = tmp_path / "t.json"
    argv = ["--settings", "pair", "--configs", "even", "auto", "--steps", "8",
            "--warmup", "2", "--sample-ms", "2", "--json", str(out)]  # fmt: skip
    assert bench.main(argv) == 0
    records = json.loads(out.read_text())
    assert [r["config"] for r in records] == ["even", "auto"]
    even, auto = records
    assert auto["bounds"][0][1] > even["bounds"][0][1]  # the fast stage takes more
    assert auto["batch_time_s"] < even["batch_time_s"]
    text = capsys.readouterr().out
    assert "auto cuts group 0's batch time" in text
    assert bench.main(["--from-json", str(out)]) == 0


def test_cost_train_bench_best_mix_and_a_short_run(tmp_path, capsys):
    """bench/cost_train.py: the best mix within the budget, and short real jobs."""
    bench = load("cost_train")
    rows = {"pipeline": {"samples_per_sec": 900.0}, "all": {"samples_per_sec": 1200.0}}
    assert bench.best_mix_rate(rows, 10.0) == pytest.approx(900 / 3 + 1200 * 2 / 3)
    assert bench.best_mix_rate(rows, 12.0) == 1200.0
    assert bench.best_mix_rate(rows, 7.0) is None
    out = tmp_path / "c.json"
    argv = ["--V", "0.01", "--epochs", "1", "--slot", "4", "--json", str(out)]
    assert bench.main(argv) == 0
    records = json.loads(out.read_text())
    assert [r["config"] for r in records] == ["all", "pipeline", "ctl-0.01"]
    ctl = records[-1]
    assert (
        ctl["budget_per_hour"] == 10.0
        and ctl["cost_per_hour"] <= ctl["bound_per_hour"] + 1e-9
    )
    assert "Best mix within 10 $/h" in capsys.readouterr().out
    assert bench.main(["--from-json", str(out)]) == 0


def test_wait_cost_reports_the_waiting_ranks_cpu_per_wait(tmp_path):
    """bench/wait_cost.py on 2 real ranks: one row per wait, CPU below wall."""
    from hybridagg.runtime import runner

    out = tmp_path / "w.json"
    script = Path(__file__).resolve().parents[1] / "bench" / "wait_cost.py"
    cmd = [sys.executable, str(script), "--waits", "0.02,0.1", "--reps", "2"]
    result = runner.run_job(
        runner.mpiexec_argv(2, [*cmd, "--json", str(out)]),
        timeout=120,
        env=runner.mpiexec_env(),
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert [r["wait_s"] for r in rows] == [0.02, 0.1]
    for r in rows:
        assert r["wall_s"] >= r["wait_s"] * 0.9 and 0 <= r["cpu_s"] < r["wall_s"]
    assert "| CPU / wall |" in result.stdout
