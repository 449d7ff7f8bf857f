"""``hybridagg profile``, ``simulate`` and ``plan``: their command lines and the profiler.

The flags (a second parser for the flags given, ``option(short=...)``),
``hybridagg profile`` on one process and under ``mpiexec`` (errors on every
rank, no hang), the device policy of the profiler and its optimizer.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from test_sim import PROFILE, needs_simgrid

from hybridagg.sim import load_profile


# ----------------------------------------------------------------- the flags
def test_given_fields_count_a_flag_at_its_default_and_nothing_else():
    from hybridagg.train.config.simulation import SIMULATE_CONCERNS, SimulateConfig
    from hybridagg.train.flags import given_fields

    argv = ["--data", "d.h5", "--batch-size", "32", "--no-lookahead", "--overlap"]
    assert given_fields(argv) == {"data", "batch_size", "lookahead", "overlap"}
    sim = given_fields(
        ["--profile", "p.json", "--ranks", "4", "--lr", "0.05"],
        SimulateConfig,
        SIMULATE_CONCERNS,
    )
    assert sim == {"profile", "ranks", "lr"}


def test_main_tells_the_plan_which_flags_were_given(tmp_path, monkeypatch):
    from hybridagg import cli

    seen = {}
    monkeypatch.setitem(cli._COMMANDS, "train", lambda args: seen.update(vars(args)))
    cli.main(["train", "--data", "d.h5", "--plan", "p.json", "--batch-size", "32"])
    assert seen["given_flags"] == {"data", "plan", "batch_size"}
    assert seen["batch_size"] == 32 and seen["lr"] == 0.05  # defaults still there
    seen.clear()
    cli.main(["train", "--data", "d.h5", "--batch-size", "32"])
    assert "given_flags" not in seen  # without --plan, nothing to compare


def test_the_parser_is_left_as_built():
    from hybridagg.cli import build_parser

    parser = build_parser()
    before = parser.parse_args(["train", "--data", "d.h5"])
    from hybridagg.train.flags import given_fields

    given_fields(["--data", "d.h5"])
    assert parser.parse_args(["train", "--data", "d.h5"]) == before


def test_a_short_flag_comes_from_the_field():
    from hybridagg.cli import build_parser
    from hybridagg.train.config.fields import option
    from hybridagg.train.config.simulation import PLAN_CONCERNS, PlanConfig
    from hybridagg.train.flags import option_strings

    assert "-n" in option_strings(PlanConfig, PLAN_CONCERNS)
    args = build_parser().parse_args(["plan", "-n", "5", "--profile", "p.json"])
    assert args.workers == 5
    long = build_parser().parse_args(["plan", "--workers", "5", "--profile", "p"])
    assert long.workers == 5
    with pytest.raises(ValueError, match="a dash and one letter"):
        option(1, short="--n")


def test_simulate_concerns_are_trains_after_its_own():
    from hybridagg.train.config import CONCERNS
    from hybridagg.train.config.simulation import SIMULATE_CONCERNS, SimulationOptions

    assert (SimulationOptions, *CONCERNS) == SIMULATE_CONCERNS


def test_plan_takes_the_optimizer_flags_of_train():
    from hybridagg.train.config.simulation import PLAN_CONCERNS, PlanConfig
    from hybridagg.train.flags import option_strings

    flags = set(option_strings(PlanConfig, PLAN_CONCERNS))
    assert {"--optimizer", "--lr", "--momentum", "--weight-decay"} <= flags
    assert "--batch-size" in flags  # once: the plan's own
    with pytest.raises(ValueError, match="--lr must be positive"):
        PlanConfig(profile="p.json", workers=4, lr=0.0)


def test_profile_options_refuse_fp16_on_the_cpu_and_bad_devices():
    from hybridagg.train.config.simulation import ProfileConfig

    base = dict(out="p.json", sample_shape="64", classes=10)
    assert ProfileConfig(**base, device="cuda:1", amp="fp16").device == "cuda:1"
    with pytest.raises(ValueError, match="--amp fp16 needs --device cuda"):
        ProfileConfig(**base, amp="fp16")
    with pytest.raises(ValueError, match="unknown --device 'gpu'"):
        ProfileConfig(**base, device="gpu")


# ------------------------------------------------------------ simulate --plan
CLUSTERS = Path(__file__).resolve().parents[1] / "examples" / "clusters"


def _plans(tmp_path: Path) -> tuple[str, str, str]:
    """A profile; a hybrid plan on three-speeds-priced (its cluster file by
    a relative path; 1 fast and 1 slow node of 2 GPUs, the server alone on a
    cpu node: 5 ranks); and a plan for this machine's emulation (4 workers,
    2 servers)."""
    from hybridagg.sim import CostModel, load_cluster, machine_cluster, save_profile
    from hybridagg.sim.planfile import make_plan
    from hybridagg.sim.space import Candidate

    profile = PROFILE
    prof = save_profile(profile, tmp_path / "prof.json")
    rel = "examples/clusters/three-speeds-priced.yaml"
    model = CostModel(load_cluster(CLUSTERS / "three-speeds-priced.yaml"), profile)
    c = Candidate("hybrid", (1, 1), "split:2", 1, "cpu")
    made = make_plan(model, c, model.score(c), objective="throughput",
                     min_samples_per_sec=None, searcher="exact", cluster_file=rel)  # fmt: skip
    here = CostModel(machine_cluster(profile, 4, 0), profile, workers=4)
    h = Candidate("hybrid", (4,), "split:2", 2, "this-machine")
    emulated = make_plan(here, h, here.score(h), objective="throughput",
                         min_samples_per_sec=None, searcher="exact")  # fmt: skip
    return (
        str(prof),
        str(made.save(tmp_path / "cluster-plan.json")),
        str(emulated.save(tmp_path / "here-plan.json")),
    )


def test_simulate_takes_the_plans_ranks_and_refuses_others(tmp_path, capsys):
    import json

    from hybridagg.cli import build_parser, main
    from hybridagg.train.config.simulation import SIMULATE_CONCERNS, SimulateConfig
    from hybridagg.train.flags import config_from_args, given_fields

    prof, plan, here = _plans(tmp_path)
    base = ["simulate", "--profile", prof, "--steps", "3"]

    def config(*flags: str) -> SimulateConfig:
        argv = [*base, *flags]
        args = build_parser().parse_args(argv)
        args.given_flags = given_fields(argv[1:], SimulateConfig, SIMULATE_CONCERNS)
        return config_from_args(args, SimulateConfig)

    # neither --ranks nor --cluster: the plan's ranks, on this machine
    assert config("--plan", plan).ranks == 5
    assert config("--plan", here).ranks == 6
    assert config("--plan", plan, "--ranks", "5").ranks == 5  # agrees: fine
    with pytest.raises(ValueError, match="give --cluster FILE, --ranks N"):
        config()  # without a plan, still one or the other
    # another size: exit 2 naming both
    assert main([*base, "--plan", plan, "--ranks", "4"]) == 2
    assert "sets --ranks to 5, but --ranks 4 was given" in capsys.readouterr().err
    # another cluster: its digest differs from the plan's
    assert main([*base, "--plan", plan, "--cluster",
                 str(CLUSTERS / "four-workers-10g.yaml")]) == 2  # fmt: skip
    err = capsys.readouterr().err
    assert "was made for cluster three-speeds-priced" in err
    assert "describes four-workers-10g" in err
    # a plan for this machine's emulation names no cluster file
    assert main([*base, "--plan", here, "--cluster",
                 str(CLUSTERS / "three-speeds-priced.yaml")]) == 2  # fmt: skip
    assert "(no cluster file: simulate it without --cluster)" in capsys.readouterr().err
    # a plan whose ranks-to-nodes order is not the cluster's (hand-edited)
    data = json.loads(Path(plan).read_text())
    assert data["rank_nodes"] == ["fast0", "fast0", "slow0", "slow0", "cpu0"]
    data["rank_nodes"] = ["fast0", "slow0", "fast0", "slow0", "cpu0"]
    edited = tmp_path / "edited.json"
    edited.write_text(json.dumps(data))
    assert main([*base, "--plan", str(edited), "--cluster",
                 str(CLUSTERS / "three-speeds-priced.yaml")]) == 2  # fmt: skip
    err = capsys.readouterr().err
    assert "otherwise: rank 1 (plan node slow0) shares host fast0 with" in err


@needs_simgrid
def test_simulate_runs_the_plans_job(tmp_path, capsys):
    import json

    from hybridagg.cli import main

    prof, plan, here = _plans(tmp_path)
    out = tmp_path / "pred.json"
    base = ["simulate", "--profile", prof, "--steps", "3", "--json", str(out)]
    # the plan's cluster file by another path (the digest ignores the path):
    # the plan's 2 of 7 nodes and its server node, not the whole cluster
    cluster = str(CLUSTERS / "three-speeds-priced.yaml")
    assert main([*base, "--plan", plan, "--cluster", cluster, "--ranks", "5"]) == 0
    result = json.loads(out.read_text())
    assert result["cluster"] == "three-speeds-priced"
    assert (result["workers"], result["servers"]) == (4, 1)
    assert result["groups"] == [[0, 1], [2, 3]]
    # this machine's plan, with no --ranks: its 4 workers and 2 servers
    assert main([*base, "--plan", here]) == 0, capsys.readouterr().err
    result = json.loads(out.read_text())
    assert result["cluster"] == "this machine (profiled)"
    assert (result["workers"], result["servers"]) == (4, 2)


# ------------------------------------------------------------- the profiler
def test_compute_device_follows_the_device_policy():
    from hybridagg.train.profiler import compute_device

    assert compute_device("cpu", 0, 4) == ("cpu", False)
    assert compute_device("auto", 0, 0) == ("cpu", False)
    assert compute_device("auto", 3, 2) == ("cuda:1", True)  # node-local GPU
    assert compute_device("cuda", 1, 2) == ("cuda:1", True)
    assert compute_device("cuda:0", 5, 1) == ("cuda:0", True)
    with pytest.raises(ValueError, match="CUDA is not available"):
        compute_device("cuda", 0, 0)


def test_server_is_timed_with_the_runs_optimizer(monkeypatch):
    import torch

    from hybridagg.ps import store
    from hybridagg.train.config import OptimOptions
    from hybridagg.train.profiler import measure_server

    built = []
    real = store.ShardStore

    def spy(spec):
        built.append(spec)
        return real(spec)

    monkeypatch.setattr(store, "ShardStore", spy)
    cfg = OptimOptions(optimizer="adamw", lr=0.01, weight_decay=0.1)
    per_update, per_byte, points, ahead = measure_server(cfg, (1 << 10, 1 << 14), 1)
    assert len(points) == 2 and per_update >= 0 and per_byte >= 0
    assert ahead >= 0.0
    assert {spec.optimizer for spec in built} == {torch.optim.AdamW}
    sgd = OptimOptions(optimizer="sgd", lr=0.01, momentum=0.9)
    assert measure_server(sgd, (1 << 16, 1 << 20), 1)[3] > 0
    assert built[0].hyper[0]["weight_decay"] == 0.1 and built[0].hyper[0]["lr"] == 0.01


def test_profile_records_device_amp_and_optimizer(tmp_path):
    from hybridagg.cli import main

    out = tmp_path / "mlp.json"
    code = main(
        ["profile", "--model", "mlp", "--sample-shape", "64", "--classes", "10",
         "--batch-size", "8", "--reps", "1", "--amp", "bf16", "--optimizer",
         "adam", "--out", str(out)]
    )  # fmt: skip
    assert code == 0
    profile = load_profile(out)
    assert (profile.machine.device, profile.machine.amp) == ("cpu", "bf16")
    assert profile.notes["optimizer"] == "adam"
    assert profile.sample_seconds > 0 and profile.allreduce is None


def test_profile_is_calibrated_on_the_microbenchmarks_it_is_given(tmp_path, capsys):
    from hybridagg.cli import main

    bench = Path(__file__).resolve().parents[1] / "bench" / "results"
    base = ["profile", "--model", "mlp", "--sample-shape", "64", "--classes", "10",
            "--batch-size", "8", "--reps", "1"]  # fmt: skip
    plain, fitted = tmp_path / "plain.json", tmp_path / "fitted.json"
    assert main([*base, "--out", str(plain)]) == 0
    allreduce = f"{bench / 'allreduce-2.json'},{bench / 'allreduce-4.json'}"
    code = main(
        [*base, "--out", str(fitted), "--calibrate-allreduce", allreduce,
         "--calibrate-ps", str(bench / "ps.json")]
    )  # fmt: skip
    assert code == 0
    before, after = load_profile(plain), load_profile(fitted)
    assert before.allreduce_by_ranks == () and "calibrated_from" not in before.notes
    assert {fit.ranks for fit in after.allreduce_by_ranks} == {2, 4}
    assert len(after.notes["calibrated_from"]) == 3
    assert after.server.transfer_Bps and after.server != before.server
    # a file that is not there: refused before any timing, naming the flag
    code = main([*base, "--out", str(fitted), "--calibrate-ps", "nowhere.json"])
    assert code == 2
    assert "--calibrate-ps: nowhere.json is not a file" in capsys.readouterr().err
    # the all-reduce measured across the emulated cluster, with its file
    across = str(bench / "cluster10g-allreduce-4.json")
    cluster = Path(__file__).resolve().parents[1] / "examples" / "clusters"
    code = main(
        [*base, "--out", str(fitted), "--calibrate-network", across,
         "--network-cluster", str(cluster / "four-workers-10g.yaml")]
    )  # fmt: skip
    assert code == 0
    (net,) = load_profile(fitted).networks
    assert (net.cluster, net.ranks, net.crossings) == ("four-workers-10g", 4, 2)
    # the links gave less than 10 Gbit/s: the machine's cores held them
    assert net.core_Bps == 0 and net.kernel_Bps > 0
    code = main([*base, "--out", str(fitted), "--calibrate-network", across])
    assert code == 2
    assert "--calibrate-network and --network-cluster go together" in (
        capsys.readouterr().err
    )


def test_profile_refuses_a_bad_model_and_a_missing_folder(tmp_path, capsys):
    from hybridagg.cli import main

    common = ["--sample-shape", "64", "--classes", "10", "--reps", "1"]
    out = str(tmp_path / "p.json")
    assert main(["profile", "--model", "nowhere_xyz:build", *common, "--out", out]) == 2
    assert "nowhere_xyz" in capsys.readouterr().err
    missing = str(tmp_path / "no" / "p.json")
    assert main(["profile", "--model", "mlp", *common, "--out", missing]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["profile", "--model", "mlp", "--amp", "fp16", *common,
                 "--out", out]) == 2  # fmt: skip
    assert "--amp fp16 needs --device cuda" in capsys.readouterr().err


def test_profile_refuses_a_model_that_does_not_take_the_samples(
    tmp_path, capsys, monkeypatch
):
    from hybridagg.cli import main

    (tmp_path / "fixed_in.py").write_text(
        "import torch\n\ndef build():\n    return torch.nn.Linear(5, 2)\n"
    )
    monkeypatch.chdir(tmp_path)
    argv = ["profile", "--model", "fixed_in:build", "--sample-shape", "64",
            "--classes", "2", "--reps", "1", "--out", str(tmp_path / "p.json")]  # fmt: skip
    assert main(argv) == 2
    assert "does not fit the data" in capsys.readouterr().err


def test_a_profile_without_amp_reads_as_none_and_a_bad_amp_is_refused(tmp_path):
    import json

    from hybridagg.sim.profile import MachineInfo, Profile, ServerFit, save_profile

    profile = Profile(
        model="m",
        parameters=10,
        sample_shape=(3,),
        forward_s_per_sample=0.001,
        backward_s_per_sample=0.002,
        parameter_bytes=40.0,
        activation_bytes_per_sample=12.0,
        server=ServerFit(0.001, 1e-9),
        machine=MachineInfo(cores=2, memcpy_Bps=5e9),
    )
    path = save_profile(profile, tmp_path / "p.json")
    data = json.loads(path.read_text())
    del data["machine"]["amp"]  # a file written before --amp was recorded
    path.write_text(json.dumps(data))
    assert load_profile(path).machine.amp == "none"
    data["machine"]["amp"] = "fp8"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"machine\.amp must be one of"):
        load_profile(path)


@pytest.mark.cuda
def test_profile_times_the_gpu(tmp_path):
    from hybridagg.cli import main

    out = tmp_path / "mlp.json"
    code = main(
        ["profile", "--model", "mlp", "--sample-shape", "64", "--classes", "10",
         "--reps", "2", "--device", "cuda", "--amp", "fp16", "--out", str(out)]
    )  # fmt: skip
    assert code == 0
    profile = load_profile(out)
    assert profile.machine.device.startswith("cuda:")
    assert profile.machine.amp == "fp16" and profile.notes["gpu"]


def test_plan_profiles_with_the_optimizer_it_is_given(monkeypatch):
    from hybridagg import cli
    from hybridagg.train import profiling
    from hybridagg.train.config.simulation import PlanConfig

    seen = {}
    monkeypatch.setattr(
        profiling, "profile_here", lambda cfg: seen.setdefault("c", cfg)
    )
    cfg = PlanConfig(model="mlp", sample_shape="64", classes=10, workers=4,
                     optimizer="adamw", lr=0.2, weight_decay=0.01, batch_size=8)  # fmt: skip
    cli._profile_here(cfg)
    got = seen["c"]
    assert (got.optimizer, got.lr, got.weight_decay, got.batch_size) == (
        "adamw", 0.2, 0.01, 8,
    )  # fmt: skip


# ------------------------------------------------------- under mpiexec -n 2
@pytest.mark.mpi(ranks=2, timeout=240)
def test_profile_under_mpiexec_writes_on_rank_0_only(tmp_path):
    from mpi4py import MPI

    from hybridagg.cli import main

    out = tmp_path / "mlp.json"
    code = main(
        ["profile", "--model", "mlp", "--sample-shape", "64", "--classes", "10",
         "--reps", "2", "--out", str(out)]
    )  # fmt: skip
    assert code == 0
    if MPI.COMM_WORLD.Get_rank() == 0:
        profile = load_profile(out)
        assert profile.allreduce is not None and profile.allreduce.ranks == 2
    else:
        assert not out.exists()


@pytest.mark.mpi(ranks=2, timeout=120)
def test_profile_under_mpiexec_a_bad_model_is_one_error_on_every_rank(tmp_path, capsys):
    from mpi4py import MPI

    from hybridagg.cli import main

    rank = MPI.COMM_WORLD.Get_rank()
    out = str(tmp_path / "p.json")
    common = ["--sample-shape", "64", "--classes", "10", "--reps", "1", "--out"]
    # only rank 0 builds the model: the others learn its error by agreement
    assert main(["profile", "--model", "nowhere_xyz:build", *common, out]) == 2
    err = capsys.readouterr().err
    if rank == 0:
        assert "[rank 0]" in err and "nowhere_xyz" in err
    else:
        assert err == ""
    # a bad data file (read by rank 0 alone), the same way
    missing = str(tmp_path / "none.h5")
    bad = ["profile", "--model", "mlp", "--data", missing, "--out", out]
    assert main(bad) == 2
    assert ("none.h5" in capsys.readouterr().err) == (rank == 0)
    # a bad option: refused before MPI starts, on every rank
    assert (
        main(["profile", "--model", "mlp", "--sample-shape", "0", *common[2:], out])
        == 2
    )
    assert ("--sample-shape" in capsys.readouterr().err) == (rank == 0)


def test_argparse_private_api_is_not_used():
    # the flags reach argparse only through its public calls
    import inspect

    from hybridagg import cli
    from hybridagg.train import flags

    for module in (cli, flags):
        source = inspect.getsource(module)
        assert "_option_string_actions" not in source
        assert "_SubParsersAction" not in source


@pytest.mark.mpi(ranks=2, timeout=120)
def test_profile_under_mpiexec_rank_0s_long_measuring_is_no_timeout(
    tmp_path, monkeypatch
):
    # the others wait for rank 0 longer than HYBRIDAGG_TIMEOUT: its
    # measuring is a declared solo phase, which their waits do not count
    from mpi4py import MPI

    from hybridagg.cli import main
    from hybridagg.train import profiling

    monkeypatch.setenv("HYBRIDAGG_TIMEOUT", "3")
    monkeypatch.setenv("HYBRIDAGG_FAILURE_TIMEOUT", "2")
    real = profiling.profile_here

    def slow(cfg, local_rank=0):
        time.sleep(8)
        return real(cfg, local_rank)

    monkeypatch.setattr(profiling, "profile_here", slow)
    out = tmp_path / "mlp.json"
    code = main(
        ["profile", "--model", "mlp", "--sample-shape", "64", "--classes", "10",
         "--reps", "1", "--out", str(out)]
    )  # fmt: skip
    assert code == 0
    assert out.exists() == (MPI.COMM_WORLD.Get_rank() == 0)
