"""hybridagg.sim: cluster and profile files, and the SimGrid simulator's closed forms."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from types import SimpleNamespace

import pytest

from hybridagg.sim import (
    ClusterSpec,
    LinkSpec,
    NodeType,
    ServerPlacement,
    build_job,
    load_cluster,
    load_profile,
    ring_allreduce_seconds,
    simulate,
)
from hybridagg.sim._simgrid import SimGridMissing, find_extension
from hybridagg.sim.analytic import estimate
from hybridagg.sim.job import (
    BANK_MIN_FLOWS,
    LOADER_CLAIM_AHEAD,
    LOADER_WINDOWS_AHEAD,
    bank_servers,
)
from hybridagg.sim.profile import (
    AllreduceFit,
    LayerCost,
    MachineInfo,
    Profile,
    ServerFit,
    save_profile,
)

try:
    find_extension()
    HAVE_SIMGRID = True
except SimGridMissing:
    HAVE_SIMGRID = False
needs_simgrid = pytest.mark.skipif(
    not HAVE_SIMGRID, reason="SimGrid is not installed (make simgrid)"
)

PROFILE = Profile(
    model="m",
    parameters=25_000_000,
    sample_shape=(3,),
    forward_s_per_sample=0.001,
    backward_s_per_sample=0.002,
    parameter_bytes=1e8,
    activation_bytes_per_sample=0.0,
    server=ServerFit(seconds_per_update=0.004, seconds_per_byte=2e-10),
    machine=MachineInfo(cores=2, memcpy_Bps=5e9),
)


TINY = Profile(**{**PROFILE.__dict__, "parameters": 1000})

# PROFILE with next to no compute of its own: under --sample-ms a step is
# then the pacer's time alone (the model's own compute executes beside it)
PACED = replace(PROFILE, forward_s_per_sample=1e-7, backward_s_per_sample=2e-7)


def options(**kw):
    base = dict(
        mode="sync", groups=None, servers=None, batch_size=32, slowdown=None,
        sample_ms=0.0, adaptive_batch=False, adaptive_groups=False, min_batch=1,
        max_batch=None, overlap=False, wire="fp32", steps=3, epochs=None,
        stream_push=False, staleness_bound=None, accumulate=1, amp="none",
        device="cpu", eval_every=None,
    )  # fmt: skip
    base.update(kw)
    return SimpleNamespace(**base)


def gpus(n: int, bw: float = 1e9, lat: float = 1e-5, per_node: int = 2) -> ClusterSpec:
    node = NodeType(name="g", count=1, devices=n)
    return ClusterSpec(
        name="t", node_types=(node,), intra_node=LinkSpec(bw, lat),
        inter_node=LinkSpec(bw, lat), servers=ServerPlacement(("g",), per_node),
    )  # fmt: skip


# ------------------------------------------------------------------ files
def test_example_clusters_load():
    big = load_cluster("examples/clusters/two-generation-1024.yaml")
    assert big.num_devices == 1024
    assert big.inter_node.bandwidth == 25e9 / 8
    assert big.intra_node.bandwidth == 100e9 / 8
    assert big.scaled(64).num_devices == 64
    assert load_cluster("examples/clusters/four-workers-10g.yaml").num_devices == 4
    assert load_cluster("examples/clusters/this-machine.yaml").node_types[0].cores == 2


@pytest.mark.parametrize(
    "text, message",
    [
        ("links: {}\nnode_types: []", "links.intra_node: missing"),
        (
            "links: {intra_node: {bandwidth: 1GB/s}, inter_node: {bandwidth: fast}}\n"
            "node_types: [{name: a, count: 1, devices: 1}]",
            "links.inter_node.bandwidth",
        ),
        (
            "links: {intra_node: {bandwidth: 1GB/s}, inter_node: {bandwidth: 1GB/s}}\n"
            "node_types: [{name: a, count: 0, devices: 1}]",
            "node_types[0] (a).count: must be an integer >= 1",
        ),
        (
            "links: {intra_node: {bandwidth: 1GB/s}, inter_node: {bandwidth: 1GB/s}}\n"
            "node_types: [{name: a, count: 1, devices: 1, sped: 2}]",
            "unknown field(s) sped",
        ),
        (
            "links: {intra_node: {bandwidth: 1GB/s}, inter_node: {bandwidth: 1GB/s}}\n"
            "node_types: [{name: a, count: 1, devices: 1}]\nservers: {node_types: [b]}",
            "servers.node_types names ['b']",
        ),
        ("links: [", "is not valid YAML"),
    ],
)
def test_bad_cluster_files_are_refused_naming_file_and_field(tmp_path, text, message):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ValueError) as err:
        load_cluster(path)
    assert message in str(err.value)
    assert str(path) in str(err.value)


def test_profile_round_trip_and_bad_profiles(tmp_path):
    path = save_profile(PROFILE, tmp_path / "p.json")
    assert load_profile(path) == PROFILE
    data = json.loads(path.read_text())
    data["server"]["seconds_per_byte"] = -1
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"server\.seconds_per_byte must be >= 0"):
        load_profile(path)
    data["format"] = "other"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="not a profile file"):
        load_profile(path)


def test_groups_and_servers_must_fit():
    with pytest.raises(ValueError, match="do not fit the cluster's server placement"):
        build_job(options(mode="hybrid", servers=3), gpus(4, per_node=2), PROFILE)
    with pytest.raises(ValueError, match="workers"):
        build_job(options(mode="hybrid", groups="0-1,2-5"), gpus(4), PROFILE)


def test_a_window_counter_across_nodes_is_refused_not_ignored():
    # across nodes a window's draw waits for worker 0's next MPI call, which
    # the simulator does not model; the default (server 0) and one node are
    two_nodes = nodes_of(2, 2)
    window = dict(mode="async", servers=1, chunk_counter="window")
    with pytest.raises(
        ValueError,
        match="does not model --chunk-counter window with workers on 2 nodes",
    ):
        build_job(options(**window), two_nodes, PROFILE)
    for kw in (
        {**window, "chunk_counter": "auto"},
        {**window, "chunk_counter": "server"},
    ):
        assert build_job(options(**kw), two_nodes, PROFILE).mode == "async"
    assert build_job(options(**window), nodes_of(1, 4), PROFILE).mode == "async"
    # (sync draws nothing: its shares are fixed)
    assert build_job(options(chunk_counter="window"), two_nodes, PROFILE).mode == "sync"


def test_adaptive_batches_follow_speed():
    job = build_job(options(adaptive_batch=True, slowdown="2-3:3"), gpus(4), PROFILE)
    assert [w["batch"] for w in job.workers] == [48, 48, 16, 16]


# --------------------------------------------------------------- simulator
@needs_simgrid
@pytest.mark.parametrize("n", [2, 8])
@pytest.mark.parametrize("buckets", [1, 3])
def test_sync_step_is_compute_plus_closed_form_ring(n, buckets):
    # buckets all filled when backward ends: one ring all-reduce after
    # another, each paying the ring's 2(n-1) latencies
    profile = Profile(
        **{**PROFILE.__dict__, "buckets": ((1.0, 1 / buckets),) * buckets}
    )
    bw, lat = 1e9, 1e-4
    job = build_job(options(steps=3), gpus(n, bw, lat), profile)
    prediction = simulate(job)
    ring = ring_allreduce_seconds(n, 1e8, bw, lat, buckets=buckets)
    assert ring > ring_allreduce_seconds(n, 1e8, bw, lat) or buckets == 1
    step = 32 * 0.003 + ring  # (rel: a flow's bytes are whole)
    assert prediction.time_s == pytest.approx(3 * step, rel=1e-8)
    assert prediction.samples == 3 * 32 * n
    assert estimate(job).samples_per_sec == pytest.approx(32 * n / step, rel=1e-9)


def nodes_of(count: int, per: int, intra=(1e9, 1e-5), inter=(2.5e8, 5e-5)):
    node = NodeType(name="g", count=count, devices=per)
    return ClusterSpec(
        name="t", node_types=(node,), intra_node=LinkSpec(*intra),
        inter_node=LinkSpec(*inter), servers=ServerPlacement(("g",), 1),
    )  # fmt: skip


@needs_simgrid
def test_sync_with_groups_reduces_hierarchically_in_closed_form():
    # SyncOptimizer with several groups: reduce to the leader (a pipelined
    # chain), ring all-reduce across the leaders, broadcast (a chain)
    (bw, lat), (xbw, xlat) = (1e9, 1e-5), (2.5e8, 5e-5)
    job = build_job(options(steps=3, groups="node"), nodes_of(3, 4), PROFILE)
    assert job.hierarchical and len(job.groups) == 3
    chain = 3 * lat + 1e8 / bw  # n-1 latencies, the bytes once (pipelined)
    # leaders on different nodes: intra + inter latency, the slower link
    cross = ring_allreduce_seconds(3, 1e8, min(bw, xbw), lat + xlat)
    step = 32 * 0.003 + chain + cross + chain
    prediction = simulate(job)
    assert prediction.time_s == pytest.approx(3 * step, rel=1e-8)  # whole bytes
    assert prediction.samples == 3 * 32 * 12
    assert estimate(job).samples_per_sec == pytest.approx(32 * 12 / step, rel=1e-9)
    flat = build_job(options(steps=3), nodes_of(3, 4), PROFILE)
    assert not flat.hierarchical and len(flat.groups) == 1


@needs_simgrid
def test_analytic_follows_a_changing_slowdown_like_the_engine():
    # ranks 0-1 four times slower after 0.5 s: the t=0 level alone would
    # overestimate the rate by far; the time-averaged phases track SimGrid
    common = dict(steps=60, sample_ms=2.0, slowdown="0-1:1@0;0-1:4@0.5")
    for extra in ({}, {"mode": "hybrid", "groups": "0-1,2-3"}):
        job = build_job(options(**common, **extra), gpus(4, 1e10, 1e-5), TINY)
        engine, model = simulate(job), estimate(job)
        steady = estimate(job.frozen_at(0.0))
        assert steady.samples_per_sec > 1.2 * engine.samples_per_sec
        assert model.samples_per_sec == pytest.approx(engine.samples_per_sec, rel=0.02)
        assert model.ideal_samples_per_sec == pytest.approx(
            engine.ideal_samples_per_sec, rel=0.02
        )


@needs_simgrid
def test_accumulate_fills_the_buckets_in_the_last_pass():
    # two buckets, the first full at half of backward: with --accumulate 4
    # only the last pass's backward (a quarter) overlaps the first bucket
    profile = Profile(**{**PROFILE.__dict__, "buckets": ((0.5, 0.5), (1.0, 0.5))})
    bw = 2e9
    half = (2 * 1 / 2 * 1e8) / 2 / bw
    total, backward = 32 * 0.003, 32 * 0.002 / 4
    assert half > backward / 2  # the first bucket outlasts the last pass
    job = build_job(options(steps=1, accumulate=4), gpus(2, bw, 0.0), profile)
    expected = total - backward / 2 + 2 * half
    assert simulate(job).time_s == pytest.approx(expected, rel=1e-9)
    assert 2 * 32 / estimate(job).samples_per_sec == pytest.approx(expected, rel=1e-9)


def test_steady_rate_is_the_second_half_of_the_updates():
    from hybridagg.sim.engine import steady_rate

    # a slow start (2 s for the first 10 samples), then 10 samples each 0.5 s
    timeline = [(2.0, 10), (2.5, 20), (3.0, 30), (3.5, 40), (4.0, 50)]
    assert steady_rate(timeline, 4.0) == pytest.approx(20 / 1.0)  # (3, 30)-(4, 50)
    # updates after the end (a run stopped at its steps) are left out
    assert steady_rate(timeline, 3.0) == pytest.approx(10 / 0.5)  # (2.5, 20)-(3, 30)
    assert steady_rate(timeline[:1], 4.0) is None
    assert steady_rate([(1.0, 5), (1.0, 10)], 1.0) is None  # no time between


@needs_simgrid
@pytest.mark.parametrize("wire", ["fp32", "bf16"])
def test_one_server_is_bound_by_its_service_rate(wire):
    # 8 async workers, each pushing far faster than one server serves: the
    # server's service time sets the rate (transfers are tiny)
    profile = Profile(**{**PROFILE.__dict__, "parameters": 1000})
    job = build_job(
        options(
            mode="async", servers=1, steps=400, sample_ms=0.01, batch_size=1, wire=wire
        ),
        gpus(8, bw=1e12, lat=0.0),
        profile,
    )
    prediction = simulate(job)
    service = 0.004 + 4000 * 2e-10  # the float32 master, whatever the wire
    # the first push leaves after one step: the model's own 3 ms a sample
    # execute beside the pacer's 0.01 ms
    first = 1 * (0.001 + 0.002)
    assert prediction.updates == 400
    assert prediction.time_s == pytest.approx(first + 400 * service, rel=1e-4)
    assert prediction.mean_staleness > 5
    # the second half of the updates, one sample each, a service apart: the
    # bound itself, without the first step the whole run's mean carries
    assert prediction.steady_samples_per_sec == pytest.approx(1 / service, rel=1e-6)
    assert prediction.samples_per_sec < prediction.steady_samples_per_sec


@needs_simgrid
def test_command_line_prediction_and_missing_cluster(tmp_path):
    prof = save_profile(PROFILE, tmp_path / "p.json")
    out = tmp_path / "pred.json"
    done = subprocess.run(
        [sys.executable, "-m", "hybridagg.cli", "simulate", "--profile", str(prof),
         "--cluster", "examples/clusters/four-workers-10g.yaml", "--mode", "hybrid",
         "--groups", "0-1,2-3", "--steps", "10", "--sample-ms", "2", "--json", str(out)],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    result = json.loads(out.read_text())
    assert result["updates"] == 10
    assert 0 < result["samples_per_sec"] < result["ideal_samples_per_sec"]
    assert len(result["group_update_s"]) == 2
    here = subprocess.run(
        [sys.executable, "-m", "hybridagg.cli", "simulate", "--profile", str(prof),
         "--ranks", "3", "--mode", "sync", "--epochs", "2", "--samples", "640",
         "--batch-size", "32", "--json", str(out)],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert here.returncode == 0, here.stderr
    result = json.loads(out.read_text())
    assert result["cluster"] == "this machine (profiled)"
    assert result["workers"] == 3 and result["servers"] == 0
    assert result["samples"] >= 2 * 640 > result["samples"] - 3 * 32
    bad = subprocess.run(
        [sys.executable, "-m", "hybridagg.cli", "simulate", "--profile", str(prof),
         "--cluster", str(tmp_path / "none.yaml"), "--steps", "1"],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert bad.returncode == 2
    assert "does not exist" in bad.stderr


@needs_simgrid
def test_two_generation_1024_prediction_completes(tmp_path):
    cluster = load_cluster("examples/clusters/two-generation-1024.yaml")
    job = build_job(options(steps=2), cluster, PROFILE)
    prediction = simulate(job, timeout=120)
    assert len(job.workers) == 1024
    assert prediction.updates == 2
    # the fast half runs at twice the profiled rate
    assert prediction.ideal_samples_per_sec == pytest.approx(512 / 0.003 * 3)
    assert prediction.samples_per_sec < prediction.ideal_samples_per_sec


def test_interchangeable_servers_become_a_bank_only_at_scale():
    cut = load_cluster("examples/clusters/two-generation-1024.yaml").scaled
    small = build_job(options(mode="async", servers=4), cut(64), PROFILE)
    big = build_job(options(mode="async", servers=16), cut(256), PROFILE)
    node = build_job(
        options(mode="hybrid", groups="node", servers=16), cut(256), PROFILE
    )
    # 64 x 4 and 32 x 16 pushes a round: each server its own; 256 x 16: a bank
    assert 256 * 16 >= BANK_MIN_FLOWS > 32 * 16
    assert (small.server_bank, node.server_bank, big.server_bank) == (
        False,
        False,
        True,
    )
    nodes, servers = big.nodes, big.servers
    assert bank_servers(nodes, servers, 256)
    faster = [{**servers[0], "speed": 2.0}, *servers[1:]]
    assert not bank_servers(nodes, faster, 256)
    shared = [{**n, "shared": True} for n in nodes]
    assert not bank_servers(shared, servers, 256)
    assert not bank_servers(nodes, servers[:1], 10_000)


def _engine(job, tmp_path) -> dict:
    """The engine's own result (with ``server_actors``)."""
    (tmp_path / "job.json").write_text(json.dumps(job.as_dict()))
    subprocess.run(
        [sys.executable, "-m", "hybridagg.sim.engine", "job.json", "out.json"],
        cwd=tmp_path, check=True, capture_output=True, timeout=120,
    )  # fmt: skip
    return json.loads((tmp_path / "out.json").read_text())


@needs_simgrid
@pytest.mark.parametrize(
    "mode, groups, slowdown",
    [("async", None, None), ("hybrid", "node", "0:2,5:1.5")],
)
def test_a_bank_predicts_what_symmetric_servers_one_by_one_do(
    tmp_path, mode, groups, slowdown
):
    # servers on nodes of their own, every leader as far from each: the
    # shards of a push move and are served alike, so one flow of the whole
    # gradient to one server actor over the links side by side is exact
    cluster = ClusterSpec(
        name="t",
        node_types=(NodeType("g", count=4, devices=4), NodeType("s", 8, 0)),
        intra_node=LinkSpec(1e10, 2e-6), inter_node=LinkSpec(3e9, 1e-5),
        servers=ServerPlacement(("s",), 1),
    )  # fmt: skip
    job = build_job(
        options(mode=mode, groups=groups, servers=8, steps=24, slowdown=slowdown),
        cluster,
        PROFILE,
    )
    assert not job.server_bank  # 16 or 4 leaders x 8 servers
    one_by_one = _engine(job, tmp_path)
    bank = _engine(replace(job, server_bank=True), tmp_path)
    assert (one_by_one["server_actors"], bank["server_actors"]) == (8, 1)
    for key in ("time_s", "samples_per_sec", "mean_staleness"):
        assert bank[key] == pytest.approx(one_by_one[key], rel=1e-9), key
    assert bank["group_update_s"] == pytest.approx(one_by_one["group_update_s"])


@needs_simgrid
def test_async_at_1024_ranks_with_64_servers_is_bound_by_their_service_rate():
    cluster = load_cluster("examples/clusters/two-generation-1024.yaml")
    job = build_job(options(mode="async", servers=64, steps=512), cluster, PROFILE)
    assert job.server_bank and len(job.groups) == 1024
    prediction = simulate(job, timeout=120)
    assert prediction.updates == 512
    # every update is served by every server in turn: at most one per service
    service = 0.004 + 1e8 / 64 * 2e-10
    assert 512 / prediction.time_s <= 1 / service * (1 + 1e-9)
    assert 512 / prediction.time_s > 0.5 / service  # and the servers are busy


@needs_simgrid
def test_staleness_bound_holds_the_fast_group_to_the_slow_ones_pace():
    cluster = gpus(4, bw=1e12, lat=0.0)
    tiny = replace(PACED, parameters=1000)
    common = dict(
        mode="hybrid", groups="0-1,2-3", steps=60, sample_ms=1.0, slowdown="2-3:4"
    )
    free = simulate(build_job(options(**common), cluster, tiny))
    bound = simulate(build_job(options(**common, staleness_bound=0), cluster, tiny))
    fast_free, slow_free = free.group_update_s
    fast_bound, slow_bound = bound.group_update_s
    assert fast_free < slow_free / 3  # unbounded: the fast group runs ahead
    assert fast_bound == pytest.approx(slow_bound, rel=0.05)  # bound 0: lockstep
    assert bound.samples_per_sec < free.samples_per_sec


def test_unmodelled_options_are_refused():
    with pytest.raises(ValueError, match="does not model --stream-push"):
        build_job(options(mode="hybrid", stream_push=True), gpus(4), PROFILE)
    with pytest.raises(ValueError, match="--amp bf16: the profile was measured"):
        build_job(options(amp="bf16"), gpus(4), PROFILE)
    with pytest.raises(ValueError, match="--device cuda:1: the profile was measured"):
        build_job(options(device="cuda:1"), gpus(4), PROFILE)
    machine = MachineInfo(**{**PROFILE.machine.__dict__, "amp": "bf16"})
    bf16 = Profile(**{**PROFILE.__dict__, "machine": machine})
    assert build_job(options(amp="bf16", device="auto"), gpus(4), bf16).workers


def test_simulate_takes_every_train_flag_and_its_own():
    from hybridagg.train.config.simulation import SIMULATE_CONCERNS, SimulateConfig
    from hybridagg.train.flags import option_strings

    train = set(option_strings())
    sim = set(option_strings(SimulateConfig, SIMULATE_CONCERNS))
    assert train <= sim
    assert sim - train == {
        "--cluster", "--json", "--profile", "--ranks", "--samples", "--sim-timeout",
    }  # fmt: skip


def test_profile_measures_a_model_and_the_simulator_reads_it(tmp_path):
    from hybridagg.cli import main

    out = tmp_path / "mlp.json"
    code = main(
        ["profile", "--model", "mlp", "--sample-shape", "64", "--classes", "10",
         "--batch-size", "16", "--reps", "2", "--out", str(out)]
    )  # fmt: skip
    assert code == 0
    profile = load_profile(out)
    assert profile.parameters > 0 and profile.sample_seconds > 0
    assert profile.layers and sum(layer.flops for layer in profile.layers) > 0
    assert profile.allreduce is None  # one rank: nothing to fit
    assert profile.machine.memcpy_Bps > 0
    assert profile.server.seconds_per_byte > 0
    assert main(["profile", "--model", "mlp", "--out", str(out)]) == 2


@needs_simgrid
def test_shared_cores_run_compute_and_copies_at_their_share():
    # this machine as profiled: 4 ranks on 2 cores, transfers are copies
    from hybridagg.sim import machine_cluster

    job = build_job(options(steps=2), machine_cluster(PROFILE, 4, 0), PROFILE)
    prediction = simulate(job)
    compute = 4 / 2 * 32 * 0.003  # four batches on two cores
    copies = 4 / 2 * (2 * 3 / 4 * 1e8) / 5e9  # every rank's ring hop, copied
    assert prediction.time_s == pytest.approx(2 * (compute + copies), rel=1e-9)
    assert prediction.ideal_samples_per_sec == pytest.approx(2 / 0.003)


def test_ideal_is_time_averaged_over_the_slowdown_schedule():
    job = build_job(
        options(sample_ms=1.0, slowdown="0-1:1@0;0-1:3@10"), gpus(2), PROFILE
    )
    assert job.ideal_samples_per_sec(20.0) == pytest.approx((2000 + 2000 / 3) / 2)


@pytest.mark.mpi(ranks=2, timeout=240)
def test_profile_under_mpiexec_fits_the_group_allreduce(tmp_path):
    from mpi4py import MPI

    from hybridagg.cli import main

    out = tmp_path / "mlp.json"
    code = main(
        ["profile", "--model", "mlp", "--sample-shape", "64", "--classes", "10",
         "--reps", "2", "--out", str(out)]
    )  # fmt: skip
    assert code == 0
    if MPI.COMM_WORLD.Get_rank() == 0:
        fit = load_profile(out).allreduce
        assert fit is not None and fit.ranks == 2
        assert len(fit.points) == 3 and fit.bandwidth_Bps > 0
        # the fit reproduces the largest measured size within a factor of 2
        nbytes, seconds = fit.points[-1]
        assert 0.5 < fit.seconds(nbytes, 2) / seconds < 2
    else:
        assert not out.exists()


@needs_simgrid
def test_a_bucket_filled_early_is_reduced_during_backward():
    # two buckets: half the gradient full at half of backward, the rest at its end
    profile = Profile(**{**PROFILE.__dict__, "buckets": ((0.5, 0.5), (1.0, 0.5))})
    bw = 1e10
    forward, backward = 32 * 0.001, 32 * 0.002
    half = (2 * 1 / 2 * 1e8) / 2 / bw  # one bucket's share of the ring link
    assert half < backward / 2  # the first bucket is done before backward ends
    overlapped = simulate(build_job(options(steps=1), gpus(2, bw, 0.0), profile))
    assert overlapped.time_s == pytest.approx(forward + backward + half, rel=1e-9)
    whole = simulate(build_job(options(steps=1), gpus(2, bw, 0.0), PROFILE))
    assert whole.time_s == pytest.approx(forward + backward + 2 * half, rel=1e-9)


def test_bucket_schedule_follows_backward_order():
    import torch

    from hybridagg.train.pacing import module_costs
    from hybridagg.train.profiler import bucket_schedule

    model = torch.nn.Sequential(
        torch.nn.Linear(64, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 4096)
    )
    costs = module_costs(model, torch.zeros(1, 64))
    # buckets of 16 MiB: the last layer's 32 MiB of weights fill two first
    schedule = bucket_schedule(model, costs, bucket_bytes=16 << 20)
    assert sum(share for _, share in schedule) == pytest.approx(1.0)
    first_ready = costs["2"] / sum(costs.values())
    assert schedule[0][0] == pytest.approx(first_ready)
    assert schedule[-1][0] == pytest.approx(1.0)


def test_train_help_keeps_its_own_descriptions():
    import argparse

    from hybridagg.train.config.simulation import PROFILE_CONCERNS, ProfileConfig
    from hybridagg.train.flags import add_arguments

    def help_of(config=None, concerns=None, dest="data"):
        p = argparse.ArgumentParser()
        add_arguments(p, *(() if config is None else (config, concerns)))
        return next(a.help for a in p._actions if a.dest == dest)

    assert help_of() == "HDF5 file from 'hybridagg convert'"
    assert "sample shape" in help_of(ProfileConfig, PROFILE_CONCERNS)


def test_a_node_type_may_bring_its_own_profile(tmp_path):
    slow = Profile(**{**PROFILE.__dict__, "forward_s_per_sample": 0.004})
    save_profile(slow, tmp_path / "old-gpu.json")
    path = tmp_path / "c.yaml"
    path.write_text(
        "links: {intra_node: {bandwidth: 1GB/s}, inter_node: {bandwidth: 1GB/s}}\n"
        "node_types:\n"
        "  - {name: new, count: 1, devices: 2, speed: 2.0}\n"
        "  - {name: old, count: 1, devices: 2, profile: old-gpu.json}\n"
    )
    job = build_job(options(), load_cluster(path), PROFILE)
    assert [job.compute_seconds(r, 1) for r in range(4)] == pytest.approx(
        [0.0015, 0.0015, 0.006, 0.006]
    )
    path.write_text(path.read_text().replace("old-gpu", "missing"))
    with pytest.raises(
        ValueError, match=r"node_types\[1\] \(old\)\.profile: .* does not exist"
    ):
        load_cluster(path)


# ------------------------------------------------------------- calibration
def _allreduce_records(ranks: int, latency: float, bandwidth: float) -> list[dict]:
    """bench/allreduce.py's --json records of an all-reduce that follows the
    closed form exactly (and another implementation's, to be ignored)."""
    out = []
    for nbytes in (4096, 1 << 20, 64 << 20):
        t = ring_allreduce_seconds(ranks, nbytes, bandwidth, latency)
        for impl, scale in (("hybridagg-flat", 1.0), ("mpi4py", 0.5)):
            out.append(
                {"impl": impl, "ranks": ranks, "bytes": nbytes,
                 "median_us": t * scale * 1e6, "avg_us": 1.0}
            )  # fmt: skip
    return out


def test_calibration_fits_the_microbenchmarks_and_the_profile_keeps_them(tmp_path):
    from hybridagg.sim import calibrate
    from hybridagg.sim.calibrate import fit_line

    assert fit_line([(1, 3), (2, 5), (4, 9)]) == pytest.approx((1, 2))
    assert fit_line([(1, 1), (2, 2)]) == pytest.approx((0, 1))
    ar, ar4 = tmp_path / "allreduce.json", tmp_path / "allreduce-4.json"
    ar.write_text(json.dumps(_allreduce_records(2, 3e-5, 4e9)))
    ar4.write_text(json.dumps(_allreduce_records(4, 5e-5, 2e9)))
    ps = tmp_path / "ps.json"
    update = lambda b: 7e-5 + b * 3e-10  # noqa: E731
    trip = lambda b: 2 * (2e-5 + b / 6e9)  # noqa: E731
    ps.write_text(
        json.dumps(
            [{"impl": "hybridagg-ps", "ranks": 2, "servers": 1, "bytes": b,
              "median_us": trip(b) * 1e6, "update_us": update(b) * 1e6}
             for b in (4096, 1 << 20, 64 << 20)]
            + [{"impl": "hybridagg-ps", "leaders": 2, "servers": 1,
                "updates_per_sec": 500.0, "nap_ms": 2.0, "capacity_bytes": 1 << 20}]
            # bench/ps.py --busy: beside spinning processes, left out
            + [{"impl": "hybridagg-ps", "ranks": 2, "servers": 1, "bytes": b,
                "median_us": 3 * trip(b) * 1e6, "update_us": 2 * update(b) * 1e6,
                "busy": 2}
               for b in (4096, 1 << 20, 64 << 20)]
        )
    )  # fmt: skip
    profile = calibrate(PROFILE, allreduce_json=[ar, ar4], ps_json=ps)
    two, four = profile.allreduce_by_ranks
    assert (two.ranks, four.ranks) == (2, 4)
    assert two.latency_s == pytest.approx(3e-5) and two.bandwidth_Bps == pytest.approx(
        4e9
    )
    assert four.latency_s == pytest.approx(
        5e-5
    ) and four.bandwidth_Bps == pytest.approx(2e9)
    assert profile.allreduce_for(3) is four and profile.allreduce_for(2) is two
    server = profile.server
    assert server.seconds_per_update == pytest.approx(7e-5)
    assert server.seconds_per_byte == pytest.approx(3e-10)
    assert server.transfer_latency_s == pytest.approx(2e-5)
    assert server.transfer_Bps == pytest.approx(6e9)
    assert server.capacity == ((2.0, float(1 << 20), 500.0),)
    assert profile.notes["calibrated_from"] == [str(ar), str(ar4), str(ps)]
    again = load_profile(save_profile(profile, tmp_path / "p.json"))
    assert again == profile
    with pytest.raises(ValueError, match="no hybridagg-flat or hybridagg records"):
        ps_as_allreduce = calibrate(PROFILE, allreduce_json=ps)
        del ps_as_allreduce
    with pytest.raises(ValueError, match="does not exist"):
        calibrate(PROFILE, ps_json=tmp_path / "none.json")


@needs_simgrid
def test_this_machine_runs_on_its_calibrated_fits():
    from hybridagg.sim import machine_cluster

    fits = (
        AllreduceFit(latency_s=4e-5, bandwidth_Bps=3e9, ranks=2),
        AllreduceFit(latency_s=6e-5, bandwidth_Bps=1e9, ranks=4),
    )
    server = ServerFit(
        seconds_per_update=0.004, seconds_per_byte=2e-10,
        transfer_latency_s=3e-5, transfer_Bps=2e9,
    )  # fmt: skip
    profile = Profile(
        **{**PROFILE.__dict__, "allreduce_by_ranks": fits, "server": server}
    )
    # two ranks on two cores: the step is compute plus the fitted all-reduce
    job = build_job(options(steps=2), machine_cluster(profile, 2, 0), profile)
    step = 32 * 0.003 + fits[0].seconds(1e8, 2)
    assert simulate(job).time_s == pytest.approx(2 * step, rel=1e-9)
    assert estimate(job).samples_per_sec == pytest.approx(64 / step, rel=1e-9)
    # four ranks: the 4-rank fit, whose ranks shared the two cores as these do
    job = build_job(options(steps=2), machine_cluster(profile, 4, 0), profile)
    compute = 4 / 2 * 32 * 0.003
    step = compute + fits[1].seconds(1e8, 4)
    assert simulate(job).time_s == pytest.approx(2 * step, rel=1e-9)
    assert estimate(job).samples_per_sec == pytest.approx(128 / step, rel=1e-9)
    # hybrid on the machine: pushes to the co-located server take the
    # servers' transfer fit; engine and analytic model agree
    job = build_job(
        options(mode="hybrid", groups="0-1,2-3", servers=1, steps=20),
        machine_cluster(profile, 4, 1),
        profile,
    )
    assert job.nodes[0]["server_link"] == {"bandwidth": 2e9, "latency": 3e-5}
    engine, model = simulate(job), estimate(job)
    assert model.samples_per_sec == pytest.approx(engine.samples_per_sec, rel=0.1)
    # round trips that did not grow with the bytes fit a latency alone
    # (bandwidth 0): the latency still holds, the bytes move as copies
    latency_only = replace(profile, server=replace(server, transfer_Bps=0.0))
    cluster = machine_cluster(latency_only, 4, 1)
    job = build_job(options(mode="async", servers=1), cluster, latency_only)
    assert job.nodes[0]["server_link"] == {
        "bandwidth": job.nodes[0]["memcpy_Bps"],
        "latency": 3e-5,
    }
    bare = replace(server, transfer_Bps=0.0, transfer_latency_s=0.0)
    uncalibrated = replace(profile, server=bare)
    job = build_job(
        options(mode="async", servers=1), machine_cluster(uncalibrated, 4, 1),
        uncalibrated,
    )  # fmt: skip
    assert "server_link" not in job.nodes[0]


@needs_simgrid
def test_analytic_tracks_leaders_in_convoy_on_a_saturated_server_link():
    # four async leaders push 100 MB through one 10 Gbit/s server link:
    # fair sharing ends their pushes together, so the link idles while the
    # server updates and the leaders compute (the link's bound alone,
    # 400 samples/s, overestimated SimGrid by 41%)
    cluster = load_cluster("examples/clusters/four-workers-10g.yaml")
    job = build_job(
        options(mode="async", servers=1, steps=60, sample_ms=2.0), cluster, PACED
    )
    engine, model = simulate(job), estimate(job)
    assert model.samples_per_sec < 0.9 * 32 / (1e8 / 1.25e9)  # below the bound
    assert model.samples_per_sec == pytest.approx(engine.samples_per_sec, rel=0.1)


# ------------------------------------------------------------- validation
@needs_simgrid
def test_rank_0s_validations_add_their_time_to_a_sync_run():
    # every 4 steps rank 0 validates and the others wait for it at the next
    # reduction: 10 steps hold validations after steps 4 and 8 (the last
    # step ends the run before validating, as a run's timing does)
    profile = replace(PROFILE, validation_s=0.05)
    bw, lat = 1e9, 1e-4
    base = build_job(options(steps=10), gpus(2, bw, lat), profile)
    job = build_job(options(steps=10, eval_every=4), gpus(2, bw, lat), profile)
    assert base.eval_every is None and job.eval_every == 4
    assert job.validation_s == 0.05 and not job.validation_pull
    step = 32 * 0.003 + ring_allreduce_seconds(2, 1e8, bw, lat)
    assert simulate(base).time_s == pytest.approx(10 * step, rel=1e-8)
    assert simulate(job).time_s == pytest.approx(10 * step + 2 * 0.05, rel=1e-8)
    # the analytic model amortises it: validation / eval_every per step
    assert 64 / estimate(job).samples_per_sec == pytest.approx(step + 0.05 / 4)


@needs_simgrid
def test_validation_with_servers_pulls_the_weights_and_slows_rank_0s_group():
    # async: rank 0 alone stops to pull the weights and validate; the
    # others keep pushing, so the run loses less than sync would
    profile = replace(TINY, validation_s=0.02)
    common = dict(mode="async", servers=1, steps=200, sample_ms=1.0)
    cluster = gpus(4, 1e9, 1e-5)
    base = build_job(options(**common), cluster, profile)
    job = build_job(options(**common, eval_every=5), cluster, profile)
    assert job.validation_pull
    slow, fast = simulate(job), simulate(base)
    # 200 updates, one validation per 5: 40 of 20 ms on rank 0 alone
    lost = slow.time_s - fast.time_s
    assert 0 < lost < 40 * 0.02
    model = estimate(job).samples_per_sec
    assert model == pytest.approx(slow.samples_per_sec, rel=0.05)
    assert estimate(base).samples_per_sec > model


def test_a_node_types_speed_scales_validation_and_a_slowdown_does_not():
    profile = replace(PROFILE, validation_s=0.3)
    fast = NodeType(name="f", count=1, devices=2, speed=3.0)
    cluster = ClusterSpec(
        name="t", node_types=(fast,), intra_node=LinkSpec(1e9, 1e-5),
        inter_node=LinkSpec(1e9, 1e-5), servers=ServerPlacement(("f",), 1),
    )  # fmt: skip
    job = build_job(options(eval_every=5, slowdown="0:4"), cluster, profile)
    assert job.validation_s == pytest.approx(0.1)


def test_profile_validation_fields_are_checked(tmp_path):
    path = save_profile(replace(PROFILE, validation_s=0.01, validation_samples=360),
                        tmp_path / "p.json")  # fmt: skip
    assert load_profile(path).validation_s == 0.01
    data = json.loads(path.read_text())
    for key, bad, message in (
        ("validation_s", -1, "validation_s must be >= 0"),
        ("validation_samples", 1.5, "validation_samples must be an integer"),
    ):
        broken = dict(data, **{key: bad})
        path.write_text(json.dumps(broken))
        with pytest.raises(ValueError, match=message):
            load_profile(path)


def test_profile_with_data_times_the_runs_own_validation(tmp_path):
    from hybridagg.cli import main
    from hybridagg.data import convert_digits

    data = tmp_path / "digits.h5"
    convert_digits(data, val_fraction=0.2, seed=0, progress=False)
    out = tmp_path / "mlp.json"
    argv = ["profile", "--model", "mlp", "--data", str(data), "--batch-size", "16",
            "--reps", "2", "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    profile = load_profile(out)
    assert profile.validation_s > 0
    import h5py

    with h5py.File(data) as f:
        assert profile.validation_samples == len(f["val"]["labels"])


# ------------------------------------------------------- dynamic shares' end
@needs_simgrid
def test_a_slow_workers_claimed_batches_make_the_end_of_an_async_run():
    # 20 batches in the epoch; rank 1 is 100x slower (3.2 s a batch). Its
    # loader draws a chunk (here a batch) for the batch it computes, the
    # claim_ahead it cuts ahead and the windows_ahead it draws beyond them as
    # it starts, and the run ends only when it has computed them: 9 x 3.2 s,
    # although the fast worker could have trained every sample within a
    # second
    profile = replace(
        TINY, server=ServerFit(seconds_per_update=1e-5, seconds_per_byte=0)
    )
    opts = options(mode="async", servers=1, steps=None, epochs=1, sample_ms=1.0,
                   slowdown="1:100")  # fmt: skip
    job = build_job(opts, gpus(2, 1e12, 0.0), profile, samples=640)
    assert job.claim_ahead == LOADER_CLAIM_AHEAD == 5
    assert job.windows_ahead == LOADER_WINDOWS_AHEAD == 3
    assert (job.epoch_samples, job.chunk_samples) == (640, 0)  # (no data file)
    slow_step = 32 * 0.1
    claimed = simulate(job)
    assert claimed.samples == 640
    assert claimed.time_s == pytest.approx(9 * slow_step, rel=0.01)
    # without read-ahead the slow worker holds one batch
    eager = simulate(replace(job, claim_ahead=0, windows_ahead=0))
    assert eager.samples == 640
    assert eager.time_s == pytest.approx(slow_step, rel=0.01)
    # chunks of 4 batches (an epoch of 20): rank 0 starts first and draws 5
    # (1 + 3 ahead, and a fifth as it cuts 6 batches from 2 of them); rank 1
    # then the next 5, and its 20 batches are the run
    big = build_job(opts, gpus(2, 1e12, 0.0), profile, samples=2560)
    chunky = simulate(replace(big, chunk_samples=128))
    assert chunky.samples == 2560
    assert chunky.time_s == pytest.approx(20 * slow_step, rel=0.01)
    # the analytic model: half a step in progress, on average, plus the claims
    model = estimate(job).samples_per_sec
    assert model == pytest.approx(claimed.samples_per_sec, rel=0.1)
    eager_model = estimate(replace(job, claim_ahead=0, windows_ahead=0))
    assert eager_model.samples_per_sec > 5 * model


def test_claim_ahead_is_the_training_loaders_read_ahead_and_sync_has_none():
    import inspect

    from hybridagg.data import HDF5Loader, pipeline

    prefetch = inspect.signature(HDF5Loader).parameters["prefetch"].default
    assert prefetch + 1 == LOADER_CLAIM_AHEAD
    # the window reader's queued windows, and the one drawn waiting for a buffer
    depth = inspect.signature(pipeline._read_ahead).parameters["depth"].default
    assert depth + 1 == LOADER_WINDOWS_AHEAD
    sync = build_job(options(steps=None, epochs=1), gpus(2), PROFILE, samples=640)
    assert sync.claim_ahead == 0
    hybrid = build_job(
        options(mode="hybrid", groups="0,1", servers=1, steps=None, epochs=1),
        gpus(2), PROFILE, samples=640,
    )  # fmt: skip
    assert hybrid.claim_ahead == LOADER_CLAIM_AHEAD


# ------------------------------------------------- a worker's own work
LAYERED = replace(
    PROFILE,
    # two layers: the first's backward (1 of the 3 ms a sample) is the part
    # the pacer cannot hide
    layers=(
        LayerCost("a", 1.0, forward_s=0.0005, backward_s=0.001),
        LayerCost("b", 1.0, forward_s=0.0005, backward_s=0.001),
    ),
)


@needs_simgrid
@pytest.mark.parametrize("sample_ms", [4.0, 1.0])
def test_a_paced_step_is_the_pacers_time_then_the_backward_it_cannot_hide(sample_ms):
    # one worker, no reduction: with 4 ms a sample the pacer's 128 ms cover
    # the 64 ms of hidden compute, and the first layer's backward (32 ms)
    # comes after the last sleep; with 1 ms a sample the 64 ms of hidden
    # compute outlast the pacer's 32 ms
    assert LAYERED.paced_tail_share == pytest.approx(1 / 3)
    job = build_job(options(steps=3, sample_ms=sample_ms), gpus(1), LAYERED)
    hidden, tail, target = 32 * 0.002, 32 * 0.001, 32 * sample_ms / 1000
    step = max(target, hidden) + tail
    assert simulate(job).time_s == pytest.approx(3 * step, rel=1e-9)
    assert 32 / estimate(job).samples_per_sec == pytest.approx(step, rel=1e-9)
    # unpaced, the layers are the measured compute and nothing is slept
    plain = build_job(options(steps=3), gpus(1), LAYERED)
    assert simulate(plain).time_s == pytest.approx(3 * 32 * 0.003, rel=1e-9)


@needs_simgrid
def test_sync_workers_update_the_model_after_the_reduction():
    # every worker steps the optimizer once the all-reduce is done
    bw, lat = 1e9, 1e-4
    own = replace(PROFILE, grad_s=0.002, update_s=0.01, copy_s=0.004)
    job = build_job(options(steps=4), gpus(2, bw, lat), own)
    assert [w["update_s"] for w in job.workers] == [0.01, 0.01]
    # (and each step's gradient zeroed and checked; sync copies nothing)
    step = 32 * 0.003 + ring_allreduce_seconds(2, 1e8, bw, lat) + 0.01 + 0.002
    assert simulate(job).time_s == pytest.approx(4 * step, rel=1e-9)
    assert 64 / estimate(job).samples_per_sec == pytest.approx(step, rel=1e-9)


@needs_simgrid
@pytest.mark.parametrize(
    ("mode", "groups", "copies"),
    [("async", None, 2), ("hybrid", "0-1", 4)],
)
def test_leaders_copy_the_model_around_each_exchange(mode, groups, copies):
    # a lone leader flattens its gradient and copies the reply's weights in
    # (2 copies an update); a group's leader also flattens them for the
    # broadcast and its member copies them in (4 on the group's path)
    own = replace(PACED, parameters=1000, copy_s=0.005)
    common = dict(mode=mode, groups=groups, servers=1, steps=20, sample_ms=1.0)
    workers = 1 if mode == "async" else 2
    cluster = gpus(workers, 1e12, 0.0)
    base = simulate(build_job(options(**common), cluster, replace(own, copy_s=0.0)))
    job = build_job(options(**common), cluster, own)
    cycle = lambda p: p.group_update_s[0]  # noqa: E731
    # (over 20 updates: the first has no broadcast's copy before it)
    assert cycle(simulate(job)) - cycle(base) == pytest.approx(copies * 0.005, rel=0.02)
    # (the analytic model's queue wait moves a little with the cycle)
    assert estimate(job).group_cycle_s[0] - estimate(
        build_job(options(**common), cluster, replace(own, copy_s=0.0))
    ).group_cycle_s[0] == pytest.approx(copies * 0.005, rel=0.02)


@needs_simgrid
def test_a_validation_pull_queues_behind_the_pushes_at_the_server():
    # two async leaders; a server update of 0.2 s. Rank 0's pull waits for
    # the update in progress when it asks, so a validation there costs more
    # than its transfer and evaluation alone
    slow_server = replace(
        PACED,
        parameters=1000,
        validation_s=0.001,
        server=ServerFit(seconds_per_update=0.2, seconds_per_byte=0.0),
    )
    common = dict(mode="async", servers=1, steps=40, sample_ms=1.0)
    cluster = gpus(2, 1e12, 0.0)
    base = simulate(build_job(options(**common), cluster, slow_server))
    job = build_job(options(**common, eval_every=1), cluster, slow_server)
    checked = simulate(job)
    # about one validation an update: without the queue they would cost
    # 40 x 1 ms
    assert checked.time_s - base.time_s > 40 * 0.001 + 0.2


def test_calibration_makes_the_server_serve_at_its_measured_capacity(tmp_path):
    from hybridagg.sim import calibrate

    update = lambda b: 7e-5 + b * 3e-10  # noqa: E731  (the optimizer alone)
    trip = lambda b: 2 * (2e-5 + b / 6e9)  # noqa: E731
    size = 64 << 20
    records = [
        {"impl": "hybridagg-ps", "ranks": 2, "servers": 1, "bytes": b,
         "median_us": trip(b) * 1e6, "update_us": update(b) * 1e6}
        for b in (4096, 1 << 20, size)
    ]  # fmt: skip
    service = update(size) + trip(size) / 2 + 0.006  # 6 ms more: checks, copies
    saturated = {"impl": "hybridagg-ps", "leaders": 4, "servers": 1,
                 "updates_per_sec": 1 / service, "nap_ms": 0.0,
                 "capacity_bytes": size}  # fmt: skip
    ps = tmp_path / "ps.json"
    ps.write_text(json.dumps([*records, saturated]))
    server = calibrate(PROFILE, ps_json=ps).server
    assert server.seconds_per_update == pytest.approx(7e-5)
    # the simulated server: its update and the push copied in (its leader
    # copies the reply in)
    charged = (
        server.seconds(size) + server.transfer_latency_s + size / server.transfer_Bps
    )
    assert charged == pytest.approx(service, rel=1e-9)
    # a capacity the optimizer and the transfers already explain adds nothing
    fast = {**saturated, "updates_per_sec": 2 / service}
    ps.write_text(json.dumps([*records, fast]))
    assert calibrate(PROFILE, ps_json=ps).server.seconds_per_byte == pytest.approx(
        3e-10
    )


def test_profile_measures_a_workers_own_update_and_leaves_the_weights(tmp_path):
    import torch

    from hybridagg.train.config import OptimOptions
    from hybridagg.train.profiler import measure_worker_update

    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Linear(4, 2))
    before = [p.detach().clone() for p in model.parameters()]
    model(torch.ones(3, 8)).sum().backward()
    grad_s, update_s, copy_s = measure_worker_update(
        model, OptimOptions(lr=0.5), reps=2
    )
    assert grad_s > 0 and update_s > 0 and copy_s > 0
    for p, w in zip(model.parameters(), before, strict=True):
        assert torch.equal(p.detach(), w) and p.grad is None
    path = tmp_path / "p.json"
    data = {**json.loads(save_profile(PROFILE, path).read_text()), "update_s": -1}
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="update_s must be >= 0"):
        load_profile(path)


@needs_simgrid
def test_a_ring_waits_for_its_slowest_rank_before_any_copy_runs():
    # four paced ranks on two shared cores, rank 3 four times slower: every
    # rank's hop of the ring starts once rank 3 has the bucket (a phase
    # needs its neighbour's data), so the four copies share the two cores
    # then, not while rank 3 sleeps
    from hybridagg.sim import machine_cluster

    profile = replace(PACED, machine=MachineInfo(cores=2, memcpy_Bps=5e9))
    job = build_job(
        options(steps=2, sample_ms=1.0, slowdown="3:4"),
        machine_cluster(profile, 4, 0),
        profile,
    )
    copy = 2 * 3 / 4 * 1e8 / 5e9  # a rank's hop: 30 ms of one core
    step = 32 * 0.004 + 4 * copy / 2  # rank 3's target, then 4 copies on 2 cores
    assert simulate(job).time_s == pytest.approx(2 * step, rel=1e-6)
    assert 128 / estimate(job).samples_per_sec == pytest.approx(step, rel=1e-6)


@needs_simgrid
def test_on_shared_cores_a_server_copies_pushes_in_and_leaders_copy_replies():
    # four async leaders, paced to push far faster than one server on their
    # node serves: the server's service is its update and the push's copy;
    # the replies' copies are the leaders' own
    from hybridagg.sim import machine_cluster

    server = ServerFit(
        seconds_per_update=0.004, seconds_per_byte=0.0,
        transfer_latency_s=0.0, transfer_Bps=1e9,
    )  # fmt: skip
    profile = replace(
        PACED,
        parameters=2_500_000,  # a 10 MB gradient: 10 ms a copy
        server=server,
        machine=MachineInfo(cores=2, memcpy_Bps=5e9),
    )
    job = build_job(
        options(mode="async", servers=1, steps=200, sample_ms=0.01, batch_size=1),
        machine_cluster(profile, 4, 1),
        profile,
    )
    service = 0.004 + 1e7 / 1e9
    prediction = simulate(job)
    assert prediction.updates / prediction.time_s == pytest.approx(
        1 / service, rel=0.03
    )
