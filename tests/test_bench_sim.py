"""The issue-21 benchmarks: bench/simcheck.py, bench/simscale.py, bench/planned.py,
bench/convergence.py.

Their arithmetic on fixed records, then each script end to end on its
smallest settings (one cell, one seed, one epoch; a few simulated steps).
"""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from hybridagg.sim._simgrid import SimGridMissing, find_extension

BENCH = Path(__file__).resolve().parents[1] / "bench"
ROOT = BENCH.parent

try:
    find_extension()
    HAVE_SIMGRID = True
except SimGridMissing:
    HAVE_SIMGRID = False
needs_simgrid = pytest.mark.skipif(
    not HAVE_SIMGRID, reason="SimGrid is not installed (make simgrid)"
)


def load(name):
    sys.path.insert(0, str(BENCH))  # the scripts import each other (hetero)
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def simcheck():
    return load("simcheck")


@pytest.fixture(scope="module")
def simscale():
    return load("simscale")


@pytest.fixture(scope="module")
def planned():
    return load("planned")


@pytest.fixture(scope="module")
def convergence():
    return load("convergence")


@pytest.fixture(scope="module")
def digits(tmp_path_factory):
    from hybridagg.data import convert_digits

    path = tmp_path_factory.mktemp("data") / "digits.h5"
    convert_digits(path, val_fraction=0.2, seed=0, progress=False)
    return str(path)


def real(cell, mode, rates, where="shared memory"):
    return [
        {"cell": cell, "mode": mode, "where": where, "seed": s, "samples_per_sec": v}
        for s, v in enumerate(rates)
    ]


def pred(cell, mode, rate, where="shared memory"):
    return {
        "cell": cell,
        "mode": mode,
        "where": where,
        "samples_per_sec": rate,
        "ideal_samples_per_sec": 2500.0,
    }


# ------------------------------------------------------------ simcheck
def test_error_within_and_medians(simcheck):
    assert simcheck.error(115.0, 100.0) == pytest.approx(0.15)
    assert simcheck.error(80.0, 100.0) == pytest.approx(-0.2)
    assert simcheck.within(0.15) and simcheck.within(-0.15)
    assert not simcheck.within(0.1501) and not simcheck.within(-0.2)
    assert simcheck.median_range([3.0, 1.0, 2.0, None]) == (2.0, 1.0, 3.0)
    assert simcheck.median_range([None]) is None
    # ranges that touch overlap; apart by any gap they are separated
    assert not simcheck.separated((5.0, 4.0, 6.0), (7.0, 6.0, 8.0))
    assert simcheck.separated((5.0, 4.0, 6.0), (7.5, 6.1, 8.0))
    assert simcheck.separated((9.0, 8.0, 10.0), (2.0, 1.0, 3.0))


def test_table_rows_score_each_mode_and_the_ordering(simcheck):
    records = real("4x", "sync", [400.0, 420.0, 380.0])
    records += real("4x", "hybrid", [800.0, 900.0, 850.0])
    records += real("4x", "async", [820.0, 780.0, 760.0])  # overlaps hybrid
    records += real("1x", "sync", [1000.0], where="four-workers-10g")
    preds = [
        pred("4x", "sync", 460.0),  # +15% of 400: within
        pred("4x", "hybrid", 700.0),  # -17.6%: not, yet above sync: agrees
        pred("4x", "async", 300.0),  # below sync: the ordering differs
        pred("1x", "sync", 1100.0, where="four-workers-10g"),
    ]
    rows = {
        (r["where"], r["cell"], r["mode"]): r
        for r in simcheck.table_rows(records, preds)
    }
    sync = rows[("shared memory", "4x", "sync")]
    assert sync["real"] == (400.0, 380.0, 420.0) and sync["seeds"] == 3
    assert sync["error"] == pytest.approx(0.15) and sync["within"] is True
    hybrid = rows[("shared memory", "4x", "hybrid")]
    assert hybrid["error"] == pytest.approx(700 / 850 - 1) and hybrid["within"] is False
    assert hybrid["ordering"] == [{"other": "sync", "agrees": True}]
    # async is apart from sync only (its range meets hybrid's)
    assert rows[("shared memory", "4x", "async")]["ordering"] == [
        {"other": "sync", "agrees": False}
    ]
    assert sync["ordering"] == [
        {"other": "hybrid", "agrees": True},
        {"other": "async", "agrees": False},
    ]
    lone = rows[("four-workers-10g", "1x", "sync")]
    assert lone["ordering"] is None and lone["error"] == pytest.approx(0.1)
    table = simcheck.markdown(simcheck.table_rows(records, preds))
    assert (
        "| shared memory | 4x | sync | 3 | 400 [380-420] | 460 | +15.0% | yes |"
        in table
    )
    assert "| -17.6% | **no** | agrees vs sync |" in table
    assert "**differs** vs sync" in table
    assert "- (no mode apart)" in table
    assert "2 of 4 predictions within 15%; 1 of 2 pairs of modes" in table


def test_a_cell_without_a_prediction_or_runs_is_shown_not_scored(simcheck):
    rows = simcheck.table_rows(real("8x", "sync", [500.0]), [pred("8x", "async", 9.0)])
    by = {r["mode"]: r for r in rows}
    assert by["sync"]["predicted"] is None and by["sync"]["within"] is None
    assert by["async"]["real"] is None and by["async"]["error"] is None
    assert "0 of 0 predictions" in simcheck.markdown(rows)


def test_simulate_options_are_the_cells_own(simcheck, tmp_path):
    import argparse

    args = argparse.Namespace(
        data="d.h5", epochs=None, lr=0.05, batch_size=32, sample_ms=None,
        target_accuracy=0.9, eval_every=5, change_at=3.0, train_extra="",
        timeout=60, seeds=1, cluster=None,
    )  # fmt: skip
    h = simcheck.hetero_args(args, "twin-4x", "ps.json")
    assert (h.model, h.epochs, h.sample_ms, h.ps_capacity) == (
        "resnet50-twin", 3, 2.0, "ps.json",
    )  # fmt: skip
    argv = simcheck.simulate_argv("twin-4x", "hybrid", h, "p.json", None)
    assert argv[:2] == ["simulate", "--profile"]
    for flag, value in (
        ("--mode", "hybrid"), ("--groups", "0-1,2-3"), ("--servers", "1"),
        ("--slowdown", "0-1:1,2-3:4"), ("--sample-ms", "2.0"), ("--epochs", "3"),
        ("--model", "resnet50-twin"), ("--ranks", "5"), ("--batch-size", "32"),
    ):  # fmt: skip
        assert argv[argv.index(flag) + 1] == value, flag
    h = simcheck.hetero_args(args, "change")
    argv = simcheck.simulate_argv("change", "sync+adaptive", h, "p.json", "c.yaml")
    assert "--adaptive-batch" in argv and "--ranks" not in argv
    assert argv[argv.index("--cluster") + 1] == "c.yaml"
    assert argv[argv.index("--slowdown") + 1] == "0-1:1,2-3:4@0;0-1:4,2-3:1@3"


def test_a_sitting_on_a_cluster_fits_its_links_on_the_allreduce_across_it(
    simcheck, tmp_path, monkeypatch
):
    import argparse

    from test_sim import PROFILE
    from test_sim_network import ring_records

    from hybridagg.sim import load_profile, save_profile

    emulated = str(BENCH / "clusters" / "four-workers-10g.toml")
    sim = simcheck.SIM_CLUSTERS["four-workers-10g.toml"]
    launched = []

    def across(nranks, cmd, timeout, what, cluster=None):  # 0.6 GB/s a link
        assert nranks == simcheck.WORKERS
        launched.append((cluster, cmd))
        out = Path(cmd[cmd.index("--json") + 1])
        out.write_text(json.dumps(ring_records(4, 4e-4, 6e8)))

    monkeypatch.setattr(simcheck, "_job", across)
    args = argparse.Namespace(cluster=emulated, reuse=False, reps=5, timeout=60)
    path = simcheck.measure_network(args, tmp_path)
    ((cluster, cmd),) = launched
    assert cluster == emulated and "allreduce.py" in cmd[1]
    assert cmd[cmd.index("--max") + 1] == str(256 << 20)  # whatever the model
    # the microbenchmarks on shared memory, as a sitting left them (--reuse)
    save_profile(PROFILE, tmp_path / "profile-mlp.json")
    (tmp_path / "allreduce-mlp.json").write_text(
        json.dumps([{**r, "median_us": r["median_us"] / 4} for r in ring_records(
            4, 1e-5, 3e9)])
    )  # fmt: skip
    (tmp_path / "ps-mlp.json").write_text(
        json.dumps([{"impl": "hybridagg-ps", "servers": 1, "bytes": 4096,
                     "median_us": 50.0, "update_us": 20.0}])
    )  # fmt: skip
    args = argparse.Namespace(cluster=emulated, reuse=True, data="d.h5", reps=5)
    monkeypatch.setattr(simcheck.hetero, "model_bytes", lambda model, data: 4096)
    rec = simcheck.measure("mlp", args, tmp_path, str(sim), path)
    assert len(launched) == 1  # (the network is measured once a sitting)
    (net,) = load_profile(rec["profile"]).networks
    assert net.cluster == "four-workers-10g"
    # the links carried 0.6 GB/s, below their 10 Gbit/s: the machine's 2
    # cores held them, two links' kernel work a core at each end and the
    # two copies inside the hosts at the file's 5 GB/s
    assert net.core_Bps == 0 and net.latency_s == pytest.approx(4e-4)
    assert net.kernel_Bps == pytest.approx(2 * 2 / (2 / 6e8 - 2 / 5e9))
    assert rec["network_json"] == str(path) and rec["sim_cluster"] == str(sim)
    # --recalibrate fits the sitting's files again, the network's included
    (again,) = simcheck.recalibrate([{**rec, "model": "mlp"}])
    assert again["content"]["networks"] == rec["content"]["networks"]


def test_the_simulators_cluster_must_describe_the_emulated_one(simcheck, tmp_path):
    emulated = BENCH / "clusters" / "four-workers-10g.toml"
    simcheck.check_cluster_match(emulated, simcheck.SIM_CLUSTERS[emulated.name], 4)
    wrong = tmp_path / "wrong.yaml"
    text = simcheck.SIM_CLUSTERS[emulated.name].read_text()
    wrong.write_text(text.replace("devices: 2", "devices: 4"))
    with pytest.raises(SystemExit, match="workers per host"):
        simcheck.check_cluster_match(emulated, wrong, 4)
    slow = tmp_path / "slow.yaml"
    slow.write_text(text.replace("bandwidth: 10Gb/s", "bandwidth: 1Gb/s"))
    with pytest.raises(SystemExit, match="link is"):
        simcheck.check_cluster_match(emulated, slow, 4)


def test_simcheck_refuses_unknown_cells_and_outside_modes(simcheck):
    with pytest.raises(SystemExit, match="unknown --cells"):
        simcheck.main(["--cells", "16x"])
    with pytest.raises(SystemExit, match="hybridagg's modes only"):
        simcheck.main(["--modes", "sync,ddp"])
    with pytest.raises(SystemExit, match="--reuse needs --work"):
        simcheck.main(["--reuse"])


@needs_simgrid
def test_simcheck_end_to_end_and_from_json(simcheck, digits, tmp_path, capsys):
    """Calibrate, train one seed of one epoch, simulate; then the table again
    from the JSON alone."""
    out, work = tmp_path / "s.json", tmp_path / "work"
    argv = ["--cells", "4x", "--modes", "sync", "--seeds", "1", "--epochs", "1"]
    argv += ["--data", digits, "--reps", "1", "--ps-seconds", "0.3"]
    argv += ["--ps-leaders", "2", "--allreduce-impls", "hybridagg-flat"]
    argv += ["--work", str(work), "--json", str(out), "--timeout", "600"]
    assert simcheck.main(argv) == 0
    data = json.loads(out.read_text())
    (cal,) = data["calibration"]
    assert cal["model"] == "mlp" and cal["content"]["format"] == "hybridagg-profile"
    for name in ("profile-mlp.json", "allreduce-mlp.json", "ps-mlp.json"):
        assert (work / name).exists()
    (rec,) = data["records"]
    assert (rec["cell"], rec["mode"], rec["where"]) == ("4x", "sync", "shared memory")
    (p,) = data["predictions"]
    assert p["samples_per_sec"] > 0 and "--ranks" in p["argv"]
    (row,) = data["rows"]
    assert row["error"] == pytest.approx(
        p["samples_per_sec"] / rec["samples_per_sec"] - 1
    )
    first = capsys.readouterr().out
    assert simcheck.main(["--from-json", str(out)]) == 0
    table = capsys.readouterr().out
    assert table.strip() and table.strip() in first


# ------------------------------------------------------------ simscale
def test_simscale_servers_options_and_table(simscale):
    from hybridagg.sim import load_cluster

    cluster = load_cluster(simscale.CLUSTER)
    # half the nodes slow, one server slot per slow node
    assert simscale.servers_for(cluster, 64, "max") == 4
    assert simscale.servers_for(cluster, 1024, "max") == 64
    assert simscale.servers_for(cluster, 64, "2") == 2
    with pytest.raises(SystemExit, match="slots"):
        simscale.servers_for(cluster, 64, "5")
    import argparse

    args = argparse.Namespace(
        cluster="c.yaml", batch_size=32, steps_per_worker=10, timeout=60, extra=""
    )
    argv = simscale.simulate_argv("hybrid-node", 64, 4, "p.json", args)
    for flag, value in (("--groups", "node"), ("--servers", "4"), ("--ranks", "68"),
                        ("--samples", str(64 * 32 * 10)), ("--epochs", "1")):  # fmt: skip
        assert argv[argv.index(flag) + 1] == value
    argv = simscale.simulate_argv("sync+adaptive", 64, 4, "p.json", args)
    assert "--servers" not in argv and argv[argv.index("--ranks") + 1] == "64"
    rec = {"workers_asked": 256, "mode_name": "sync", "servers": 0,
           "samples_per_sec": 50_000.0, "ideal_samples_per_sec": 128_000.0,
           "wall_s": 2.5}  # fmt: skip
    assert simscale.row(rec)["of_ideal"] == pytest.approx(50 / 128)
    assert "| 256 | sync | 0 | 50,000 | 128,000 | 0.391 | - | 2.5 |" in (
        simscale.markdown([rec])
    )
    rec["steady_samples_per_sec"] = 64_000.0  # (hybridagg simulate's second half)
    assert "| 0.391 | 64,000 (0.500) | 2.5 |" in simscale.markdown([rec])
    with pytest.raises(SystemExit, match="unknown --modes"):
        simscale.main(["--modes", "sync,ring"])


@needs_simgrid
def test_simscale_end_to_end_with_a_plot(simscale, tmp_path):
    out, png = tmp_path / "scale.json", tmp_path / "scale.png"
    argv = ["--ranks", "16", "--modes", "sync,hybrid-node", "--steps-per-worker", "2"]
    assert simscale.main([*argv, "--json", str(out), "--png", str(png)]) == 0
    recs = json.loads(out.read_text())
    assert [(r["workers_asked"], r["mode_name"]) for r in recs] == [
        (16, "sync"), (16, "hybrid-node"),
    ]  # fmt: skip
    assert all(0 < r["samples_per_sec"] <= r["ideal_samples_per_sec"] for r in recs)
    assert all(r["steady_samples_per_sec"] > 0 for r in recs)
    assert recs[1]["servers"] == 1 and all(r["wall_s"] > 0 for r in recs)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # a simulation past its time is a failed row, not the end of the run
    argv = json.loads(out.read_text())[1]["argv"]
    argv[argv.index("--sim-timeout") + 1] = "1"
    argv[argv.index("--samples") + 1] = str(10**9)  # far more than a second's
    profile = tmp_path / "p.json"  # the run's own went with its temporary folder
    from hybridagg.sim.profile import save_profile

    save_profile(simscale.SYNTHETIC, profile)
    argv[argv.index("--profile") + 1] = str(profile)
    rec = simscale.predict(argv, 120)
    assert rec["samples_per_sec"] is None and "600" not in rec["error"]
    rec.update({"workers_asked": 16, "mode_name": "hybrid-node", "servers_asked": 1})
    assert "| 16 | hybrid-node | 1 | failed after" in simscale.markdown([rec])
    simscale.plot([recs[0], rec], str(png), "one failed")  # drawn without it
    # bad options stop the whole run
    with pytest.raises(SystemExit, match="simscale: hybridagg simulate"):
        simscale.predict([*argv, "--mode", "warp"], 120)


# ------------------------------------------------------------ planned
def run(cluster, config, seed, ttt, sps=1000.0):
    return {
        "cluster": cluster,
        "config": config,
        "seed": seed,
        "time_to_target_s": ttt,
        "samples_per_sec": sps,
        "train_args": ["--mode", "sync"] if config == "planned" else None,
    }


def test_planned_ratio_is_to_the_best_hand_written_median(planned):
    records = [run("u", "planned", s, t) for s, t in enumerate([3.0, 2.0, 4.0])]
    records += [run("u", "sync", s, t) for s, t in enumerate([8.0, 9.0, 7.0])]
    records += [run("u", "async", s, t) for s, t in enumerate([4.0, None, 3.0])]
    records += [run("h", "sync", 0, None), run("h", "planned", 0, 1.0)]
    rows = {(r["cluster"], r["config"]): r for r in planned.rows(records)}
    plan = rows[("u", "planned")]
    assert plan["ttt"] == (3.0, 2.0, 4.0)
    # async's median over the seeds that reached the target: 3.5
    assert rows[("u", "async")]["ttt"][0] == 3.5
    assert rows[("u", "async")]["reached"] == 2 and rows[("u", "async")]["runs"] == 3
    assert plan["best_hand_written"] == "async"
    assert plan["ratio"] == pytest.approx(3.0 / 3.5)
    assert rows[("u", "sync")]["ratio"] is None
    # no hand-written run reached the target: no ratio
    assert rows[("h", "planned")]["ratio"] is None
    table = planned.markdown(planned.rows(records), 0.9)
    assert "| u | planned: `--mode sync` | 3.00 [2.00-4.00] | 3/3 |" in table
    assert "**0.857** (vs async)" in table
    assert "| h | sync | - | 0/1 |" in table
    # async on the plan's workers is shown beside, not counted as hand-written
    records += [run("u", "async-plan-workers", s, t) for s, t in enumerate([1.0, 1.5])]
    rows = {(r["cluster"], r["config"]): r for r in planned.rows(records)}
    assert rows[("u", "planned")]["best_hand_written"] == "async"
    assert rows[("u", "planned")]["ratio_same_workers"] == pytest.approx(3.0 / 1.25)
    assert "; 2.400 vs async-plan-workers" in planned.markdown(list(rows.values()), 0.9)
    assert planned.without_flag(["--a", "1", "--slowdown", "2:4", "--b"], "--slowdown") == [
        "--a", "1", "--b",
    ]  # fmt: skip


def test_planned_configurations_match_the_clusters(planned, tmp_path):
    assert planned.hand_written("hybrid", "uneven-8") == (
        9, ["--mode", "hybrid", "--groups", "0-1,2-4,5-7", "--servers", "1"],
    )  # fmt: skip
    assert planned.hand_written("sync+adaptive", "headline-4x") == (
        4, ["--mode", "sync", "--adaptive-batch"],
    )  # fmt: skip
    import argparse

    args = argparse.Namespace(
        data="d.h5", model="mlp", epochs=6, lr=0.05, batch_size=32,
        target_accuracy=0.9, eval_every=5, profile=None, objective="throughput",
        convergence=None,
    )  # fmt: skip
    common = planned.common_args("uneven-8", args)
    assert common[common.index("--slowdown") + 1] == "0-1:1,2-4:2,5-7:4"
    assert common[common.index("--sample-ms") + 1] == "2"
    argv = planned.plan_argv("headline-4x", args, tmp_path / "p", tmp_path / "j")
    for flag, value in (("-n", "4"), ("--slowdown", "0-1:1,2-3:4"),
                        ("--objective", "throughput"), ("--model", "mlp")):  # fmt: skip
        assert argv[argv.index(flag) + 1] == value
    assert "--convergence" not in argv
    args.objective, args.convergence = "time", "c.json"
    argv = planned.plan_argv("headline-4x", args, tmp_path / "p", tmp_path / "j")
    assert argv[argv.index("--objective") + 1] == "time"
    assert argv[argv.index("--convergence") + 1] == "c.json"
    assert argv[argv.index("--eval-every") + 1] == "5"  # the jobs' cadence
    with pytest.raises(SystemExit, match="unknown --configs"):
        planned.main(["--configs", "planned,ddp"])
    for half in (["--objective", "time"], ["--convergence", "c.json"]):
        with pytest.raises(SystemExit, match="go together"):
            planned.main(half)


@needs_simgrid
def test_planned_end_to_end_and_from_json(planned, digits, tmp_path, capsys):
    out = tmp_path / "planned.json"
    argv = ["--clusters", "headline-4x", "--configs", "planned,sync", "--seeds", "1"]
    argv += ["--first-seed", "3"]  # (a later sitting's seeds)
    argv += ["--epochs", "1", "--data", digits, "--json", str(out), "--timeout", "600"]
    assert planned.main(argv) == 0
    data = json.loads(out.read_text())
    (plan,) = data["plans"]
    # (all 4 workers, or the 2 fast ones alone: which wins on samples/s
    # turns on the profile measured on the spot, under whatever else runs)
    assert plan["emulation"] == "headline-4x" and plan["workers"] in (2, 4), plan
    assert [(r["config"], r["seed"]) for r in data["records"]] == [
        ("planned", 3), ("sync", 3),
    ]  # fmt: skip
    assert data["records"][0]["train_args"] == plan["train_args"]
    assert data["records"][0]["workers"] == plan["workers"]  # the plan's ranks
    assert all(r["samples_per_sec"] > 0 for r in data["records"])
    capsys.readouterr()
    assert planned.main(["--from-json", str(out)]) == 0
    assert "| headline-4x | sync |" in capsys.readouterr().out


# ------------------------------------------------------------ convergence
def test_convergence_cells_and_their_table(convergence, tmp_path):
    import argparse

    from hybridagg.sim.convergence import load_convergence

    args = argparse.Namespace(
        data="d.h5", model="mlp", lr=0.05, base_batch=32, steps=400,
        target_accuracy=0.9, sample_ms=0.0, run_eval_every=1,
    )  # fmt: skip
    one = convergence.train_args(16, 1, args)
    assert one[:2] == ["--mode", "sync"] and "--servers" not in one
    assert one[one.index("--lr") + 1] == "0.025"  # lr x B / B0
    assert one[one.index("--eval-every") + 1] == "1"
    assert "--sample-ms" not in one
    four = convergence.train_args(128, 4, args)
    assert four[:4] == ["--mode", "async", "--servers", "1"]
    assert four[four.index("--lr") + 1] == "0.2"
    # paced runs at their own cadence
    args.sample_ms, args.run_eval_every = 1.0, 5
    paced = convergence.train_args(32, 2, args)
    assert paced[paced.index("--sample-ms") + 1] == "1.0"
    assert paced[paced.index("--eval-every") + 1] == "5"

    def rec(batch, workers, updates, tau, seed):
        return {"cell_batch": batch, "cell_workers": workers, "seed": seed,
                "updates_to_target": updates, "mean_staleness": tau}  # fmt: skip

    records = [rec(16, 1, u, 0.0, s) for s, u in enumerate((70, 60, 66))]
    records += [rec(16, 4, 120, 2.9, 0), rec(16, 4, None, 3.1, 1),
                rec(16, 4, 130, 3.0, 2)]  # fmt: skip
    points = convergence.points(records, steps=400)
    assert points[0]["updates"] == 66 and points[0]["staleness"] == 0
    four = points[1]
    # the missed seed counts as steps + 1: the median is a lower bound
    assert four["updates"] == 130 and four["missed"] == 1
    assert four["staleness"] == 3.0 and four["updates_range"] == [120, 401]
    # a later file's run of a seed replaces the earlier one's, a new seed
    # adds; a missed seed counts as the updates it made plus one
    again = [rec(16, 4, 150, 3.0, 1), rec(16, 4, None, 3.0, 3) | {"steps": 1502}]
    merged = convergence.merge([records, again])
    assert len(merged) == 7
    redone = convergence.points(merged, steps=1500)[1]
    assert redone["updates_range"] == [120, 1503] and redone["missed"] == 1
    assert redone["seeds"] == 4 and redone["updates"] == 140
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"points": points, "records": records}))
    table = load_convergence(path)
    # halfway in drift (staleness 3 is drift 0.75 under the default damping)
    assert table.updates_to_target(16, drift=0.375) == pytest.approx(
        66 + (130 - 66) / 2
    )


def test_convergence_reads_coarser_cadences_off_a_run_that_validated_every_update(
    convergence,
):
    """``hybridagg train``'s rule: validate when the version enters a new
    bucket of ``E``, and at the end; the first of those at the target."""
    reached = convergence.reached_at
    # a sync run (every version 1..8 seen); noisy: 0.9 at 3, then below, then at 7
    updates = list(range(1, 9))
    acc = [0.5, 0.8, 0.91, 0.85, 0.88, 0.89, 0.93, 0.95]
    assert reached(updates, acc, 0.9, 1) == 3
    assert reached(updates, acc, 0.9, 2) == 8  # sees 2, 4, 6, 8 (the end)
    assert reached(updates, acc, 0.9, 3) == 3  # sees 3, 6, 8
    assert reached(updates, acc, 0.9, 5) == 8  # sees 5, then the end
    # an async rank 0 sees versions jump: the first in each bucket is kept
    seen, acc = [2, 4, 7, 9, 12, 13], [0.5, 0.7, 0.8, 0.92, 0.95, 0.96]
    assert reached(seen, acc, 0.9, 1) == 9
    assert reached(seen, acc, 0.9, 5) == 12  # bucket 1: 7 (not 9), bucket 2: 12
    assert reached(seen, acc, 0.9, 20) == 13  # only the end
    assert reached(seen, [0.1] * 6, 0.9, 1) is None
    with pytest.raises(ValueError, match="one update per accuracy"):
        reached([1, 2], [0.5], 0.9, 1)
    with pytest.raises(ValueError, match="eval_every must be >= 1"):
        reached([1], [0.5], 0.9, 0)


def test_convergence_writes_one_table_per_cadence_and_plan_reads_each(
    convergence, tmp_path
):
    from hybridagg.sim.convergence import load_convergence

    def run(batch, workers, seed, acc):
        return {"cell_batch": batch, "cell_workers": workers, "seed": seed,
                "mean_staleness": 0.0 if workers == 1 else 1.0,
                "updates_to_target": next(
                    (i + 1 for i, a in enumerate(acc) if a >= 0.9), None),
                "accuracy_updates": list(range(1, len(acc) + 1)),
                "accuracy_curve": [[0.1 * i, a] for i, a in enumerate(acc)]}  # fmt: skip

    noisy = [0.5, 0.91, 0.8, 0.8, 0.85, 0.92]  # 0.9 at 2; every 5: at 6 (the end)
    records = [run(16, 1, s, noisy) for s in range(3)]
    records += [run(16, 2, s, [0.5, 0.6, 0.7, 0.8, 0.95, 0.96]) for s in range(3)]
    convergence.add_reached(records, [1, 5], 0.9)
    assert records[0]["reached"] == {"1": 2, "5": 6}
    one, five = convergence.points(records, 6, 1), convergence.points(records, 6, 5)
    assert [p["updates"] for p in one] == [2, 5]
    assert [p["updates"] for p in five] == [6, 5]
    # an older record (no curve, no reached) is the cadence-1 table's only
    old = {"cell_batch": 16, "cell_workers": 1, "seed": 9, "updates_to_target": 4}
    assert convergence.updates_at(old, 1) == 4
    with pytest.raises(SystemExit, match="no updates at --eval-every 5"):
        convergence.updates_at(old, 5)
    # the file: --eval-every 1,5 from the records the script measured
    src = tmp_path / "runs.json"
    src.write_text(json.dumps({"records": records, "steps": 6, "model": "mlp",
                               "target_accuracy": 0.9}))  # fmt: skip
    out = tmp_path / "c.json"
    assert convergence.main(["--from-json", str(src), "--eval-every", "1,5",
                             "--json", str(out)]) == 0  # fmt: skip
    data = json.loads(out.read_text())
    assert data["eval_every"] == 1 and [t["eval_every"] for t in data["tables"]] == [
        1,
        5,
    ]
    assert all("accuracy_curve" not in r and "reached" in r for r in data["records"])
    assert load_convergence(out).eval_every == 1
    assert load_convergence(out).updates_to_target(16, 0) == 2
    at5 = load_convergence(out, 5)
    assert at5.eval_every == 5 and at5.updates_to_target(16, 0) == 6
    assert at5.target_accuracy == 0.9
    with pytest.raises(ValueError, match=r"no table at --eval-every 2 \(it has 1, 5"):
        load_convergence(out, 2)
    # the kept records rebuild the same tables (their derived values)
    again = tmp_path / "again.json"
    assert convergence.main(["--from-json", str(out), "--eval-every", "5",
                             "--json", str(again)]) == 0  # fmt: skip
    assert json.loads(again.read_text())["points"] == data["tables"][1]["points"]
    # the async runs' damping rule goes into the file (drift = staleness damped)
    assert data["damping"] == "inverse" and at5.damping == "inverse"
    for r in records:
        r["damping"] = None if r["cell_workers"] == 1 else "sqrt"
    src.write_text(json.dumps({"records": records, "steps": 6}))
    assert convergence.main(["--from-json", str(src), "--json", str(out)]) == 0
    assert load_convergence(out, 1).damping == "sqrt"
    records[-1]["damping"] = "none"
    src.write_text(json.dumps({"records": records, "steps": 6}))
    with pytest.raises(SystemExit, match="different damping rules"):
        convergence.main(["--from-json", str(src), "--json", str(out)])
    records[-1]["damping"] = "sqrt"
    # runs paced alike are one table; paced differently, refused
    for r in records:
        r["sample_ms"] = 1.0
    src.write_text(json.dumps({"records": records, "steps": 6}))
    assert convergence.main(["--from-json", str(src), "--json", str(out)]) == 0
    assert json.loads(out.read_text())["sample_ms"] == 1.0
    records[0]["sample_ms"] = 0.0
    src.write_text(json.dumps({"records": records, "steps": 6}))
    with pytest.raises(SystemExit, match="paced differently"):
        convergence.main(["--from-json", str(src), "--json", str(out)])
    records[0]["sample_ms"] = 1.0
    # runs that validated every 5 updates give 5, 10, ... and not 1
    for r in records:
        r["cell_eval_every"] = 5
    convergence.add_reached(records, [5, 10], 0.9)
    assert records[0]["reached"] == {"5": 6, "10": 6}
    with pytest.raises(SystemExit, match="cannot give --eval-every 1"):
        convergence.add_reached(records, [1, 5], 0.9)
    with pytest.raises(SystemExit, match="--run-eval-every must be >= 1"):
        convergence.main(["--from-json", str(src), "--run-eval-every", "0"])


def test_convergence_mixed_cells_parse_and_train_as_specified(convergence):
    import argparse

    cell = convergence.parse_mixed("4 2-3:4")
    assert cell["mode"] == "async" and cell["groups"] == [[0], [1], [2], [3]]
    assert cell["group_cycles"] == [1, 1, 4, 4]
    grouped = convergence.parse_mixed("8 2-4:2,5-7:4 0-1,2-4,5-7")
    assert grouped["mode"] == "hybrid" and grouped["group_cycles"] == [1, 2, 4]
    args = argparse.Namespace(
        data="d.h5", model="mlp", lr=0.05, base_batch=32, steps=400,
        target_accuracy=0.9, sample_ms=1.0, run_eval_every=5,
    )  # fmt: skip
    argv = convergence.mixed_args(32, grouped, args)
    assert argv[:6] == [
        "--mode",
        "hybrid",
        "--servers",
        "1",
        "--slowdown",
        "2-4:2,5-7:4",
    ]
    assert argv[argv.index("--groups") + 1] == "0-1,2-4,5-7"
    assert argv[argv.index("--sample-ms") + 1] == "1.0"
    assert "--groups" not in convergence.mixed_args(32, cell, args)
    for bad, message in [
        ("1 0:2", "2 workers or more"),
        ("4 7:2", "slowdown names ranks"),
        ("4 2-3:4 0-1,3", "workers 0-3 once each"),
        ("4 0:2;0:4@5", "must not change"),
        ("4", "expected 'W SLOWDOWN"),
        ("x 0:2", "invalid literal"),
    ]:
        with pytest.raises(SystemExit, match=f"--mixed '{bad}': .*{message}"):
            convergence.parse_mixed(bad)


def test_convergence_fits_the_staleness_weight_on_mixed_cells(convergence, tmp_path):
    from hybridagg.sim.convergence import (
        ConvergenceTable,
        load_convergence,
        updates_of,
    )

    # equal workers: B 32 at 1, 2, 4, 8 workers (staleness 0, 1, 3, 7)
    equal = {1: (0.0, 50), 2: (1.0, 70), 4: (3.0, 100), 8: (7.0, 300)}
    records = [
        {"cell_batch": 32, "cell_workers": k, "seed": s, "mean_staleness": tau,
         "updates_to_target": u, "damping": "inverse"}
        for k, (tau, u) in equal.items() for s in range(3)
    ]  # fmt: skip
    truth = ConvergenceTable(
        tuple((32, tau, u) for tau, u in equal.values()), staleness_weight=0.3
    )
    specs = ["2 1:4", "4 2-3:4", "8 2-4:2,5-7:4", "8 2-4:2,5-7:4 0-1,2-4,5-7"]
    for spec in specs:
        cell = convergence.parse_mixed(spec)
        samples = [32 * len(g) for g in cell["groups"]]
        u = updates_of(truth, cell["mode"], samples, cell["group_cycles"])
        records += [
            {"cell_batch": 32, "cell_workers": cell["workers"], "cell_mixed": spec,
             "seed": s, "mean_staleness": 2.0, "updates_to_target": round(u) + d,
             "damping": "inverse"}
            for s, d in enumerate((-1, 0, 1))
        ]  # fmt: skip
    # mixed runs are not points of the equal workers' table
    assert len(convergence.points(records, 400)) == 4
    merged = convergence.merge([records, records[-3:]])
    assert len(merged) == len(records)  # a mixed run replaces its own seed only
    src, out = tmp_path / "runs.json", tmp_path / "c.json"
    src.write_text(json.dumps({"records": records, "steps": 400}))
    assert convergence.main(["--from-json", str(src), "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["staleness_weight"] == pytest.approx(0.3, abs=0.02)
    assert [c["spec"] for c in data["mixed"]] == sorted(specs)
    for c in data["mixed"]:
        assert c["predicted"] == pytest.approx(c["updates"], rel=0.02)
    # drift alone under-predicts the uneven cluster's async updates
    uneven = next(c for c in data["mixed"] if c["spec"] == "8 2-4:2,5-7:4")
    assert uneven["predicted_drift"] < 0.9 * uneven["updates"]
    assert load_convergence(out).staleness_weight == data["staleness_weight"]


@pytest.fixture(scope="module")
def sim_exchange():
    return load("sim_exchange")


@needs_simgrid
def test_sim_exchange_simulates_bench_ps_round_trips_across_a_link(
    sim_exchange, tmp_path, capsys
):
    from dataclasses import replace

    from test_sim import PROFILE

    from hybridagg.sim import save_profile
    from hybridagg.sim.profile import NetworkFit

    # (the kernel's work at each end on a core of its own, at 2.5 GB/s: the
    # 10 Gbit/s link is what bounds a lone message)
    fit = NetworkFit("four-workers-10g", latency_s=2e-4, core_Bps=0.0, ranks=4,
                     crossings=2, kernel_Bps=2.5e9)  # fmt: skip
    save_profile(replace(PROFILE, networks=(fit,)), tmp_path / "p.json")
    mib = 2**20
    ps = [
        {"impl": impl, "servers": 1, "bytes": 64 * mib, "median_us": us,
         "update_us": 40_000.0}
        for impl, us in (("hybridagg-ps", 90_000.0), ("mpi4py-p2p", 130_000.0),
                         ("hybridagg-ps+update", 95_000.0))
    ] + [{"impl": "hybridagg-ps", "servers": 2, "bytes": mib, "median_us": 1.0,
          "update_us": 1.0},
         # (bench/ps.py --busy: beside spinning processes, not simulated)
         {"impl": "hybridagg-ps", "servers": 1, "bytes": 16 * mib,
          "median_us": 1.0, "update_us": 1.0, "busy": 1}]  # fmt: skip
    (tmp_path / "ps.json").write_text(json.dumps(ps))
    out = tmp_path / "x.json"
    argv = ["--ps", str(tmp_path / "ps.json"), "--profile", str(tmp_path / "p.json"),
            "--steps", "3", "--json", str(out), "--md", str(tmp_path / "x.md")]  # fmt: skip
    assert sim_exchange.main(argv) == 0
    rows = {r["impl"]: r for r in json.loads(out.read_text())}
    assert set(rows) == {"hybridagg-ps", "mpi4py-p2p", "hybridagg-ps+update"}
    assert len(json.loads(out.read_text())) == 3
    # one message each way without an update: two lone flows, in closed form
    # (the fit's latency between the hosts, the file's 10 Gbit/s)
    lone = 2 * (2e-4 + 64 * mib / 1.25e9)
    assert rows["mpi4py-p2p"]["simulated_s"] == pytest.approx(lone, rel=1e-6)
    assert rows["hybridagg-ps"]["one_message_s"] == pytest.approx(lone, rel=1e-6)
    # in parts the reply crosses back while the push goes out (no core here)
    piped = rows["hybridagg-ps"]["simulated_s"]
    assert 64 * mib / 1.25e9 < piped < 0.6 * lone
    # the update hides behind the parts' transfers, not behind one message,
    # and only in part: on the machine's 2 cores it contends with the
    # kernel's work of the parts (measured here: 84.8 ms without it, 108.3
    # with it, bench/RESULTS.md)
    updated = rows["hybridagg-ps+update"]
    assert updated["one_message_s"] == pytest.approx(lone + 0.04, rel=1e-6)
    assert piped + 0.005 < updated["simulated_s"] < piped + 0.04
    assert "| 64 MiB | push+pull with the update | 95.0 |" in capsys.readouterr().out
    # a kernel slower than the link bounds the message: 1 GB/s at each end
    # (both ends at once, each on one of the machine's 2 cores)
    slow = replace(fit, kernel_Bps=1e9)
    save_profile(replace(PROFILE, networks=(slow,)), tmp_path / "p.json")
    assert sim_exchange.main(argv) == 0
    rows = {r["impl"]: r for r in json.loads(out.read_text())}
    assert rows["mpi4py-p2p"]["simulated_s"] == pytest.approx(
        2 * 64 * mib / 1e9, rel=1e-6
    )
    # a profile without the cluster's network fit is refused
    save_profile(PROFILE, tmp_path / "bare.json")
    with pytest.raises(SystemExit, match="no network fit for cluster"):
        sim_exchange.main(["--ps", str(tmp_path / "ps.json"), "--profile",
                           str(tmp_path / "bare.json")])  # fmt: skip
