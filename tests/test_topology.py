"""Topology planning (pure logic) and hybridagg.init under real MPI."""

import json

import pytest

from hybridagg.slowdown import parse_slowdown
from hybridagg.topology import RankInfo, Topology, parse_group_spec, plan, speed_groups


def infos(n, hosts=None, devices=None, speeds=None, comps=None):
    return [
        RankInfo(
            host=(hosts or ["h0"] * n)[r],
            device=(devices or ["cpu:x"] * n)[r],
            speed=None if speeds is None else speeds[r],
            slurm_component=None if comps is None else comps[r],
        )
        for r in range(n)
    ]


def test_world_policy_and_roles():
    topo = plan("world", infos(5), 5, servers=1, rank=4)
    assert topo.groups == ((0, 1, 2, 3),)
    assert topo.servers == (4,)
    assert topo.is_server and topo.role == "server" and topo.group is None
    assert topo.role_of(0) == "leader" and topo.role_of(3) == "worker"
    assert topo.num_workers == 4 and topo.leaders == (0,)


def test_explicit_groups_leaders_and_node_placement():
    hosts = ["a", "a", "b", "b", "b", "c"]
    topo = plan("0-1,2-4", infos(6, hosts=hosts), 6, servers=1, rank=3)
    assert topo.groups == ((0, 1), (2, 3, 4))
    assert topo.leaders == (0, 2) and topo.leader == 2 and not topo.is_leader
    assert (topo.local_rank, topo.local_size) == (1, 3)
    assert (topo.cross_rank, topo.cross_size) == (1, 3)
    assert "group 1: ranks [2, 3, 4] (leader 2)" in topo.describe()


def test_union_ranges_and_json_file(tmp_path):
    assert parse_group_spec("0-1+4,2-3") == [[0, 1, 4], [2, 3]]
    # a plan's groups at 1,024 ranks: longer than a file name may be
    long = ",".join(f"{8 * g}-{8 * g + 7}" for g in range(128))
    assert parse_group_spec(long) == [list(range(8 * g, 8 * g + 8)) for g in range(128)]
    path = tmp_path / "groups.json"
    path.write_text(json.dumps({"groups": [[2, 3], [0, 1]]}))
    topo = plan(str(path), infos(4), 4)
    assert topo.groups == ((0, 1), (2, 3))


def test_node_and_device_policies():
    hosts = ["n1", "n2", "n1", "n2"]
    assert plan("node", infos(4, hosts=hosts), 4).groups == ((0, 2), (1, 3))
    devices = ["cuda:A100", "cuda:A100", "cuda:V100", "cpu:x"]
    assert plan("device", infos(4, devices=devices), 4).groups == ((0, 1), (2,), (3,))


def test_slurm_policy_uses_components():
    topo = plan("slurm", infos(5, comps=[0, 0, 1, 1, 2]), 5, servers=1)
    assert topo.groups == ((0, 1), (2, 3))
    with pytest.raises(ValueError, match="heterogeneous job step"):
        plan("slurm", infos(3), 3)


def test_speed_groups_keep_slow_ranks_apart():
    # two fast ranks, two 4x slower ones, with measurement noise
    speeds = {0: 100.0, 1: 91.0, 2: 24.0, 3: 26.5}
    assert speed_groups(speeds) == [[0, 1], [2, 3]]
    assert speed_groups(speeds, max_groups=1) == [[0, 1, 2, 3]]
    # three tiers, K=2 cuts at the largest gap only
    tiers = {0: 100.0, 1: 98.0, 2: 45.0, 3: 10.0}
    assert speed_groups(tiers, max_groups=2) == [[0, 1, 2], [3]]
    assert speed_groups(tiers) == [[0, 1], [2], [3]]
    topo = plan("speed:2", infos(4, speeds=[100, 91, 24, 26.5]), 4)
    assert topo.groups == ((0, 1), (2, 3))


@pytest.mark.parametrize(
    "spec,servers,n,message",
    [
        ("0-2,2-3", 0, 4, "rank 2 is in group 0 and group 1"),
        ("0-1", 0, 4, r"workers \[2, 3\] are in no group"),
        ("0-1,,2-3", 0, 4, "group 1 of '0-1,,2-3' is empty"),
        ("0-2,3", 1, 4, "rank 3, a parameter server"),
        ("world", 4, 4, "4 servers need at least 5 ranks"),
        ("0-7", 0, 4, "outside the world"),
        ("1-0", 0, 4, "0 <= N <= M"),
        ("a-b", 0, 4, "is not N or N-M"),
        ("speed:x", 0, 4, "K in speed:K must be an integer"),
        ("nosuch.json", 0, 4, "does not exist"),
    ],
)
def test_invalid_specs(spec, servers, n, message):
    with pytest.raises(ValueError, match=message):
        plan(spec, infos(n, speeds=[1.0] * n), n, servers=servers)


def test_bad_types_and_direct_construction():
    with pytest.raises(TypeError, match="groups must be a string"):
        plan(["0-1"], infos(2), 2)
    with pytest.raises(TypeError, match="servers must be an int"):
        plan("world", infos(2), 2, servers="1")
    with pytest.raises(ValueError, match="servers must be the last"):
        Topology(world_size=3, groups=((0, 1),), servers=(1,))
    with pytest.raises(ValueError, match="world_size"):
        Topology(world_size=0, groups=((0,),))


def test_slowdown_spec():
    s = parse_slowdown("0-1:1,2-3:4@0;0-1:3,2-3:1@30")
    assert s.factor(2, 10.0) == 4.0 and s.factor(0, 10.0) == 1.0
    assert s.factor(0, 31.0) == 3.0 and s.factor(2, 31.0) == 1.0
    assert s.factor(9, 5.0) == 1.0 and s.changes
    assert not parse_slowdown("") and not parse_slowdown(None).changes
    for bad, msg in [
        ("0-1", "RANKS:FACTOR"),
        ("0:0", "positive"),
        ("0:x", "not a number"),
        ("0:2,0:3", "twice"),
        ("0:2@-1", "must be a finite number >= 0"),
        ("0:2@5;1:2@5", "same time"),
    ]:
        with pytest.raises(ValueError, match=msg):
            parse_slowdown(bad)
    with pytest.raises(ValueError, match="workers are 0-1"):
        parse_slowdown("0-3:2").validate_workers(2)


# ------------------------------------------------------------- under mpiexec
@pytest.mark.mpi(ranks=[1, 2, 3, 4, 5], timeout=120)
def test_init_builds_the_communicators(mpi_ranks):
    import hybridagg

    n = mpi_ranks
    servers = 1 if n > 2 else 0
    topo = hybridagg.init(groups="world", servers=servers)
    comms = topo.comms
    assert comms.world.size == n
    assert topo.num_workers == n - servers
    if topo.is_server:
        assert comms.group is None and comms.workers is None
        assert comms.leaders.size == 1 + servers
    else:
        assert comms.group.size == n - servers
        assert comms.workers.size == n - servers
        assert (comms.leaders is not None) == topo.is_leader
    assert comms.node.size == topo.local_size == n
    comms.free()


@pytest.mark.mpi(ranks=[4, 5], timeout=120)
def test_explicit_and_node_groups_under_mpi(mpi_ranks):
    import hybridagg

    topo = hybridagg.init(groups="0-1,2-3", servers=mpi_ranks - 4)
    if topo.is_worker:
        assert topo.comms.group.size == 2
        assert topo.group == topo.rank // 2
    if topo.is_leader or topo.is_server:
        assert topo.comms.leaders.size == 2 + (mpi_ranks - 4)
    node = hybridagg.init(groups="node")
    assert node.groups == (tuple(range(mpi_ranks)),)  # one node here


@pytest.mark.mpi(ranks=4, timeout=120)
def test_speed_policy_sees_emulated_slowdown():
    import hybridagg

    topo = hybridagg.init(groups="speed:2", slowdown="0-1:1,2-3:4")
    assert topo.groups == ((0, 1), (2, 3))


@pytest.mark.mpi(ranks=[2, 3], timeout=120)
def test_bad_or_disagreeing_specs_fail_on_every_rank(mpi_ranks):
    from mpi4py import MPI

    import hybridagg

    rank = MPI.COMM_WORLD.rank
    with pytest.raises(ValueError, match="are in no group"):
        hybridagg.init(groups="0")
    spec = "world" if rank == 0 else "0,1-9"
    with pytest.raises(ValueError, match="ranks disagree"):
        hybridagg.init(groups=spec)
    with pytest.raises(ValueError, match="servers need at least"):
        hybridagg.init(servers=mpi_ranks)
    with pytest.raises(TypeError, match="groups must be a string"):
        hybridagg.init(groups=[0, 1])


# Values copied from a real Slurm 22.05 heterogeneous step (2 + 3 tasks,
# srun --het-group=0,1) on the two-node test cluster.
HET_STEP = {
    "SLURM_HET_SIZE": "2",
    "SLURM_NTASKS": "5",
    "SLURM_NTASKS_HET_GROUP_0": "2",
    "SLURM_NTASKS_HET_GROUP_1": "3",
    "SLURM_JOB_ID": "1",
    "SLURM_STEP_ID": "0",
}


@pytest.mark.parametrize("procid,component", [(0, 0), (1, 0), (2, 1), (4, 1)])
def test_slurm_component_from_procid_ranges(monkeypatch, procid, component):
    from hybridagg.runtime.launchenv import launch_env, slurm_het_component

    for key, value in HET_STEP.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("SLURM_PROCID", str(procid))
    monkeypatch.delenv("HYBRIDAGG_HET_COMPONENT", raising=False)
    assert slurm_het_component() == component
    env = launch_env()
    assert (env.launcher, env.rank, env.size, env.het_component) == (
        "slurm",
        procid,
        5,
        component,
    )


def test_slurm_component_absent_or_explicit(monkeypatch):
    from hybridagg.runtime.launchenv import slurm_het_component

    for key, value in HET_STEP.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("SLURM_PROCID", "1")
    monkeypatch.setenv("SLURM_NTASKS", "2")  # a step of component 0 only
    assert slurm_het_component() is None
    monkeypatch.setenv("HYBRIDAGG_HET_COMPONENT", "1")  # stated by the launcher
    assert slurm_het_component() == 1
    monkeypatch.delenv("SLURM_HET_SIZE")
    monkeypatch.delenv("HYBRIDAGG_HET_COMPONENT")
    assert slurm_het_component() is None


def test_launch_env_open_mpi_and_hydra(monkeypatch):
    from hybridagg.runtime.launchenv import launch_env

    for key in list(__import__("os").environ):
        if key.startswith(("SLURM_", "OMPI_COMM_WORLD", "PMI_", "MPI_LOCAL")):
            monkeypatch.delenv(key)
    assert launch_env().launcher == "none"
    monkeypatch.setenv("PMI_RANK", "3")
    monkeypatch.setenv("PMI_SIZE", "4")
    monkeypatch.setenv("MPI_LOCALRANKID", "1")
    assert launch_env() == launch_env().__class__("mpich", 3, 4, 1, None, None)
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "2")
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "5")
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_RANK", "0")
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "5")
    assert launch_env().launcher == "openmpi" and launch_env().rank == 2
