"""The emulated cluster's pure parts: the cluster file, the plan, the launch
agent, ``hybridagg-run --cluster`` and the state check.

No root, no MPI, no namespaces: the description is checked as a user's file
would be, the plan's commands are compared with what they must build (and
what ``down`` must remove is derived from what ``up`` makes), the launch
agent is executed with a fake ``ip`` first on ``PATH``, and the launcher is
planned with fake probes. The cluster itself is brought up by
``make test-cluster`` (tests/cluster, root).
"""

from __future__ import annotations

import json
import re
import shlex
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from hybridagg import cli, launcher
from hybridagg.cluster import ClusterError, load, parse, parse_rate, plan, read_state

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "examples" / "cluster.toml"
MPIEXEC = "/opt/ompi/bin/mpiexec"
OPEN_MPI_5 = "mpiexec (Open MPI) 5.0.11"
OPEN_MPI_4 = "mpirun (Open MPI) 4.1.4"
HYDRA = "HYDRA build details:\n    Version: 4.2.0"
TWO_HOSTS = '[[hosts]]\nname = "a"\nranks = 2\n\n[[hosts]]\nname = "ps"\nranks = 1\n'


def write(tmp_path: Path, text: str, name: str = "cluster.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def executable(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return path


def host(name: str = '"a"', ranks: str = "2", extra: str = "") -> str:
    return f"[[hosts]]\nname = {name}\nranks = {ranks}\n{extra}\n"


# ---------------------------------------------------------------------- spec
def test_the_example_file_loads():
    spec = load(EXAMPLE)
    assert spec.name == "hx"
    assert str(spec.subnet) == "10.213.77.0/24"
    assert [(h.name, h.ranks) for h in spec.hosts] == [("a", 2), ("b", 2), ("ps", 1)]
    assert [h.link.rate_bps for h in spec.hosts] == [10**9, 10**9, 10**10]
    assert all(h.link.latency_ms == 0 for h in spec.hosts)
    assert [spec.address(h) for h in spec.hosts] == [
        "10.213.77.1",
        "10.213.77.2",
        "10.213.77.3",
    ]
    assert spec.switch_address == "10.213.77.254"
    assert spec.total_ranks == 5
    assert [spec.host_of_rank(r).name for r in range(5)] == ["a", "a", "b", "b", "ps"]
    assert spec.source == str(EXAMPLE)
    for rank in (5, -1):
        with pytest.raises(
            ValueError, match=f"rank {rank} out of range: .* has 5 ranks"
        ):
            spec.host_of_rank(rank)


def test_host_defaults_and_overrides():
    spec = parse(
        {
            "bandwidth": "100mbit",
            "latency_ms": 0.5,
            "hosts": [
                {"name": "a", "ranks": 1},
                {"name": "b", "ranks": 1, "bandwidth": "1gbit", "latency_ms": 0},
            ],
        }
    )
    assert spec.name == "hx" and str(spec.subnet) == "10.213.77.0/24"
    a, b = spec.hosts
    assert (a.link.rate_bps, a.link.latency_ms) == (10**8, 0.5)
    assert (b.link.rate_bps, b.link.latency_ms) == (10**9, 0.0)
    assert a.link.describe() == "100 Mbit/s, 0.5 ms"
    assert b.link.describe() == "1 Gbit/s"
    assert a.link.rate_bytes == 12.5e6
    unshaped = parse({"hosts": [{"name": "a", "ranks": 1}]}).hosts[0].link
    assert unshaped.rate_bps is None and unshaped.rate_bytes is None
    assert unshaped.describe() == "unshaped"


def test_a_subnet_filled_to_the_last_host_keeps_the_switch_apart():
    def hosts(n: int) -> list[dict]:
        return [{"name": f"h{i}", "ranks": 1} for i in range(n)]

    spec = parse({"subnet": "192.168.7.8/29", "hosts": hosts(5)})
    addresses = [spec.address(h) for h in spec.hosts]
    assert addresses == [f"192.168.7.{i}" for i in range(9, 14)]
    assert spec.switch_address == "192.168.7.14"
    with pytest.raises(
        ValueError, match=re.escape("6 hosts do not fit subnet 192.168.7.8/29")
    ):
        parse({"subnet": "192.168.7.8/29", "hosts": hosts(6)})


REFUSALS = [
    # typos
    (f'bandwith = "1gbit"\n{TWO_HOSTS}', ["unknown key 'bandwith'"]),
    (TWO_HOSTS + host('"c"', "1", "rank = 1"), ["hosts[2]", "unknown key 'rank'"]),
    # names that would not fit (or not be) kernel interface names
    (f'name = "HX"\n{TWO_HOSTS}', ["name must be", "'HX'"]),
    (f'name = "abcdefg"\n{TWO_HOSTS}', ["name must be", "'abcdefg'"]),
    (f'name = "1x"\n{TWO_HOSTS}', ["name must be", "'1x'"]),
    (host('"A"'), ["hosts[0]", "name must be", "'A'"]),
    (host('"abcdefghi"'), ["hosts[0]", "name must be", "'abcdefghi'"]),
    (host('"1a"'), ["hosts[0]", "name must be", "'1a'"]),
    (host() + host(), ["hosts[1]", "'a' appears twice"]),
    # ranks
    (host(ranks="0"), ["hosts[0] (a)", "ranks must be an integer >= 1", "got 0"]),
    (host(ranks='"2"'), ["hosts[0] (a)", "ranks must be", "'2'"]),
    (host(ranks="true"), ["hosts[0] (a)", "ranks must be", "True"]),
    # server slots
    (
        host(extra="servers = 3"),
        ["hosts[0] (a)", "servers must be", "to its ranks (2)", "got 3"],
    ),
    (host(extra="servers = -1"), ["hosts[0] (a)", "servers must be", "got -1"]),
    (host(extra='servers = "1"'), ["hosts[0] (a)", "servers must be", "'1'"]),
    # bandwidth: bits only ("bps" is bytes to tc)
    (
        f'bandwidth = "1gbps"\n{TWO_HOSTS}',
        ["bandwidth must be a rate in bits", "'1gbps'"],
    ),
    (host(extra='bandwidth = "fast"'), ["hosts[0] (a): bandwidth", "'fast'"]),
    (
        host(extra="bandwidth = 1000"),
        ["hosts[0] (a): bandwidth must be a string", "1000"],
    ),
    (f'bandwidth = "7kbit"\n{TWO_HOSTS}', ["bandwidth must be at least 8kbit"]),
    # latency
    (host(extra="latency_ms = -1"), ["hosts[0] (a): latency_ms", ">= 0", "-1"]),
    (f"latency_ms = nan\n{TWO_HOSTS}", ["latency_ms must be finite", "nan"]),
    (host(extra="latency_ms = inf"), ["hosts[0] (a): latency_ms", "finite", "inf"]),
    (host(extra='latency_ms = "1ms"'), ["hosts[0] (a): latency_ms", "'1ms'"]),
    # subnet
    (f'subnet = "8.8.8.0/24"\n{TWO_HOSTS}', ["8.8.8.0/24 is not a private network"]),
    (f'subnet = "0.0.0.0/24"\n{TWO_HOSTS}', ["0.0.0.0/24 is not a private network"]),
    (f'subnet = "240.0.0.0/24"\n{TWO_HOSTS}', ["240.0.0.0/24 is not a private"]),
    (f'subnet = "127.0.0.0/24"\n{TWO_HOSTS}', ["127.0.0.0/24 is not a private"]),
    (f'subnet = "169.254.1.0/24"\n{TWO_HOSTS}', ["169.254.1.0/24 is not a private"]),
    (f'subnet = "10.0.0.0/7"\n{TWO_HOSTS}', ["within 10.0.0.0/8, 172.16.0.0/12"]),
    (f'subnet = "not a network"\n{TWO_HOSTS}', ["subnet must be", "'not a network'"]),
    (f'subnet = "10.0.0.1/24"\n{TWO_HOSTS}', ["subnet must be", "'10.0.0.1/24'"]),
    (f'subnet = "10.0.0.0/30"\n{TWO_HOSTS}', ["2 hosts do not fit", "room for 1"]),
    # no hosts
    ('name = "hx"\n', ["needs at least one [[hosts]] entry"]),
    ("hosts = []\n", ["needs at least one [[hosts]] entry"]),
    ("hosts = [1]\n", ["hosts[0] must be a table"]),
]


@pytest.mark.parametrize(
    "text,fragments", REFUSALS, ids=[fragments[-1] for _, fragments in REFUSALS]
)
def test_a_bad_cluster_file_is_refused_naming_file_and_entry(tmp_path, text, fragments):
    path = write(tmp_path, text)
    with pytest.raises(ValueError) as refused:
        load(path)
    message = str(refused.value)
    assert message.startswith(f"{path}: "), message
    for fragment in fragments:
        assert fragment in message, message


def test_a_missing_or_non_toml_file_is_refused(tmp_path):
    missing = tmp_path / "nope.toml"
    with pytest.raises(
        ValueError, match=re.escape(f"cluster file {missing}: No such file")
    ):
        load(missing)
    path = write(tmp_path, "name = \n[[hosts]\n")
    with pytest.raises(ValueError, match=re.escape(f"cluster file {path} is not TOML")):
        load(path)


@pytest.mark.parametrize(
    "text,bps",
    [
        ("8kbit", 8_000),
        ("100kbit", 10**5),
        ("100mbit", 10**8),
        ("1gbit", 10**9),
        ("1Gbit", 10**9),
        (" 10 gbit ", 10**10),
        ("2.5gbit", 2_500_000_000),
        ("1.5mbit", 1_500_000),
        ("1tbit", 10**12),
        ("9000bit", 9000),
    ],
)
def test_parse_rate_reads_tc_decimal_units(text, bps):
    assert parse_rate(text) == bps


@pytest.mark.parametrize("text", ["1gbps", "1gb", "1e9bit", "gbit", "-1gbit", "1kibit"])
def test_parse_rate_refuses_what_is_not_bits(text):
    with pytest.raises(
        ValueError, match=r"^somewhere: bandwidth must be a rate in bits"
    ):
        parse_rate(text, "somewhere: bandwidth")


@pytest.mark.parametrize("value", [10**9, 1.5, True, None])
def test_parse_rate_refuses_what_is_not_a_string(value):
    with pytest.raises(ValueError, match=r"^somewhere: bandwidth must be a string"):
        parse_rate(value, "somewhere: bandwidth")


# ---------------------------------------------------------------------- plan
LONGEST = {
    "name": "abcdef",
    "latency_ms": 1.5,
    "hosts": [
        {"name": "abcdefgh", "ranks": 2, "bandwidth": "1gbit"},
        {"name": "zyxwvuts", "ranks": 1},
    ],
}


def created(cmds, verb: str) -> dict[str, set[str]]:
    """Namespaces and root-namespace links that ``ip ... <verb>`` names."""
    return {
        "namespaces": {c[3] for c in cmds if c[:3] == ["ip", "netns", verb]},
        "links": {c[3] for c in cmds if c[:3] == ["ip", "link", verb]},
    }


def tc_of(cmds, *, netns: str | None, device: str) -> list[list[str]]:
    """The ``tc`` commands on one end of a link."""
    found = []
    for c in cmds:
        if c[0] != "tc" or c[c.index("dev") + 1] != device:
            continue
        in_ns = c[1:3] == ["-n", netns] if netns else "-n" not in c
        if in_ns:
            found.append(c)
    return found


def test_up_commands_names_and_addresses():
    spec = load(EXAMPLE)
    cmds = plan.up_commands(spec)
    made = created(cmds, "add")
    assert made["namespaces"] == {"hx-a", "hx-b", "hx-ps"}
    assert made["links"] == {"hxsw", "hx-a", "hx-b", "hx-ps"}
    assert ["ip", "link", "add", "hxsw", "type", "bridge"] in cmds
    assert ["ip", "addr", "add", "10.213.77.254/24", "dev", "hxsw"] in cmds
    for h, address in zip(
        spec.hosts, ("10.213.77.1", "10.213.77.2", "10.213.77.3"), strict=True
    ):
        ns = plan.namespace_name(spec, h)
        link = plan.switch_link_name(spec, h)
        assert ns == link == f"hx-{h.name}"
        add_veth = cmds.index(
            [
                "ip",
                "link",
                "add",
                link,
                "type",
                "veth",
                "peer",
                "name",
                "eth0",
                "netns",
                ns,
            ]
        )
        assert cmds.index(["ip", "netns", "add", ns]) < add_veth
        assert ["ip", "link", "set", link, "master", "hxsw", "up"] in cmds
        assert ["ip", "-n", ns, "addr", "add", f"{address}/24", "dev", "eth0"] in cmds
        assert ["ip", "-n", ns, "link", "set", "eth0", "up"] in cmds


def test_the_longest_names_fit_kernel_interface_names():
    spec = parse(LONGEST)
    cmds = plan.up_commands(spec)
    names = {plan.bridge_name(spec)}
    for c in cmds:
        if c[:3] == ["ip", "link", "add"]:
            names.add(c[3])
            if "peer" in c:
                names.add(c[c.index("peer") + 2])
        if c[:3] == ["ip", "netns", "add"]:
            names.add(c[3])
        if "dev" in c:
            names.add(c[c.index("dev") + 1])
    assert "abcdef-abcdefgh" in names and "abcdefsw" in names
    assert max(len(n) for n in names) == 15, sorted(names)


def test_shaping_on_both_ends_with_the_rate_in_bits():
    spec = load(EXAMPLE)
    cmds = plan.up_commands(spec)
    assert not plan.needs_netem(spec)
    for h in spec.hosts:
        ns = plan.namespace_name(spec, h)
        ends = [
            tc_of(cmds, netns=ns, device="eth0"),  # upload
            tc_of(cmds, netns=None, device=plan.switch_link_name(spec, h)),  # download
        ]
        for end in ends:
            assert len(end) == 1, end
            words = end[0]
            assert words[words.index("dev") + 2 :][:2] == ["root", "tbf"]
            assert words[words.index("rate") + 1] == f"{h.link.rate_bps}bit"
    rates = {c[c.index("rate") + 1] for c in cmds if c[0] == "tc"}
    assert rates == {"1000000000bit", "10000000000bit"}


def test_an_unshaped_host_gets_no_tc_command():
    spec = parse(
        {
            "hosts": [
                {"name": "a", "ranks": 1, "bandwidth": "1gbit"},
                {"name": "free", "ranks": 1},
            ]
        }
    )
    cmds = plan.up_commands(spec)
    tcs = [c for c in cmds if c[0] == "tc"]
    assert len(tcs) == 2
    assert not [c for c in tcs if "hx-free" in c]
    assert plan.shaping_commands(spec.hosts[1].link, "eth0", "hx-free") == []


def test_latency_is_netem_with_tbf_under_it():
    spec = parse(LONGEST)
    assert plan.needs_netem(spec)
    cmds = plan.up_commands(spec)
    for netns, device in [
        ("abcdef-abcdefgh", "eth0"),
        (None, "abcdef-abcdefgh"),
    ]:
        netem, tbf = tc_of(cmds, netns=netns, device=device)
        after = netem[netem.index("dev") + 2 :]
        assert after[:6] == ["root", "handle", "1:", "netem", "delay", "1.5ms"]
        after = tbf[tbf.index("dev") + 2 :]
        assert after[:5] == ["parent", "1:1", "handle", "10:", "tbf"]
        assert tbf[tbf.index("rate") + 1] == "1000000000bit"
    for netns, device in [
        ("abcdef-zyxwvuts", "eth0"),
        (None, "abcdef-zyxwvuts"),
    ]:
        (netem,) = tc_of(cmds, netns=netns, device=device)
        assert "netem" in netem and "1.5ms" in netem and "tbf" not in netem


@pytest.mark.parametrize("description", [LONGEST, None])
def test_down_removes_everything_up_makes(description):
    spec = load(EXAMPLE) if description is None else parse(description)
    made = created(plan.up_commands(spec), "add")
    down = plan.down_commands(spec)
    removed = created(down, "delete")
    assert made == removed
    # nothing else: every down command is one of those deletions
    assert len(down) == len(removed["namespaces"]) + len(removed["links"])


def test_mpi_hostfile_and_etc_hosts():
    spec = load(EXAMPLE)
    assert plan.mpi_hostfile(spec) == (
        "10.213.77.1 slots=2\n10.213.77.2 slots=2\n10.213.77.3 slots=1\n"
    )
    names = {}
    for line in plan.etc_hosts(spec).splitlines():
        address, *aliases = line.split()
        for alias in aliases:
            names.setdefault(alias, address)
    assert names["localhost"] == "127.0.0.1"
    assert {h.name: names[h.name] for h in spec.hosts} == {
        "a": "10.213.77.1",
        "b": "10.213.77.2",
        "ps": "10.213.77.3",
    }


def has(words: list[str], *run: str) -> bool:
    """Whether ``run`` appears in ``words`` as consecutive words."""
    n = len(run)
    return any(words[i : i + n] == list(run) for i in range(len(words) - n + 1))


def test_mpiexec_args_use_the_state_folder_and_the_subnet(tmp_path):
    spec = load(EXAMPLE)
    args = plan.mpiexec_args(spec, tmp_path, "/opt/ompi")
    assert has(args, "--prefix", "/opt/ompi")
    assert has(args, "--hostfile", str(tmp_path / plan.HOSTFILE_FILE))
    assert has(args, "--prtemca", "plm_ssh_agent", str(tmp_path / plan.AGENT_FILE))
    assert has(args, "--prtemca", "oob_tcp_if_include", "10.213.77.0/24")
    assert has(args, "--mca", "btl_tcp_if_include", "10.213.77.0/24")
    assert has(args, "--mca", "pml", "ob1")
    assert has(args, "--mca", "btl", "self,sm,tcp")
    assert has(args, "--map-by", "slot")
    assert "--oversubscribe" not in args


BESIDE = host('"a"', "3", "servers = 1") + host('"b"', "3", "servers = 1")


def test_server_slots_come_after_every_hosts_worker_slots(tmp_path):
    spec = load(write(tmp_path, BESIDE))
    assert spec.total_ranks == 6 and spec.total_servers == 2
    # workers 0-3 fill a then b; the servers (the last ranks) one per host
    assert [h.name for h in spec.rank_order()] == ["a", "a", "b", "b", "a", "b"]
    assert spec.host_of_rank(4).name == "a" and spec.host_of_rank(5).name == "b"
    with pytest.raises(ValueError, match="rank 6 out of range"):
        spec.host_of_rank(6)
    with pytest.raises(ValueError, match="rank -1 out of range"):
        spec.host_of_rank(-1)
    assert plan.mpi_rankfile(spec) == (
        "rank 0=10.213.77.1 slot=0\nrank 1=10.213.77.1 slot=1\n"
        "rank 2=10.213.77.2 slot=0\nrank 3=10.213.77.2 slot=1\n"
        "rank 4=10.213.77.1 slot=2\nrank 5=10.213.77.2 slot=2\n"
    )
    args = plan.mpiexec_args(spec, tmp_path, "/opt/ompi")
    assert has(args, "--map-by", f"rankfile:file={tmp_path / plan.RANKFILE_FILE}")
    assert spec.to_dict()["hosts"][0]["servers"] == 1
    # without server slots the rankfile says what --map-by slot does
    plain = load(EXAMPLE)
    assert [h.name for h in plain.rank_order()] == ["a", "a", "b", "b", "ps"]
    assert plan.mpi_rankfile(plain).splitlines()[-1] == "rank 4=10.213.77.3 slot=0"


# --------------------------------------------------------------------- agent
@pytest.fixture
def agent(tmp_path):
    """The example's launch agent in a state folder whose path has a space, and
    a fake ``ip`` (prints its argv as JSON) first on ``PATH``; returns the
    state folder and a function that runs the agent."""
    state = tmp_path / "state dir"
    state.mkdir()
    spec = load(EXAMPLE)
    path = executable(state / plan.AGENT_FILE, plan.agent_script(spec, state))
    fakes = tmp_path / "bin"
    fakes.mkdir()
    echo_argv = (
        f"#!{sys.executable}\nimport json, sys\nprint(json.dumps(sys.argv[1:]))\n"
    )
    executable(fakes / "ip", echo_argv)

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [str(path), *args],
            env={"PATH": f"{fakes}:/usr/bin:/bin"},
            capture_output=True,
            text=True,
            timeout=30,
        )

    return state, run


@pytest.mark.parametrize(
    "given,name",
    [("10.213.77.2", "b"), ("b", "b"), ("10.213.77.3", "ps"), ("ps", "ps")],
)
def test_the_agent_runs_the_command_in_the_hosts_namespace(agent, given, name):
    state, run = agent
    done = run(given, "orted", "--arg", "two words")
    assert done.returncode == 0, done.stderr
    words = json.loads(done.stdout)
    assert words[:7] == [
        "netns",
        "exec",
        f"hx-{name}",
        "unshare",
        "--uts",
        "/bin/sh",
        "-c",
    ]
    assert words[8:] == [
        "agent",
        name,
        str(state / plan.HOSTS_FILE),
        "orted",
        "--arg",
        "two words",
    ]


def test_the_agent_refuses_an_unknown_host(agent):
    _, run = agent
    done = run("10.213.77.9", "orted")
    assert done.returncode == 255
    assert done.stdout == ""  # ip was not called
    assert "no host '10.213.77.9'" in done.stderr and "hx" in done.stderr


def test_the_agents_inner_command_names_the_host_then_runs_the_command(agent, tmp_path):
    """The part run inside the namespace, with fake ``hostname`` and ``mount``:
    the host name and the hosts file are set first, then the command words run
    as one shell command line (as ssh runs them); a failed mount stops there."""
    state, run = agent
    inner = json.loads(run("a", "x").stdout)[7]
    log = tmp_path / "log"
    fakes = tmp_path / "inner-bin"
    fakes.mkdir()
    for tool in ("hostname", "mount"):
        executable(
            fakes / tool, f'#!/bin/sh\necho "{tool} $*" >> {shlex.quote(str(log))}\n'
        )
    hosts_file = str(state / plan.HOSTS_FILE)

    def inner_run():
        return subprocess.run(
            [
                "/bin/sh",
                "-c",
                inner,
                "agent",
                "a",
                hosts_file,
                "echo",
                "hello",
                "world",
            ],
            env={"PATH": f"{fakes}:/usr/bin:/bin"},
            capture_output=True,
            text=True,
            timeout=30,
        )

    done = inner_run()
    assert done.returncode == 0, done.stderr
    assert done.stdout == "hello world\n"
    assert log.read_text().splitlines() == [
        "hostname a",
        f"mount --bind {hosts_file} /etc/hosts",
    ]
    executable(fakes / "mount", "#!/bin/sh\nexit 32\n")
    done = inner_run()
    assert done.returncode == 32 and done.stdout == ""


# ------------------------------------------------------------------ launcher
def probes(
    version: str = OPEN_MPI_5,
    *,
    state: Path | Exception = Path("/state/hx"),
    euid: int = 1000,
    srun: bool = False,
) -> launcher.Probes:
    on_path = {"mpiexec": MPIEXEC, **({"srun": "/usr/bin/srun"} if srun else {})}

    def cluster_state(spec):
        if isinstance(state, Exception):
            raise state
        return state

    return launcher.Probes(
        which=on_path.get,
        executable=lambda path: path in on_path.values(),
        srun_mpi_list=lambda: "\tpmi2\n\tpmix\n",
        mpiexec_version=lambda path: version,
        euid=euid,
        cluster_state=cluster_state,
    )


def plan_cluster(
    args: list[str], env: dict[str, str] | None = None, **kw
) -> launcher.Plan:
    env = env or {}
    options = launcher.parse_options(["--cluster", str(EXAMPLE), *args], env)
    return launcher.plan_launch(options, env, probes(**kw))


@pytest.mark.parametrize("euid", [1000, 0])
def test_cluster_plans_mpiexec_over_all_the_hosts_ranks(euid):
    got = plan_cluster(["--", "python", "x.py"], euid=euid)
    state = Path("/state/hx")
    assert got.argv == (
        MPIEXEC,
        "-n",
        "5",
        "--bind-to",
        "none",
        *plan.mpiexec_args(load(EXAMPLE), state, "/opt/ompi"),
        "python",
        "x.py",
    )
    assert "--oversubscribe" not in got.argv
    assert has(list(got.argv), "--hostfile", str(state / plan.HOSTFILE_FILE))
    consent = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    # no oversubscription policy: the hosts' slots are the limit; a server's
    # part crosses the TCP links eagerly (runner.tcp_eager_env)
    eager = {"OMPI_MCA_btl_tcp_eager_limit": str(4 * 2**20 + 2**16)}
    assert got.env == {**(consent if euid == 0 else {}), **eager}


def test_cluster_keeps_a_smaller_rank_count():
    got = plan_cluster(["-n", "3", "a.out"])
    assert got.argv[:3] == (MPIEXEC, "-n", "3")


@pytest.mark.parametrize(
    "args,env,kw,message",
    [
        (["-n", "99"], {}, {}, "-n 99: the hosts of"),
        (["-n", "6"], {}, {}, "hold 5 ranks (a: 2, b: 2, ps: 1)"),
        ([], {}, {"version": OPEN_MPI_4}, "needs Open MPI 5 or later"),
        ([], {}, {"version": HYDRA}, f"{MPIEXEC} is mpich"),
        (
            [],
            {"SLURM_JOB_ID": "5", "SLURM_NTASKS": "2"},
            {},
            "inside a Slurm allocation",
        ),
        (  # srun on PATH: "auto" would pick srun and drop the cluster
            [],
            {"SLURM_JOB_ID": "5", "SLURM_NTASKS": "2"},
            {"srun": True},
            "inside a Slurm allocation",
        ),
        (
            [],
            {"SLURM_JOB_ID": "5", "SLURM_HET_SIZE": "2"},
            {"srun": True},
            "inside a Slurm allocation",
        ),
        (
            [],
            {},
            {"state": ClusterError("cluster 'hx' is not up (no /x): run it")},
            "cluster 'hx' is not up (no /x): run it",
        ),
    ],
)
def test_cluster_refusals(args, env, kw, message):
    with pytest.raises(launcher.LaunchError) as refused:
        plan_cluster([*args, "a.out"], env, **kw)
    assert message in str(refused.value)
    assert refused.value.status == 2


def test_cluster_with_a_hostfile_is_refused(tmp_path):
    hosts = write(tmp_path, "a slots=2\n", "hosts")
    with pytest.raises(launcher.LaunchError, match="does not go with --hostfile"):
        plan_cluster(["--hostfile", str(hosts), "a.out"])


def test_cluster_with_launcher_srun_is_refused_naming_the_cluster():
    with pytest.raises(launcher.LaunchError, match=r"--cluster .* --launcher srun"):
        plan_cluster(["--launcher", "srun", "a.out"])


def test_an_unknown_host_has_no_address():
    spec = load(EXAMPLE)
    with pytest.raises(ValueError, match="no host 'zz' \\(hosts: a, b, ps\\)"):
        spec.address("zz")


def test_a_bad_cluster_file_is_a_launch_error_naming_it(tmp_path):
    bad = write(tmp_path, host(ranks="0"))
    for path in (bad, tmp_path / "missing.toml"):
        with pytest.raises(launcher.LaunchError) as refused:
            launcher.parse_options(["--cluster", str(path), "a.out"], {})
        assert str(path) in str(refused.value)


def write_state(folder: Path, description: dict) -> Path:
    folder.mkdir(parents=True)
    (folder / plan.STATE_FILE).write_text(json.dumps(description))
    return folder


def test_dry_run_prints_the_cluster_command(tmp_path, monkeypatch, capsys):
    fakes = tmp_path / "bin"
    fakes.mkdir()
    mpiexec = executable(fakes / "mpiexec", f"#!/bin/sh\necho '{OPEN_MPI_5}'\n")
    for name in (
        "SLURM_JOB_ID",
        "SLURM_HET_SIZE",
        "HYBRIDAGG_MPIEXEC",
        "HYBRIDAGG_LAUNCHER",
    ):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PATH", str(fakes))
    monkeypatch.setenv("HYBRIDAGG_CLUSTER_DIR", str(tmp_path / "clusters"))
    args = ["--dry-run", "--cluster", str(EXAMPLE), "--", "python", "x.py"]

    assert launcher.main(args) == 2
    err = capsys.readouterr().err
    assert "is not up" in err and f"hybridagg cluster up {EXAMPLE}" in err

    state = write_state(tmp_path / "clusters" / "hx", load(EXAMPLE).to_dict())
    assert launcher.main(args) == 0
    words = shlex.split(capsys.readouterr().out)
    at = words.index(str(mpiexec))
    assert words[at : at + 3] == [str(mpiexec), "-n", "5"]
    assert has(words, "--hostfile", str(state / plan.HOSTFILE_FILE))
    assert has(words, "--prefix", str(tmp_path))
    assert words[-2:] == ["python", "x.py"]


# --------------------------------------------------------------------- state
def test_read_state_tells_whether_this_cluster_is_up(tmp_path):
    spec = load(EXAMPLE)
    environ = {"HYBRIDAGG_CLUSTER_DIR": str(tmp_path)}
    with pytest.raises(ClusterError) as refused:
        read_state(spec, environ)
    assert "cluster 'hx' is not up" in str(refused.value)
    assert f"`hybridagg cluster up {EXAMPLE}`" in str(refused.value)

    other = spec.to_dict()
    other["hosts"][0]["ranks"] = 3
    folder = write_state(tmp_path / "hx", other)
    with pytest.raises(ClusterError, match="up with another description than"):
        read_state(spec, environ)

    (folder / plan.STATE_FILE).write_text(json.dumps(spec.to_dict()))
    assert read_state(spec, environ) == tmp_path / "hx"

    (folder / plan.STATE_FILE).write_text("{not json")
    with pytest.raises(ClusterError, match="cannot read"):
        read_state(spec, environ)


def test_cluster_check_prints_the_table(capsys):
    assert cli.main(["cluster", "check", str(EXAMPLE)]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()]
    assert rows[0][:4] == ["host", "address", "ranks", "link"]
    assert rows[1:] == [
        ["a", "10.213.77.1", "2", "1", "Gbit/s", "-", "-"],
        ["b", "10.213.77.2", "2", "1", "Gbit/s", "-", "-"],
        ["ps", "10.213.77.3", "1", "10", "Gbit/s", "-", "-"],
    ]


def test_cluster_check_of_a_bad_file_is_one_message(tmp_path, capsys):
    bad = write(tmp_path, host('"A"'))
    assert cli.main(["cluster", "check", str(bad)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        f"hybridagg cluster: {bad}: hosts[0]"
    )
