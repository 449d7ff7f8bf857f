"""The cluster description: node types, links, where servers may run (pure logic).

A cluster file (YAML, JSON or TOML; the README documents the fields)::

    name: two-generation-1024
    links:
      intra_node: {bandwidth: 100Gb/s, latency: 1us}
      inter_node: {bandwidth: 25Gb/s, latency: 5us}
      core: {bandwidth: 400GB/s}       # optional: the core switch's capacity
    node_types:
      - {name: fast, count: 64, devices: 8, speed: 2.0, memory: 80GiB, price_per_hour: 32}
      - {name: slow, count: 64, devices: 8, speed: 1.0, memory: 32GiB, price_per_hour: 12}
    servers: {node_types: [slow], per_node: 1}

A node type's ``devices`` are its ranks' processors, each as fast as
``speed`` times the profiled device (or as its own ``profile`` says).
With ``cores: C`` the node's ranks instead share ``C`` cores (a machine
without accelerators: compute, memory copies and server updates contend
for them) and the node's ``intra_node`` link is a memory copy that costs
core time at its bandwidth. ``intra_node`` may be set per node type.
Every message between nodes crosses the node's ``inter_node`` link at both
ends and, when ``links.core`` is given, the core switch, whose bandwidth all
such messages share. Servers run on nodes of ``servers.node_types``, at
most ``per_node`` on a node, taken from the last such node backwards; a
server on a node of devices gets a core of its own (``server_speed`` times
the profiled server), on a node of shared cores it shares them.

``machine: {cores: C, kernel_bandwidth: B}`` says the nodes are not
machines but network namespaces of one machine of ``C`` cores (hybridagg's
emulated clusters, ``hybridagg cluster up``): everything every node
executes shares those cores, and so does the kernel's work of moving a
message between namespaces, ``B`` bytes per second on one core at each end
(sender and receiver), beside the shaped links. Every node type must then
have ``cores``.

Ranks are numbered as the file lists the devices: node types in order, each
type's nodes in order, each node's devices in order; the servers follow the
workers (hybridagg's rule: the servers are the last ranks).
"""

from __future__ import annotations

import json
import math
import tomllib
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ..runtime.extras import require
from .units import parse_bandwidth, parse_seconds, parse_size

__all__ = [
    "ClusterSpec",
    "LinkSpec",
    "MachineSpec",
    "NodeType",
    "ServerPlacement",
    "load_cluster",
]


@dataclass(frozen=True)
class LinkSpec:
    """A link: bytes per second and seconds of latency per message."""

    bandwidth: float
    latency: float = 0.0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.bandwidth) and self.bandwidth > 0):
            raise ValueError(f"link bandwidth must be positive, got {self.bandwidth}")
        if not (math.isfinite(self.latency) and self.latency >= 0):
            raise ValueError(f"link latency must be >= 0, got {self.latency}")


@dataclass(frozen=True)
class NodeType:
    """One kind of node and how many of them the cluster has."""

    name: str
    count: int
    devices: int
    speed: float = 1.0
    """compute speed relative to the profiled device (ignored with ``profile``)"""
    memory: float | None = None
    """bytes of memory per device (shared cores: per node)"""
    price_per_hour: float = 0.0
    """price of one node per hour"""
    cores: int | None = None
    """the node's ranks share this many cores (``None``: one processor per device)"""
    profile: str | None = None
    """a profile of this node type's own device (path), instead of ``speed``"""
    intra_node: LinkSpec | None = None
    """this node type's link inside a node (``None``: the cluster's)"""
    server_speed: float = 1.0
    """a server's update speed on this node, relative to the profiled server"""

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("a node type needs a name")
        for what, value, low in (
            ("count", self.count, 1),
            ("devices", self.devices, 0),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(
                    f"node type {self.name!r}: {what} must be an integer >= {low}, got {value!r}"
                )
        if self.cores is not None and (
            isinstance(self.cores, bool)
            or not isinstance(self.cores, int)
            or self.cores < 1
        ):
            raise ValueError(
                f"node type {self.name!r}: cores must be an integer >= 1, got {self.cores!r}"
            )
        for what, value in (("speed", self.speed), ("server_speed", self.server_speed)):
            if not (math.isfinite(value) and value > 0):
                raise ValueError(
                    f"node type {self.name!r}: {what} must be positive, got {value!r}"
                )
        if not (math.isfinite(self.price_per_hour) and self.price_per_hour >= 0):
            raise ValueError(
                f"node type {self.name!r}: price_per_hour must be >= 0, got {self.price_per_hour!r}"
            )

    @property
    def shared_cores(self) -> bool:
        """Whether the node's ranks share its cores (one simulated host per node)."""
        return self.cores is not None


@dataclass(frozen=True)
class MachineSpec:
    """The one machine whose network namespaces an emulated cluster's nodes are."""

    cores: int
    """the machine's cores, shared by everything every node executes"""
    kernel_bandwidth: float
    """bytes per second one core moves between namespaces at each end of a
    message (the kernel's copies and forwarding; calibrated by
    ``bench/allreduce.py`` across the cluster, see
    :func:`hybridagg.sim.calibrate.fit_network`)"""

    def __post_init__(self) -> None:
        if (
            isinstance(self.cores, bool)
            or not isinstance(self.cores, int)
            or self.cores < 1
        ):
            raise ValueError(
                f"machine: cores must be an integer >= 1, got {self.cores!r}"
            )
        if not (math.isfinite(self.kernel_bandwidth) and self.kernel_bandwidth > 0):
            raise ValueError(
                f"machine: kernel_bandwidth must be positive, got {self.kernel_bandwidth!r}"
            )


@dataclass(frozen=True)
class ServerPlacement:
    """Where parameter servers may run."""

    node_types: tuple[str, ...]
    per_node: int = 1


@dataclass(frozen=True)
class ClusterSpec:
    """A validated cluster description (see the module)."""

    name: str
    node_types: tuple[NodeType, ...]
    intra_node: LinkSpec
    inter_node: LinkSpec
    servers: ServerPlacement
    core: LinkSpec | None = None
    """the core switch every message between nodes crosses, its bandwidth
    shared by all of them whichever way they go (a cluster's bisection
    bandwidth; an emulated cluster's kernel forwarding on shared cores is
    ``machine``'s); ``None``: it never limits"""
    machine: MachineSpec | None = None
    """the machine whose namespaces the nodes are (an emulated cluster);
    ``None``: the nodes are machines"""
    source: str = field(default="", compare=False)
    """the file it came from (for messages)"""

    def __post_init__(self) -> None:
        names = [t.name for t in self.node_types]
        if not names:
            raise ValueError(
                f"{self._where}node_types: at least one node type is needed"
            )
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"{self._where}node_types: names {dup} appear twice")
        if self.num_devices < 1:
            raise ValueError(f"{self._where}node_types: no node type has devices")
        unknown = [n for n in self.servers.node_types if n not in names]
        if unknown:
            raise ValueError(
                f"{self._where}servers.node_types names {unknown}, not node types "
                f"of this cluster ({', '.join(names)})"
            )
        if self.servers.per_node < 1:
            raise ValueError(f"{self._where}servers.per_node must be >= 1")
        own = [t.name for t in self.node_types if not t.shared_cores]
        if self.machine is not None and own:
            raise ValueError(
                f"{self._where}machine: the nodes are namespaces sharing its "
                f"cores, so every node type needs cores (not {', '.join(own)})"
            )

    @property
    def _where(self) -> str:
        return f"cluster file {self.source}: " if self.source else ""

    @property
    def num_devices(self) -> int:
        """Devices (worker ranks) of the whole cluster."""
        return sum(t.count * t.devices for t in self.node_types)

    @property
    def max_servers(self) -> int:
        """How many servers the placement allows."""
        allowed = set(self.servers.node_types)
        return (
            sum(t.count for t in self.node_types if t.name in allowed)
            * self.servers.per_node
        )

    def intra_link(self, node_type: NodeType) -> LinkSpec:
        """The link inside a node of ``node_type``."""
        return node_type.intra_node or self.intra_node

    def scaled(self, workers: int) -> ClusterSpec:
        """The same cluster cut down to ``workers`` devices, each node type keeping
        its share of the devices (whole nodes).

        Raises:
            ValueError: ``workers`` does not divide into whole nodes so.
        """
        total = self.num_devices
        if workers == total:
            return self
        if not 1 <= workers <= total:
            raise ValueError(
                f"{self._where}{workers} workers: the cluster has {total} devices"
            )
        types = []
        for t in self.node_types:
            if t.devices == 0:  # server nodes stay
                types.append(t)
                continue
            nodes = t.count * workers / total
            if nodes != int(nodes) or nodes < 1:
                raise ValueError(
                    f"{self._where}{workers} workers do not give node type {t.name!r} "
                    f"a whole number of nodes ({nodes:g} of {t.count}); use a "
                    f"multiple of {_step(self)} devices"
                )
            types.append(replace(t, count=int(nodes)))
        return replace(self, node_types=tuple(types))


def _step(cluster: ClusterSpec) -> int:
    """The smallest number of workers that :meth:`ClusterSpec.scaled` accepts."""
    g = 0
    for t in cluster.node_types:
        if t.devices:
            g = math.gcd(g, t.count)
    return cluster.num_devices // g


# ------------------------------------------------------------------ reading
def _read(path: Path) -> Any:
    suffix = path.suffix.lower()
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ValueError(f"cluster file {path} does not exist") from None
    except OSError as exc:
        raise ValueError(f"cluster file {path} cannot be read: {exc}") from None
    if suffix in (".yaml", ".yml"):
        yaml = require("yaml", f"reading the YAML cluster file {path}")
        try:
            return yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ValueError(f"cluster file {path} is not valid YAML: {exc}") from None
    try:
        if suffix == ".json":
            return json.loads(text)
        if suffix == ".toml":
            return tomllib.loads(text)
    except ValueError as exc:  # JSONDecodeError and TOMLDecodeError both are
        raise ValueError(
            f"cluster file {path} is not valid {suffix[1:].upper()}: {exc}"
        ) from None
    raise ValueError(f"cluster file {path}: write it as .yaml, .json or .toml")


class _Fields:
    """A mapping read field by field, naming the file and the field on any error."""

    def __init__(self, data: Any, where: str, path: Path) -> None:
        if not isinstance(data, dict):
            raise ValueError(
                f"cluster file {path}: {where or 'the file'} must be a mapping, got {type(data).__name__}"
            )
        self.data, self.where, self.path = data, where, path
        self.used: set[str] = set()

    def name(self, key: str) -> str:
        return f"{self.where}.{key}" if self.where else key

    def error(self, key: str, message: str) -> ValueError:
        return ValueError(f"cluster file {self.path}: {self.name(key)}: {message}")

    def get(self, key: str, default: Any = None, *, required: bool = False) -> Any:
        self.used.add(key)
        if key not in self.data:
            if required:
                raise self.error(key, "missing")
            return default
        return self.data[key]

    def convert(
        self, key: str, fn, default: Any = None, *, required: bool = False
    ) -> Any:
        value = self.get(key, None, required=required)
        if value is None:
            return default
        try:
            return fn(value)
        except (ValueError, TypeError) as exc:
            raise self.error(key, str(exc)) from None

    def integer(
        self, key: str, default: Any = None, *, required: bool = False, low: int = 1
    ) -> Any:
        value = self.get(key, None, required=required)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise self.error(key, f"must be an integer >= {low}, got {value!r}")
        return value

    def number(self, key: str, default: float, *, positive: bool = True) -> float:
        value = self.get(key, None)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self.error(key, f"must be a number, got {value!r}")
        value = float(value)
        if not math.isfinite(value) or value < 0 or (positive and value == 0):
            raise self.error(
                key, f"must be {'positive' if positive else '>= 0'}, got {value!r}"
            )
        return value

    def done(self) -> None:
        extra = sorted(set(self.data) - self.used)
        if extra:
            raise ValueError(
                f"cluster file {self.path}: {self.where or 'the file'} has unknown "
                f"field(s) {', '.join(extra)}; known: {', '.join(sorted(self.used))}"
            )


def _link(data: Any, where: str, path: Path) -> LinkSpec:
    f = _Fields(data, where, path)
    link = LinkSpec(
        bandwidth=f.convert(
            "bandwidth", lambda v: parse_bandwidth(v, "bandwidth"), required=True
        ),
        latency=f.convert("latency", lambda v: parse_seconds(v, "latency"), 0.0),
    )
    f.done()
    return link


def _node_type(data: Any, index: int, path: Path) -> NodeType:
    f = _Fields(data, f"node_types[{index}]", path)
    name = f.get("name", required=True)
    if not isinstance(name, str) or not name:
        raise f.error("name", f"must be a non-empty string, got {name!r}")
    f.where = f"node_types[{index}] ({name})"
    profile = f.get("profile")
    if profile is not None:
        if not isinstance(profile, str):
            raise f.error("profile", f"must be a path, got {profile!r}")
        resolved = (
            Path(profile) if Path(profile).is_absolute() else path.parent / profile
        )
        if not resolved.is_file():
            raise f.error("profile", f"{resolved} does not exist")
        profile = str(resolved)
    intra = f.get("intra_node")
    node = NodeType(
        name=name,
        count=f.integer("count", required=True),
        devices=f.integer("devices", required=True, low=0),  # 0: a node for servers
        speed=f.number("speed", 1.0),
        memory=f.convert("memory", lambda v: parse_size(v, "memory")),
        price_per_hour=f.number("price_per_hour", 0.0, positive=False),
        cores=f.integer("cores"),
        profile=profile,
        intra_node=None if intra is None else _link(intra, f.name("intra_node"), path),
        server_speed=f.number("server_speed", 1.0),
    )
    f.done()
    return node


def load_cluster(path: str | Path) -> ClusterSpec:
    """Read and validate a cluster file (YAML, JSON or TOML, by its suffix).

    Raises:
        ValueError: A missing file, bad syntax, a missing, unknown or bad field;
            the message names the file and the field.
    """
    path = Path(path)
    data = _read(path)
    top = _Fields(data, "", path)
    name = top.get("name", path.stem)
    if not isinstance(name, str):
        raise top.error("name", f"must be a string, got {name!r}")
    links = _Fields(top.get("links", required=True), "links", path)
    intra = _link(links.get("intra_node", required=True), "links.intra_node", path)
    inter = _link(links.get("inter_node", required=True), "links.inter_node", path)
    core_data = links.get("core")
    core = None if core_data is None else _link(core_data, "links.core", path)
    links.done()
    types_data = top.get("node_types", required=True)
    if not isinstance(types_data, list) or not types_data:
        raise top.error("node_types", "must be a non-empty list of node types")
    types = tuple(_node_type(d, i, path) for i, d in enumerate(types_data))
    servers_data = top.get("servers")
    if servers_data is None:
        placement = ServerPlacement(node_types=tuple(t.name for t in types))
    else:
        s = _Fields(servers_data, "servers", path)
        where = s.get("node_types", [t.name for t in types])
        if isinstance(where, str):
            where = [where]
        if (
            not isinstance(where, list)
            or not all(isinstance(n, str) for n in where)
            or not where
        ):
            raise s.error(
                "node_types", f"must be a list of node type names, got {where!r}"
            )
        placement = ServerPlacement(
            node_types=tuple(where), per_node=s.integer("per_node", 1)
        )
        s.done()
    machine_data = top.get("machine")
    machine = None
    if machine_data is not None:
        m = _Fields(machine_data, "machine", path)
        machine = MachineSpec(
            cores=m.integer("cores", required=True),
            kernel_bandwidth=m.convert(
                "kernel_bandwidth",
                lambda v: parse_bandwidth(v, "kernel_bandwidth"),
                required=True,
            ),
        )
        m.done()
    top.done()
    try:
        return ClusterSpec(
            name=name,
            node_types=types,
            intra_node=intra,
            inter_node=inter,
            servers=placement,
            core=core,
            machine=machine,
            source=str(path),
        )
    except ValueError as exc:
        text = str(exc)
        raise ValueError(
            text if text.startswith("cluster file") else f"cluster file {path}: {text}"
        ) from None
