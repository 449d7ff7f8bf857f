"""What bringing an emulated cluster up and down means, as data (pure).

Each host is a network namespace joined to the switch (a bridge in the root
namespace) by a veth pair: ``eth0`` inside the host, ``<cluster>-<host>`` on
the switch. A host's link is shaped on both ends: its upload is ``eth0``'s
egress, its download the switch side's egress, so every byte between two
hosts passes two shapers, each at its host's rate. Latency, when asked, is a
``netem`` delay on both ends (``tbf`` under it for the rate).

Open MPI's launcher reaches the hosts through a launch agent (its "ssh"):
:func:`agent_script` runs each daemon inside its host's namespace with its
own UTS namespace, so the host name differs per host. Open MPI decides which
ranks share a node from the host name: with one kernel host name for every
emulated host, ranks on two hosts believed they shared a node, the
node-local communicator (``MPI_COMM_TYPE_SHARED``) differed between ranks,
and the hierarchical collectives (``coll/han``) deadlocked in the first
``MPI_Barrier``. A private ``/etc/hosts`` (bind-mounted inside the daemon's
mount namespace) lets the ranks resolve each other's names, as
``torch.distributed``'s rendezvous does.

Nothing here runs anything; :mod:`hybridagg.cluster.netns` does.
"""

from __future__ import annotations

import shlex
from pathlib import Path

from .spec import ClusterSpec, Host, Link

__all__ = [
    "AGENT_FILE",
    "HOSTFILE_FILE",
    "HOSTS_FILE",
    "RANKFILE_FILE",
    "STATE_FILE",
    "agent_script",
    "bridge_name",
    "down_commands",
    "etc_hosts",
    "mpi_hostfile",
    "mpiexec_args",
    "namespace_name",
    "needs_netem",
    "shaping_commands",
    "switch_link_name",
    "up_commands",
]

STATE_FILE = "cluster.json"
AGENT_FILE = "agent.sh"
HOSTS_FILE = "hosts"
HOSTFILE_FILE = "hostfile"
RANKFILE_FILE = "rankfile"

# A token bucket lets a burst of its size through at once, so a message
# smaller than the bucket, sent after an idle moment, would cross faster than
# the link's rate. The bucket holds the least that keeps TCP at full rate
# (four of the 64 KiB packets veth hands the shaper; GSO, which makes them
# that large, stays on: without it the two cores cannot move 1 Gbit/s), and
# a second bucket of one such packet (tbf's peakrate/mtu) caps the burst at
# 5% over the rate. The queue holds 30 ms at the rate, at least 4 MiB (with
# 1 MiB, a 16 MiB exchange at 1 Gbit/s lost packets and half its rate).
_BURST = 256 * 1024
_PACKET = 70000  # largest packet: 64 KiB of GSO data and its headers
_PEAK_OVER = 1.05
_MIN_QUEUE = 4 << 20
_QUEUE_SECONDS = 0.03


def namespace_name(spec: ClusterSpec, host: Host | str) -> str:
    """The network namespace of a host: ``<cluster>-<host>``."""
    return f"{spec.name}-{host if isinstance(host, str) else host.name}"


def switch_link_name(spec: ClusterSpec, host: Host | str) -> str:
    """The switch side of a host's link (root namespace): ``<cluster>-<host>``."""
    return f"{spec.name}-{host if isinstance(host, str) else host.name}"


def bridge_name(spec: ClusterSpec) -> str:
    """The switch: ``<cluster>sw`` (no dash, so no host's link can take it)."""
    return f"{spec.name}sw"


def needs_netem(spec: ClusterSpec) -> bool:
    """Whether some link asks for latency (the kernel's ``netem`` qdisc)."""
    return any(h.link.latency_ms > 0 for h in spec.hosts)


def shaping_commands(link: Link, device: str, netns: str | None) -> list[list[str]]:
    """``tc`` commands that shape one end of a link (none for an unshaped one).

    Args:
        link: The link.
        device: The interface whose egress is shaped.
        netns: The namespace holding it (``None``: the root namespace).
    """
    tc = ["tc"] + (["-n", netns] if netns else [])
    head = tc + ["qdisc", "add", "dev", device]
    tbf = []
    if link.rate_bps is not None:
        limit = max(_MIN_QUEUE, int(link.rate_bps / 8 * _QUEUE_SECONDS))
        peak = int(link.rate_bps * _PEAK_OVER)
        tbf = [
            "tbf", "rate", f"{link.rate_bps}bit", "burst", str(_BURST),
            "peakrate", f"{peak}bit", "mtu", str(_PACKET), "limit", str(limit),
        ]  # fmt: skip
    if link.latency_ms <= 0:
        return [head + ["root"] + tbf] if tbf else []
    delay = ["netem", "delay", f"{link.latency_ms:g}ms", "limit", "100000"]
    commands = [head + ["root", "handle", "1:"] + delay]
    if tbf:
        commands.append(head + ["parent", "1:1", "handle", "10:"] + tbf)
    return commands


def up_commands(spec: ClusterSpec) -> list[list[str]]:
    """The ``ip``/``tc`` commands that build the cluster, in order."""
    bridge = bridge_name(spec)
    prefix = spec.subnet.prefixlen
    cmds = [
        ["ip", "link", "add", bridge, "type", "bridge"],
        ["ip", "addr", "add", f"{spec.switch_address}/{prefix}", "dev", bridge],
        ["ip", "link", "set", bridge, "up"],
    ]
    for host in spec.hosts:
        ns, link = namespace_name(spec, host), switch_link_name(spec, host)
        cmds += [
            ["ip", "netns", "add", ns],
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
            ],
            ["ip", "link", "set", link, "master", bridge, "up"],
            [
                "ip",
                "-n",
                ns,
                "addr",
                "add",
                f"{spec.address(host)}/{prefix}",
                "dev",
                "eth0",
            ],
            ["ip", "-n", ns, "link", "set", "eth0", "up"],
            ["ip", "-n", ns, "link", "set", "lo", "up"],
        ]
        cmds += shaping_commands(host.link, "eth0", ns)  # upload
        cmds += shaping_commands(host.link, link, None)  # download
    return cmds


def down_commands(spec: ClusterSpec) -> list[list[str]]:
    """The commands that remove everything :func:`up_commands` makes.

    Deleting a namespace deletes its ``eth0`` and with it the veth pair; the
    switch-side link is deleted too in case the namespace was already gone.
    Each may fail harmlessly (the thing is not there).
    """
    cmds = []
    for host in spec.hosts:
        cmds.append(["ip", "netns", "delete", namespace_name(spec, host)])
        cmds.append(["ip", "link", "delete", switch_link_name(spec, host)])
    cmds.append(["ip", "link", "delete", bridge_name(spec)])
    return cmds


def etc_hosts(spec: ClusterSpec) -> str:
    """The ``/etc/hosts`` every host sees: localhost and every host's name."""
    lines = ["127.0.0.1\tlocalhost", "::1\tlocalhost ip6-localhost ip6-loopback"]
    lines += [f"{spec.address(h)}\t{h.name}" for h in spec.hosts]
    return "\n".join(lines) + "\n"


def mpi_hostfile(spec: ClusterSpec) -> str:
    """Open MPI's hostfile: each host by address (no name lookup in the root
    namespace), its ranks as slots."""
    return "".join(f"{spec.address(h)} slots={h.ranks}\n" for h in spec.hosts)


def mpi_rankfile(spec: ClusterSpec) -> str:
    """Open MPI's rankfile: the host of every world rank (:meth:`ClusterSpec.rank_order`).

    Used when a host has server slots, which ``--map-by slot`` cannot place
    (it fills each host before the next). Each rank of a host gets its own
    slot number; processes are not bound (``--bind-to none``), so the number
    only keeps the entries distinct.
    """
    lines, used = [], {}
    for rank, host in enumerate(spec.rank_order()):
        slot = used.get(host.name, 0)
        used[host.name] = slot + 1
        lines.append(f"rank {rank}={spec.address(host)} slot={slot}\n")
    return "".join(lines)


def agent_script(spec: ClusterSpec, state_dir: Path) -> str:
    """The launch agent Open MPI calls instead of ssh: ``AGENT HOST COMMAND...``.

    It runs COMMAND (a shell command line, as ssh would) inside HOST's
    network namespace, in a UTS namespace named after the host and with
    :func:`etc_hosts` as ``/etc/hosts``; the caller's environment passes
    through, as it does to a local process.
    """
    hosts_file = shlex.quote(str(state_dir / HOSTS_FILE))
    cases = "\n".join(
        f"    {spec.address(h)}|{h.name}) ns={shlex.quote(namespace_name(spec, h))} "
        f"name={shlex.quote(h.name)} ;;"
        for h in spec.hosts
    )
    inner = 'hostname "$1" && mount --bind "$2" /etc/hosts && shift 2 && exec /bin/sh -c "$*"'
    return f"""#!/bin/sh
# Launch agent of the emulated cluster {spec.name} (written by `hybridagg cluster up`).
# Open MPI calls it as its ssh: AGENT HOST COMMAND...
host=$1
shift
case $host in
{cases}
    *) echo "hybridagg cluster {spec.name}: no host '$host'" >&2; exit 255 ;;
esac
exec ip netns exec "$ns" unshare --uts /bin/sh -c '{inner}' agent "$name" {hosts_file} "$@"
"""


def mpiexec_args(spec: ClusterSpec, state_dir: Path, prefix: str) -> list[str]:
    """Open MPI 5 options that place a job's ranks on the cluster's hosts.

    Ranks fill the hosts in file order (``--map-by slot`` over a hostfile of
    slots), or, when hosts have server slots, go where the rankfile says
    (:func:`mpi_rankfile`). The daemons are reached through the launch agent and over the
    switch's subnet. Inside a host the ranks talk through shared memory
    (``btl/sm``), between hosts through TCP over the host links
    (``btl/tcp``, the subnet only); ``pml/ob1`` is the engine that uses those
    transports (another could move bytes past the shaped links), and the
    one-sided component that needs UCX's engine is left out (it would print
    an error for every shared-memory window).

    Args:
        spec: The cluster.
        state_dir: Its state folder (agent and hostfile).
        prefix: The Open MPI installation (``--prefix``: the daemons start
            from it whatever ``PATH`` holds).
    """
    subnet = str(spec.subnet)
    mapping = (
        f"rankfile:file={state_dir / RANKFILE_FILE}" if spec.total_servers else "slot"
    )
    return [
        "--prefix", prefix,
        "--hostfile", str(state_dir / HOSTFILE_FILE),
        "--map-by", mapping,
        "--prtemca", "plm_ssh_agent", str(state_dir / AGENT_FILE),
        "--prtemca", "oob_tcp_if_include", subnet,
        "--mca", "pml", "ob1",
        "--mca", "osc", "^ucx",
        "--mca", "btl", "self,sm,tcp",
        "--mca", "btl_tcp_if_include", subnet,
    ]  # fmt: skip
