"""The description of an emulated cluster: hosts, ranks per host, each host's link.

A cluster file is TOML (read with the standard library's ``tomllib``)::

    name = "hx"                  # prefix of every namespace and link it makes
    subnet = "10.213.77.0/24"    # private; hosts get .1, .2, ...; the switch the last
    bandwidth = "1gbit"          # default link of every host (absent: unshaped)
    latency_ms = 0               # default one-way latency of a host's link

    [[hosts]]
    name = "a"
    ranks = 2

    [[hosts]]
    name = "ps"
    ranks = 1
    bandwidth = "10gbit"         # a faster link for the servers' host

    # or: a server beside the workers of each host (Kim et al.'s layout)
    [[hosts]]
    name = "c"
    ranks = 3
    servers = 1                  # one of its 3 ranks is a server slot

Every host hangs on one switch by its own link; a byte from host ``a`` to
host ``b`` leaves through ``a``'s link and arrives through ``b``'s, so it
moves at the slower of the two rates and takes both latencies. Ranks fill
the hosts in file order; hybridagg's servers are the last ranks, so the
servers' host comes last. A host may instead hold ``servers`` of its ranks
as server slots: then world ranks fill every host's other slots (the worker
slots) first, in file order, and the ranks after them fill the server
slots, in file order; a job whose workers fill the worker slots exactly has
its servers (its last ranks) beside the workers (:meth:`ClusterSpec.rank_order`).

Everything here is pure: :func:`load` and :func:`parse` check a description
without root, MPI or the kernel, and every problem is a ``ValueError``
naming the file and the entry.
"""

from __future__ import annotations

import ipaddress
import math
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

__all__ = ["ClusterSpec", "Host", "Link", "load", "parse", "parse_rate"]

DEFAULT_SUBNET = "10.213.77.0/24"

# Kernel interface names hold 15 characters; a host's link on the switch side
# is "<cluster>-<host>", so the two names together stay within that.
_CLUSTER_NAME = re.compile(r"[a-z][a-z0-9]{0,5}")
_HOST_NAME = re.compile(r"[a-z][a-z0-9]{0,7}")
_RATE = re.compile(r"([0-9]+(?:\.[0-9]+)?)\s*([kmgt]?)bit", re.IGNORECASE)
_RATE_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
# Python's is_private also holds for 0.0.0.0/8, 240.0.0.0/4 and the
# documentation ranges, and its list differs between Python releases; the
# three RFC 1918 networks are the private ones everywhere.
_PRIVATE = tuple(
    ipaddress.IPv4Network(n) for n in ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16")
)
_TOP_KEYS = {"name", "subnet", "bandwidth", "latency_ms", "hosts"}
_HOST_KEYS = {"name", "ranks", "servers", "bandwidth", "latency_ms"}


@dataclass(frozen=True)
class Link:
    """A host's link to the switch, shaped by the kernel in both directions.

    Attributes:
        rate_bps: Bits per second each way (``None``: not shaped, the
            kernel's virtual link as fast as the CPU moves bytes).
        latency_ms: One-way delay added in each direction, in milliseconds.
    """

    rate_bps: int | None = None
    latency_ms: float = 0.0

    @property
    def rate_bytes(self) -> float | None:
        """Bytes per second each way (``None``: not shaped)."""
        return None if self.rate_bps is None else self.rate_bps / 8

    def describe(self) -> str:
        """``1 Gbit/s, 0.5 ms`` (what ``hybridagg cluster status`` prints)."""
        rate = "unshaped" if self.rate_bps is None else _human_rate(self.rate_bps)
        return f"{rate}, {self.latency_ms:g} ms" if self.latency_ms else rate


@dataclass(frozen=True)
class Host:
    """One emulated host.

    Attributes:
        name: Its host name (what its ranks' ``MPI_Get_processor_name`` says).
        ranks: MPI ranks it runs (its slots).
        link: Its link to the switch.
        servers: How many of its slots are server slots (filled after every
            host's worker slots).
    """

    name: str
    ranks: int
    link: Link
    servers: int = 0


@dataclass(frozen=True)
class ClusterSpec:
    """An emulated cluster, checked.

    Attributes:
        name: Prefix of the namespaces (``<name>-<host>``), the host links
            (``<name>-<host>`` on the switch side) and the switch (a bridge,
            ``<name>sw``).
        subnet: The private IPv4 network of the hosts and the switch.
        hosts: The hosts, in rank order.
        source: The file it came from (for messages).
    """

    name: str
    subnet: ipaddress.IPv4Network
    hosts: tuple[Host, ...]
    source: str = "<cluster>"

    @property
    def total_ranks(self) -> int:
        """Ranks of all hosts together."""
        return sum(h.ranks for h in self.hosts)

    def address(self, host: Host | str) -> str:
        """A host's address: the subnet's first, second, ... in file order."""
        name = host if isinstance(host, str) else host.name
        names = [h.name for h in self.hosts]
        if name not in names:
            raise ValueError(
                f"{self.source}: no host {name!r} (hosts: {', '.join(names)})"
            )
        index = names.index(name)
        return str(self.subnet.network_address + 1 + index)

    @property
    def switch_address(self) -> str:
        """The switch's (bridge's) address: the subnet's last usable one."""
        return str(self.subnet.broadcast_address - 1)

    @property
    def total_servers(self) -> int:
        """Server slots of all hosts together."""
        return sum(h.servers for h in self.hosts)

    def rank_order(self) -> list[Host]:
        """The host of each world rank ``0 .. total_ranks - 1``.

        Worker slots (each host's ``ranks - servers``) first, in file order,
        then server slots, in file order; without server slots, ranks simply
        fill the hosts in file order.
        """
        workers = [h for h in self.hosts for _ in range(h.ranks - h.servers)]
        return workers + [h for h in self.hosts for _ in range(h.servers)]

    def host_of_rank(self, rank: int) -> Host:
        """The host of a world rank (see :meth:`rank_order`).

        Raises:
            ValueError: ``rank`` is negative or not below :attr:`total_ranks`.
        """
        if not 0 <= rank < self.total_ranks:
            raise ValueError(
                f"rank {rank} out of range: the cluster has {self.total_ranks} ranks"
            )
        return self.rank_order()[rank]

    def to_dict(self) -> dict:
        """The description as plain data (the state file of a running cluster)."""
        return {
            "name": self.name,
            "subnet": str(self.subnet),
            "hosts": [
                {
                    "name": h.name,
                    "ranks": h.ranks,
                    "rate_bps": h.link.rate_bps,
                    "latency_ms": h.link.latency_ms,
                    # only when set: a cluster brought up before hosts had
                    # server slots still reads as the same description
                    **({"servers": h.servers} if h.servers else {}),
                }
                for h in self.hosts
            ],
        }


def _human_rate(bps: int) -> str:
    for unit, scale in (("Tbit/s", 10**12), ("Gbit/s", 10**9), ("Mbit/s", 10**6)):
        if bps >= scale:
            return f"{bps / scale:g} {unit}"
    return f"{bps / 1e3:g} kbit/s"


def parse_rate(text: object, where: str = "bandwidth") -> int:
    """Bits per second from ``"1gbit"``, ``"100mbit"``, ``"2.5gbit"`` (tc's decimal units).

    Raises:
        ValueError: Not a positive rate in bits (``"1gbps"`` is refused: tc
            reads ``bps`` as bytes per second).
    """
    if not isinstance(text, str):
        raise ValueError(f'{where} must be a string such as "1gbit", got {text!r}')
    m = _RATE.fullmatch(text.strip())
    if m is None:
        raise ValueError(
            f'{where} must be a rate in bits such as "100mbit", "1gbit" or '
            f'"10gbit", got {text!r}'
        )
    bps = round(float(m.group(1)) * _RATE_UNITS[m.group(2).lower()])
    if bps < 8000:
        raise ValueError(f"{where} must be at least 8kbit, got {text!r}")
    return bps


def _latency(value: object, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{where} must be a number of milliseconds, got {value!r}")
    value = float(value)
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{where} must be finite and >= 0, got {value!r}")
    return value


def _link(entry: Mapping, default: Link, where: str) -> Link:
    rate = default.rate_bps
    if "bandwidth" in entry:
        rate = parse_rate(entry["bandwidth"], f"{where}: bandwidth")
    latency = default.latency_ms
    if "latency_ms" in entry:
        latency = _latency(entry["latency_ms"], f"{where}: latency_ms")
    return Link(rate_bps=rate, latency_ms=latency)


def parse(data: Mapping, source: str = "<cluster>") -> ClusterSpec:
    """Check a cluster description given as a mapping (a parsed TOML file).

    Args:
        data: The description (see the module's docstring).
        source: Where it came from, for messages.

    Returns:
        The checked description.

    Raises:
        ValueError: Anything wrong, named with ``source`` and the entry.
    """
    unknown = sorted(set(data) - _TOP_KEYS)
    if unknown:
        raise ValueError(
            f"{source}: unknown key {unknown[0]!r} (known: {', '.join(sorted(_TOP_KEYS))})"
        )
    name = data.get("name", "hx")
    if not isinstance(name, str) or not _CLUSTER_NAME.fullmatch(name):
        raise ValueError(
            f"{source}: name must be 1-6 lower-case letters or digits starting "
            f"with a letter (it prefixes kernel interface names), got {name!r}"
        )
    subnet_text = data.get("subnet", DEFAULT_SUBNET)
    try:
        subnet = ipaddress.IPv4Network(subnet_text)
    except (ipaddress.AddressValueError, ipaddress.NetmaskValueError, ValueError):
        raise ValueError(
            f"{source}: subnet must be an IPv4 network such as {DEFAULT_SUBNET!r}, "
            f"got {subnet_text!r}"
        ) from None
    if not any(subnet.subnet_of(private) for private in _PRIVATE):
        raise ValueError(
            f"{source}: subnet {subnet} is not a private network (use one within "
            f"{', '.join(map(str, _PRIVATE))})"
        )
    default = _link(data, Link(), source)
    hosts_data = data.get("hosts")
    if not isinstance(hosts_data, list) or not hosts_data:
        raise ValueError(f"{source}: needs at least one [[hosts]] entry")
    room = subnet.num_addresses - 3  # network, broadcast, the switch
    if len(hosts_data) > room:
        raise ValueError(
            f"{source}: {len(hosts_data)} hosts do not fit subnet {subnet} "
            f"(room for {max(room, 0)})"
        )
    hosts: list[Host] = []
    for i, entry in enumerate(hosts_data):
        where = f"{source}: hosts[{i}]"
        if not isinstance(entry, Mapping):
            raise ValueError(f"{where} must be a table with name and ranks")
        unknown = sorted(set(entry) - _HOST_KEYS)
        if unknown:
            raise ValueError(
                f"{where}: unknown key {unknown[0]!r} "
                f"(known: {', '.join(sorted(_HOST_KEYS))})"
            )
        host_name = entry.get("name")
        if not isinstance(host_name, str) or not _HOST_NAME.fullmatch(host_name):
            raise ValueError(
                f"{where}: name must be 1-8 lower-case letters or digits starting "
                f"with a letter, got {host_name!r}"
            )
        if host_name in {h.name for h in hosts}:
            raise ValueError(f"{where}: host name {host_name!r} appears twice")
        ranks = entry.get("ranks")
        if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 1:
            raise ValueError(
                f"{where} ({host_name}): ranks must be an integer >= 1, got {ranks!r}"
            )
        servers = entry.get("servers", 0)
        if (
            isinstance(servers, bool)
            or not isinstance(servers, int)
            or not 0 <= servers <= ranks
        ):
            raise ValueError(
                f"{where} ({host_name}): servers must be an integer from 0 to its "
                f"ranks ({ranks}), got {servers!r}"
            )
        hosts.append(
            Host(
                host_name,
                ranks,
                _link(entry, default, f"{where} ({host_name})"),
                servers,
            )
        )
    return ClusterSpec(name=name, subnet=subnet, hosts=tuple(hosts), source=source)


def load(path: str | Path) -> ClusterSpec:
    """Read and check a cluster file.

    Raises:
        ValueError: The file is missing, not TOML, or describes no valid cluster.
    """
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ValueError(f"cluster file {path}: {exc.strerror}") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"cluster file {path} is not TOML: {exc}") from None
    return parse(data, source=str(path))
