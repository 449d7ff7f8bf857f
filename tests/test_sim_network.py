"""hybridagg.sim: a cluster's core switch, and its links between nodes
calibrated on the all-reduce across them (``NetworkFit``)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from test_sim import PROFILE, needs_simgrid, options
from test_sim_exchange import two_nodes

from hybridagg.sim import (
    ClusterSpec,
    LinkSpec,
    MachineSpec,
    NodeType,
    ServerPlacement,
    build_job,
    load_cluster,
    load_profile,
    ring_allreduce_seconds,
    simulate,
)
from hybridagg.sim.analytic import estimate
from hybridagg.sim.calibrate import calibrate, fit_network, kernel_bandwidth
from hybridagg.sim.job import calibrated_cluster
from hybridagg.sim.profile import NetworkFit, profile_from_dict, save_profile

NIC = 1.25e9  # 10 Gbit/s


def emulated(
    name: str = "four", shared: bool = True, core=None, machine=None
) -> ClusterSpec:
    """Two worker nodes of two ranks and a server node, as the emulated
    four-workers-10g (``shared``: each node's ranks share one core;
    ``machine``: the nodes are namespaces of that machine)."""
    cores = 1 if shared else None
    return ClusterSpec(
        name=name,
        node_types=(
            NodeType(name="w", count=2, devices=2, cores=cores),
            NodeType(name="ps", count=1, devices=0, cores=1),
        ),
        intra_node=LinkSpec(5e9, 1e-6),
        inter_node=LinkSpec(NIC, 5e-5),
        servers=ServerPlacement(("ps",), 1),
        core=core,
        machine=machine,
    )


def ring_records(ranks: int, latency: float, edge: float) -> list[dict]:
    """bench/allreduce.py's records of a ring whose links move ``edge`` B/s."""
    return [
        {"impl": "hybridagg-flat", "ranks": ranks, "bytes": b,
         "median_us": ring_allreduce_seconds(ranks, b, edge, latency) * 1e6}
        for b in (4096, 1 << 20, 16 << 20, 64 << 20)
    ]  # fmt: skip


# ------------------------------------------------------------ the cluster file
def test_a_core_switch_is_read_from_the_cluster_file_and_checked(tmp_path):
    text = (
        "name: c\nlinks:\n  intra_node: {bandwidth: 5GB/s}\n"
        "  inter_node: {bandwidth: 10Gb/s, latency: 50us}\n{core}"
        "node_types:\n  - {name: n, count: 2, devices: 2}\n"
    )
    path = tmp_path / "c.yaml"
    path.write_text(text.replace("{core}", ""))
    assert load_cluster(path).core is None
    path.write_text(
        text.replace("{core}", "  core: {bandwidth: 12Gb/s, latency: 2us}\n")
    )
    assert load_cluster(path).core == LinkSpec(1.5e9, 2e-6)
    refused(path, text, "{core}", (
        ("  core: {bandwidth: 0Gb/s}\n", "links.core"),
        ("  core: {latency: 2us}\n", "links.core.*bandwidth"),
        ("  core: {bandwidth: 1GB/s, speed: 2}\n", "links.core.*speed"),
    ))  # fmt: skip


def refused(path, text: str, slot: str, cases) -> None:
    """Each ``(bad, message)`` of ``cases`` put in ``text``'s ``slot`` makes
    a cluster file that is refused with ``message``."""
    for bad, message in cases:
        path.write_text(text.replace(slot, bad))
        with pytest.raises(ValueError, match=message):
            load_cluster(path)


def test_the_machine_of_namespaces_is_read_from_the_cluster_file_and_checked(
    tmp_path,
):
    text = (
        "name: c\nlinks:\n  intra_node: {bandwidth: 5GB/s}\n"
        "  inter_node: {bandwidth: 10Gb/s, latency: 50us}\n"
        "node_types:\n  - {name: n, count: 2, devices: 2, cores: 1}\n{machine}"
    )
    path = tmp_path / "c.yaml"
    path.write_text(text.replace("{machine}", ""))
    assert load_cluster(path).machine is None
    path.write_text(
        text.replace("{machine}", "machine: {cores: 2, kernel_bandwidth: 8Gb/s}\n")
    )
    assert load_cluster(path).machine == MachineSpec(cores=2, kernel_bandwidth=1e9)
    refused(path, text, "{machine}", (
        ("machine: {cores: 0, kernel_bandwidth: 1GB/s}\n", "machine.cores.*>= 1"),
        ("machine: {cores: 2}\n", "machine.kernel_bandwidth: missing"),
        ("machine: {cores: 2, kernel_bandwidth: 0GB/s}\n", "machine.kernel_bandwidth"),
        ("machine: {cores: 2, kernel_bandwidth: 1GB/s, numa: 2}\n", "machine.*numa"),
        ("machine: 2\n", "machine.*mapping"),
    ))  # fmt: skip
    # namespaces share the machine's cores: a node of devices of its own is not one
    path.write_text(
        text.replace("cores: 1}", "}").replace(
            "{machine}", "machine: {cores: 2, kernel_bandwidth: 1GB/s}\n"
        )
    )
    with pytest.raises(ValueError, match=r"every node type needs cores \(not n\)"):
        load_cluster(path)
    four = load_cluster("examples/clusters/four-workers-10g.yaml")
    assert four.machine is not None and four.machine.cores == 2


# ------------------------------------------------------------- the simulator
def namespaces(cores: int, kernel: float) -> ClusterSpec:
    """Two namespaces of one rank each on a machine of ``cores`` cores."""
    return ClusterSpec(
        name="t",
        node_types=(NodeType(name="g", count=2, devices=1, cores=1),),
        intra_node=LinkSpec(1e10, 1e-5),
        inter_node=LinkSpec(1e9, 5e-5),
        servers=ServerPlacement(("g",), 1),
        machine=MachineSpec(cores=cores, kernel_bandwidth=kernel),
    )


@needs_simgrid
@pytest.mark.parametrize("cores", [1, 2, 8])
def test_a_ring_across_namespaces_shares_the_machines_cores(cores):
    # 2 ranks in 2 namespaces: the ring moves the gradient both ways at
    # once (its 2 phases as one message, the second phase's latency after
    # it); each message costs bytes/kernel on a core at each end beside its
    # flow (1 GB/s, 50 us), so 4 such works share the machine's cores:
    # CPU-bound below 4 cores, a core each from 4
    kernel, nbytes, hop = 5e8, 1e8, 5e-5
    job = build_job(options(steps=3), namespaces(cores, kernel), PROFILE)
    compute = 32 * 0.003 * max(1.0, 2 / cores)  # both ranks compute on the cores
    ring = max(hop + nbytes / 1e9, nbytes / kernel * max(1.0, 4 / cores)) + hop
    step = compute + ring
    assert simulate(job).time_s == pytest.approx(3 * step, rel=1e-6)
    # the analytic model: the ring at the kernel's rate where one end's
    # core bounds it, and the cores' demand per second kept within them
    assert estimate(job).samples_per_sec == pytest.approx(64 / step, rel=1e-3)


@needs_simgrid
@pytest.mark.parametrize("cores", [1, 2])
def test_a_rank_waiting_for_its_ring_polls_a_core_of_the_machine(cores):
    # rank 1 computes twice rank 0's 0.096 s. On 1 core both compute at half
    # speed until rank 0 is done (0.192 s); rank 0 then polls at the ring's
    # barrier, so rank 1's last 0.096 s still run at half speed (0.384 s in
    # all). On 2 cores each has one. Then the ring (the kernel negligible:
    # 100 MB over 1 GB/s, two 50 us latencies)
    job = build_job(options(steps=3, slowdown="1:2"), namespaces(cores, 1e15), PROFILE)
    compute = 0.384 if cores == 1 else 0.192
    step = compute + 1e8 / 1e9 + 2 * 5e-5
    assert simulate(job).time_s == pytest.approx(3 * step, rel=1e-6)


@needs_simgrid
def test_a_fitted_kernel_gives_back_the_ring_it_was_fitted_on():
    # the four-worker emulated cluster as one 2-core machine's namespaces:
    # the ring measured across it (links at 0.6 GB/s) is fitted as the
    # kernel's rate, and the simulator then reduces as fast as it measured
    machine = MachineSpec(cores=2, kernel_bandwidth=1e9)
    cluster = emulated(machine=machine)
    fit = fit_network(ring_records(4, 5e-4, 6e8), cluster)
    assert fit.core_Bps == 0
    assert fit.kernel_Bps == pytest.approx(
        kernel_bandwidth(6e8, ranks=4, crossings=2, cores=2, copy_Bps=5e9)
    )
    profile = replace(PROFILE, networks=(fit,), forward_s_per_sample=1e-9,
                      backward_s_per_sample=1e-9)  # fmt: skip
    job = build_job(options(steps=2), cluster, profile)
    ring = ring_allreduce_seconds(4, 1e8, 6e8, 5e-4)
    # (the latency hides under the cores' work: within 2%)
    assert simulate(job).time_s == pytest.approx(2 * ring, rel=0.02)


@needs_simgrid
@pytest.mark.parametrize("core", [None, 5e9, 6e8])
def test_a_ring_across_nodes_shares_the_core_switch(core):
    # 2 ranks on 2 nodes: both of the ring's flows cross the core; below
    # twice the NICs' rate it holds each to half its bandwidth
    cluster = ClusterSpec(
        name="t",
        node_types=(NodeType(name="g", count=2, devices=1),),
        intra_node=LinkSpec(1e10, 1e-5),
        inter_node=LinkSpec(1e9, 5e-5),
        servers=ServerPlacement(("g",), 1),
        core=None if core is None else LinkSpec(core, 2e-5),
    )
    job = build_job(options(steps=3), cluster, PROFILE)
    edge = 1e9 if core is None else min(1e9, core / 2)
    hop = 1e-5 + 5e-5 + (0.0 if core is None else 2e-5)
    step = 32 * 0.003 + ring_allreduce_seconds(2, 1e8, edge, hop)
    assert simulate(job).time_s == pytest.approx(3 * step, rel=1e-8)
    assert estimate(job).samples_per_sec == pytest.approx(64 / step, rel=1e-9)


@needs_simgrid
def test_pushes_across_the_core_switch_are_held_to_its_bandwidth():
    # one async worker on its own node pushes the gradient to a server on
    # another in one message each way (in parts: tests/test_sim_exchange.py):
    # the push and the reply each cross the core alone
    cluster = two_nodes(core=4e8)
    whole = dict(part_bytes=0)
    job = replace(
        build_job(options(mode="async", servers=1, steps=3), cluster, PROFILE), **whole
    )
    # (the run's time ends with the third update, before its reply)
    server = 0.004 + 1e8 * 2e-10
    step = 32 * 0.003 + 2 * 1e8 / 4e8 + server
    assert simulate(job).time_s == pytest.approx(3 * step - 1e8 / 4e8, rel=1e-6)
    free = replace(
        build_job(
            options(mode="async", servers=1, steps=3),
            replace(cluster, core=None),
            PROFILE,
        ),
        **whole,
    )
    step = 32 * 0.003 + 2 * 1e8 / 1e9 + server
    assert simulate(free).time_s == pytest.approx(3 * step - 1e8 / 1e9, rel=1e-6)


# ------------------------------------------------------------- calibration
@pytest.mark.parametrize("shared", [True, False])
def test_fit_network_recovers_the_latency_and_the_core(shared):
    cluster = emulated(shared=shared)
    fit = fit_network(ring_records(4, 5e-4, 6e8), cluster)
    own = 0.0 if shared else 1e-6  # a device node's own link's latency
    assert (fit.cluster, fit.ranks, fit.crossings) == ("four", 4, 2)
    assert fit.latency_s == pytest.approx(5e-4 - own)
    assert fit.core_Bps == pytest.approx(2 * 6e8)  # both crossings share it
    assert [p[0] for p in fit.points] == [4096, 1 << 20, 16 << 20, 64 << 20]
    # links at their nominal rate: nothing else held them, no core
    assert fit_network(ring_records(4, 5e-5, NIC), cluster).core_Bps == 0.0


def test_kernel_bandwidth_solves_the_rings_phase_on_the_cores():
    # 4 ranks, 2 links between namespaces: per byte of a phase, 2 x 2 ends
    # at the kernel's rate and 2 copies at 5 GB/s fill 2 cores for 1/0.6 ns
    kernel = kernel_bandwidth(6e8, ranks=4, crossings=2, cores=2, copy_Bps=5e9)
    assert 4 / kernel + 2 / 5e9 == pytest.approx(2 / 6e8)
    # copies alone would take longer than the phase did: no kernel cost fitted
    assert kernel_bandwidth(6e8, ranks=4, crossings=2, cores=2, copy_Bps=5e8) == 0.0


def test_fit_network_refuses_what_measured_no_link_between_nodes():
    with pytest.raises(ValueError, match="sit on one node"):
        fit_network(ring_records(2, 1e-4, 1e9), emulated())
    with pytest.raises(ValueError, match="5 ranks, but cluster four has 4 devices"):
        fit_network(ring_records(5, 1e-4, 1e9), emulated())
    with pytest.raises(ValueError, match="no hybridagg-flat or hybridagg records"):
        fit_network([{"impl": "mpi4py", "ranks": 4, "bytes": 1, "median_us": 1}],
                    emulated())  # fmt: skip


def test_the_profile_keeps_one_network_per_cluster(tmp_path):
    first, second = tmp_path / "a.json", tmp_path / "b.json"
    first.write_text(json.dumps(ring_records(4, 5e-4, 6e8)))
    second.write_text(json.dumps(ring_records(4, 3e-4, 5e8)))
    profile = calibrate(PROFILE, network_json=first, network_cluster=emulated())
    profile = calibrate(profile, network_json=first, network_cluster=emulated("other"))
    assert [n.cluster for n in profile.networks] == ["four", "other"]
    profile = calibrate(profile, network_json=second, network_cluster=emulated())
    assert [n.cluster for n in profile.networks] == ["other", "four"]
    assert profile.network_for("four").core_Bps == pytest.approx(1e9)
    assert profile.network_for("none") is None
    assert profile.notes["calibrated_from"] == [str(first), str(first), str(second)]
    assert load_profile(save_profile(profile, tmp_path / "p.json")) == profile
    for kwargs in ({"network_json": first}, {"network_cluster": emulated()}):
        with pytest.raises(ValueError, match="go together"):
            calibrate(PROFILE, **kwargs)


@pytest.mark.parametrize(
    "networks, message",
    [
        ({}, "networks must be a list"),
        ([3], r"networks\[0\] must be a mapping"),
        ([{"latency_s": 0, "core_Bps": 0, "ranks": 4, "crossings": 2}],
         r"networks\[0\]\.cluster is missing"),
        ([{"cluster": "c", "latency_s": 0, "core_Bps": 0, "ranks": 1,
           "crossings": 2}], "ranks must be an integer >= 2"),
        ([{"cluster": "c", "latency_s": 0, "core_Bps": 0, "ranks": 4,
           "crossings": 0}], "crossings must be an integer >= 1"),
        ([{"cluster": "c", "latency_s": -1, "core_Bps": 0, "ranks": 4,
           "crossings": 2}], "latency_s must be >= 0"),
        ([{"cluster": "c", "latency_s": 0, "core_Bps": 0, "ranks": 4,
           "crossings": 2}] * 2, r"clusters \['c'\] are fitted twice"),
    ],
)  # fmt: skip
def test_bad_network_fits_are_refused_naming_the_field(networks, message):
    data = {**json.loads(json.dumps(PROFILE.as_dict())), "networks": networks}
    with pytest.raises(ValueError, match=message):
        profile_from_dict(data, "p.json")


def test_a_fit_applies_to_its_own_cluster_only():
    fit = NetworkFit(
        cluster="four", latency_s=4e-4, core_Bps=1.2e9, ranks=4, crossings=2
    )
    profile = replace(PROFILE, networks=(fit,))
    other = emulated("other")
    assert calibrated_cluster(other, profile) is other
    got = calibrated_cluster(emulated(), profile)
    assert got.inter_node == LinkSpec(NIC, 4e-4)
    assert got.core == LinkSpec(1.2e9, 0.0)
    # a fit that found no core keeps the cluster file's own
    own = LinkSpec(9e9, 1e-6)
    free = replace(profile, networks=(replace(fit, core_Bps=0.0),))
    assert calibrated_cluster(emulated(core=own), free).core == own
    job = build_job(options(mode="sync", steps=2), emulated(), profile)
    assert job.core == {"bandwidth": 1.2e9, "latency": 0.0}
    assert job.inter == {"bandwidth": NIC, "latency": 4e-4}
    assert build_job(options(mode="sync", steps=2), other, profile).core is None
