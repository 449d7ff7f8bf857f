"""Who does what: workers in homogeneous groups, their leaders, and the servers.

World ranks are ``0..N-1``. With ``servers=K`` the parameter servers are the
last ``K`` ranks; the workers are ``0..N-K-1``; rank 0 is always a worker.
Every worker belongs to exactly one group; a group's *leader* is its lowest
world rank. Group specs name world ranks of workers.

:class:`Topology` is a validated dataclass built from plain arguments (per
rank descriptors and ``world_size``), so the planning logic is tested without
MPI; :func:`init` measures the descriptors, agrees on them across ranks and
attaches the communicators (:class:`Comms`).

Grouping policies (the ``groups`` string):

``world``
    One group of all workers.
``each``
    Every worker its own group (the ``async`` mode's layout).
``node``
    One group per node (ranks sharing memory, ``MPI_COMM_TYPE_SHARED``).
``device``
    One group per device kind: the CUDA device name, or the CPU model.
``speed`` or ``speed:K``
    By a short compute probe (see :func:`speed_groups` for the rule).
``slurm``
    One group per component of a Slurm heterogeneous job.
``0-3,4-5,6-7``
    Explicit world-rank ranges, one per group (``+`` joins ranges:
    ``0-1+4,2-3``); or the path of a JSON file holding a list of rank lists.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

from .devices import device_label, probe_plan, resolve_device_spec
from .slowdown import Slowdown, parse_rank_ranges, parse_slowdown

__all__ = [
    "Comms",
    "RankInfo",
    "Topology",
    "current_topology",
    "default_topology",
    "forget_topology",
    "init",
    "parse_group_spec",
    "plan",
    "speed_groups",
]

SPEED_TOLERANCE = 1.5
"""Neighbouring speeds within this ratio are 'similar' for ``groups='speed'``."""


@dataclass(frozen=True)
class RankInfo:
    """What one rank reports about itself before groups are formed.

    Attributes:
        host: Node name (``MPI_Get_processor_name``) or a node index.
        device: Device kind, e.g. ``"cuda:NVIDIA A100-SXM4-40GB"`` or ``"cpu:..."``.
        speed: Measured probe speed (higher is faster), when measured.
        slurm_component: Heterogeneous-job component index, when under Slurm.
    """

    host: str
    device: str = "cpu"
    speed: float | None = None
    slurm_component: int | None = None


@dataclass
class Comms:
    """The communicators of one rank, created once by :func:`init`.

    Attributes:
        world: Duplicate of the user's communicator.
        workers: All worker ranks (``None`` on servers).
        group: This rank's group (``None`` on servers).
        leaders: Group leaders followed by the servers, in world-rank order
            (``None`` on workers that are not leaders).
        node: Ranks on this node.
        chunks: The workers followed by server 0, for the data's chunk
            counter that server 0 serves (:mod:`hybridagg.train.chunks`);
            ``None`` without servers and on the other servers.
        chunks_in_use: Whether a :class:`hybridagg.data.ShareSampler`
            holds server 0's counter now (one sampler at a time draws from
            it; the same on every worker: samplers are made and freed
            collectively).
        chunks_used: Whether one ever did (the counter then no longer
            starts at 0).
    """

    world: object
    workers: object | None
    group: object | None
    leaders: object | None
    node: object
    chunks: object | None = None
    chunks_in_use: bool = False
    chunks_used: bool = False

    def free(self) -> None:
        """Free every communicator hybridagg created."""
        for comm in (
            self.chunks,
            self.group,
            self.leaders,
            self.workers,
            self.node,
            self.world,
        ):
            if comm is not None:
                comm.free()


@dataclass(frozen=True)
class Topology:
    """Roles, groups and node placement of every rank.

    Attributes:
        world_size: Number of ranks.
        groups: Each group's world ranks, ascending; groups ordered by leader.
        servers: World ranks of the parameter servers (the last ones).
        hosts: Node name of every world rank.
        rank: The rank this object describes (its "own" rank).
        policy: The grouping spec it was built from.
        comms: Communicators, attached by :func:`init` (``None`` in pure use).
        device: The device this rank trains on, as :func:`init` resolved
            its ``device`` (``"cpu"``, ``"cuda:I"``; servers ``"cpu"``).
        devices: The device kind every world rank trains on
            (:func:`hybridagg.devices.device_label`; empty in pure use).
    """

    world_size: int
    groups: tuple[tuple[int, ...], ...]
    servers: tuple[int, ...] = ()
    hosts: tuple[str, ...] = ()
    rank: int = 0
    policy: str = "world"
    comms: Comms | None = field(default=None, compare=False, repr=False)
    device: str = "cpu"
    devices: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        n, k = self.world_size, len(self.servers)
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"world_size must be a positive integer, got {n!r}")
        if k > n - 1:
            raise ValueError(
                f"{k} servers need at least {k + 1} ranks (rank 0 is always a "
                f"worker), but the world has {n}"
            )
        if tuple(self.servers) != tuple(range(n - k, n)):
            raise ValueError(f"servers must be the last {k} ranks, got {self.servers}")
        if self.hosts and len(self.hosts) != n:
            raise ValueError(f"hosts lists {len(self.hosts)} ranks, world has {n}")
        if self.devices and len(self.devices) != n:
            raise ValueError(f"devices lists {len(self.devices)} ranks, world has {n}")
        if not 0 <= self.rank < n:
            raise ValueError(f"rank {self.rank} is outside 0-{n - 1}")
        _validate_groups(self.groups, n - k, n)

    # --- the whole job ----------------------------------------------------
    @property
    def num_workers(self) -> int:
        """Number of worker ranks."""
        return self.world_size - len(self.servers)

    @property
    def workers(self) -> tuple[int, ...]:
        """World ranks of the workers."""
        return tuple(range(self.num_workers))

    @property
    def num_groups(self) -> int:
        """Number of groups."""
        return len(self.groups)

    @property
    def leaders(self) -> tuple[int, ...]:
        """World rank of each group's leader, in group order."""
        return tuple(g[0] for g in self.groups)

    def group_of(self, rank: int) -> int | None:
        """Index of ``rank``'s group (``None`` for a server)."""
        for index, members in enumerate(self.groups):
            if rank in members:
                return index
        return None

    def role_of(self, rank: int) -> str:
        """``"server"``, ``"leader"`` or ``"worker"``."""
        if rank in self.servers:
            return "server"
        return "leader" if rank in self.leaders else "worker"

    def describe_rank(self, rank: int) -> str:
        """``rank`` and its role, for messages: ``"rank 3 (worker of group 1)"``.

        Roles: ``leader of group g``, ``worker of group g``, ``server s``.
        """
        if rank in self.servers:
            return f"rank {rank} (server {self.servers.index(rank)})"
        group = self.group_of(rank)
        if group is None:
            return f"rank {rank}"
        return f"rank {rank} ({self.role_of(rank)} of group {group})"

    # --- this rank ----------------------------------------------------------
    @property
    def role(self) -> str:
        """This rank's role."""
        return self.role_of(self.rank)

    @property
    def is_server(self) -> bool:
        """Whether this rank is a parameter server."""
        return self.rank in self.servers

    @property
    def is_worker(self) -> bool:
        """Whether this rank is a worker (leaders included)."""
        return not self.is_server

    @property
    def is_leader(self) -> bool:
        """Whether this rank leads its group."""
        return self.rank in self.leaders

    @property
    def group(self) -> int | None:
        """This rank's group index (``None`` on a server)."""
        return self.group_of(self.rank)

    @property
    def group_ranks(self) -> tuple[int, ...]:
        """World ranks of this rank's group (empty on a server)."""
        g = self.group
        return () if g is None else self.groups[g]

    @property
    def leader(self) -> int | None:
        """World rank of this rank's leader (``None`` on a server)."""
        ranks = self.group_ranks
        return ranks[0] if ranks else None

    @property
    def _node_ranks(self) -> list[int]:
        hosts = self.hosts or ("localhost",) * self.world_size
        return [r for r in range(self.world_size) if hosts[r] == hosts[self.rank]]

    @property
    def local_rank(self) -> int:
        """This rank's index among the ranks on its node."""
        return self._node_ranks.index(self.rank)

    @property
    def local_size(self) -> int:
        """Number of ranks on this rank's node."""
        return len(self._node_ranks)

    @property
    def cross_rank(self) -> int:
        """Index of this rank's node among the nodes (in order of first rank)."""
        hosts = self.hosts or ("localhost",) * self.world_size
        return list(dict.fromkeys(hosts)).index(hosts[self.rank])

    @property
    def cross_size(self) -> int:
        """Number of nodes."""
        return len(set(self.hosts)) if self.hosts else 1

    def describe(self) -> str:
        """One line per group, then the servers: for logs and ``hybridagg info``."""
        lines = [
            f"group {i}: ranks {list(g)} (leader {g[0]})"
            for i, g in enumerate(self.groups)
        ]
        if self.servers:
            lines.append(f"servers: ranks {list(self.servers)}")
        return "\n".join(lines)


def _validate_groups(groups, num_workers: int, world_size: int) -> None:
    if not groups:
        raise ValueError("there must be at least one group")
    seen: dict[int, int] = {}
    for index, members in enumerate(groups):
        if not members:
            raise ValueError(f"group {index} is empty")
        for rank in members:
            if not isinstance(rank, int):
                raise TypeError(f"group {index} holds {rank!r}, not a rank number")
            if num_workers <= rank < world_size:
                raise ValueError(
                    f"group {index} names rank {rank}, a parameter server (servers "
                    f"are the last {world_size - num_workers} ranks); groups hold "
                    "workers only"
                )
            if not 0 <= rank < world_size:
                raise ValueError(
                    f"group {index} names rank {rank}, outside the world 0-{world_size - 1}"
                )
            if rank in seen:
                raise ValueError(
                    f"rank {rank} is in group {seen[rank]} and group {index}"
                )
            seen[rank] = index
        if list(members) != sorted(members):
            raise ValueError(
                f"group {index} ranks must be ascending, got {list(members)}"
            )
    missing = sorted(set(range(num_workers)) - set(seen))
    if missing:
        raise ValueError(f"workers {missing} are in no group")
    leaders = [g[0] for g in groups]
    if leaders != sorted(leaders):
        raise ValueError("groups must be ordered by their lowest rank")


def _names_a_file(text: str) -> bool:
    """Whether ``text`` is the path of an existing file (a 1,024-rank spec is
    longer than a file name may be: the system's refusal means no)."""
    try:
        return Path(text).is_file()
    except OSError:
        return False


def parse_group_spec(spec: str) -> list[list[int]]:
    """Parse an explicit group spec or a JSON file of rank lists.

    Raises:
        ValueError: Malformed text, an empty group, or a bad JSON file.
    """
    text = spec.strip()
    if text.endswith(".json") or _names_a_file(text):
        path = Path(text)
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise ValueError(f"group file {path} does not exist") from None
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"group file {path} is not valid JSON: {exc}") from None
        if isinstance(data, dict):
            data = data.get("groups")
        if not isinstance(data, list) or not all(isinstance(g, list) for g in data):
            raise ValueError(
                f"group file {path} must hold a list of rank lists, or {{'groups': [...]}}"
            )
        for i, g in enumerate(data):
            if not all(isinstance(r, int) and not isinstance(r, bool) for r in g):
                raise ValueError(f"group {i} in {path} must list integer ranks")
        return [sorted(g) for g in data]
    groups = []
    for index, part in enumerate(text.split(",")):
        if not part.strip():
            raise ValueError(f"group {index} of {spec!r} is empty")
        groups.append(parse_rank_ranges(part, f"group {index}"))
    return groups


def speed_groups(
    speeds: dict[int, float],
    max_groups: int | None = None,
    tolerance: float = SPEED_TOLERANCE,
) -> list[list[int]]:
    """Cluster ranks by measured speed.

    The rule: sort the ranks from fastest to slowest and look at the ratio of
    each speed to the next one. A group boundary goes at each ratio above
    ``tolerance`` (1.5), keeping only the ``max_groups - 1`` largest when
    ``max_groups`` is given. Groups are therefore contiguous in speed order:
    a rank is never grouped with a faster rank while a rank between them in
    speed is elsewhere, and a gap larger than any gap inside a group always
    separates groups when there is room for another group.

    Args:
        speeds: Rank to speed (higher is faster, any positive unit).
        max_groups: At most this many groups (``None``: no limit).
        tolerance: Ratio above which neighbours are not similar.

    Returns:
        Groups of ranks, each ascending, ordered by lowest rank.
    """
    if not speeds:
        raise ValueError("no speeds to group")
    if max_groups is not None and max_groups < 1:
        raise ValueError(f"speed:K needs K >= 1, got {max_groups}")
    bad = {r: s for r, s in speeds.items() if not s > 0}
    if bad:
        raise ValueError(f"speeds must be positive, got {bad}")
    order = sorted(speeds, key=lambda r: (-speeds[r], r))
    gaps = [
        (speeds[order[i]] / speeds[order[i + 1]], i)
        for i in range(len(order) - 1)
        if speeds[order[i]] / speeds[order[i + 1]] > tolerance
    ]
    gaps.sort(reverse=True)
    if max_groups is not None:
        gaps = gaps[: max_groups - 1]
    cuts = sorted(i for _, i in gaps)
    groups, start = [], 0
    for cut in cuts:
        groups.append(sorted(order[start : cut + 1]))
        start = cut + 1
    groups.append(sorted(order[start:]))
    return sorted(groups, key=lambda g: g[0])


def _by_key(workers: range, keys: list) -> list[list[int]]:
    buckets: dict = {}
    for r in workers:
        buckets.setdefault(keys[r], []).append(r)
    return sorted(buckets.values(), key=lambda g: g[0])


def plan(
    groups: str,
    infos: list[RankInfo],
    world_size: int,
    servers: int = 0,
    rank: int = 0,
) -> Topology:
    """Build and validate the topology from every rank's descriptor.

    Args:
        groups: The grouping spec (see the module docstring).
        infos: One :class:`RankInfo` per world rank.
        world_size: Number of ranks.
        servers: Number of parameter servers (the last ranks).
        rank: The rank the returned object describes.

    Raises:
        ValueError: Any inconsistency, with a message naming it.
        TypeError: Arguments of the wrong type.
    """
    if not isinstance(groups, str):
        raise TypeError(f"groups must be a string spec, got {type(groups).__name__}")
    if isinstance(servers, bool) or not isinstance(servers, int):
        raise TypeError(f"servers must be an int, got {type(servers).__name__}")
    if servers < 0:
        raise ValueError(f"servers must be >= 0, got {servers}")
    if len(infos) != world_size:
        raise ValueError(
            f"got {len(infos)} rank descriptors for a world of {world_size}"
        )
    if servers > world_size - 1:
        raise ValueError(
            f"{servers} servers need at least {servers + 1} ranks (rank 0 is always "
            f"a worker), but the world has {world_size}"
        )
    workers = range(world_size - servers)
    policy, _, arg = groups.strip().partition(":")
    if policy == "world":
        layout = [list(workers)]
    elif policy == "each":
        layout = [[r] for r in workers]
    elif policy == "node":
        layout = _by_key(workers, [i.host for i in infos])
    elif policy == "device":
        layout = _by_key(workers, [i.device for i in infos])
    elif policy == "slurm":
        components = [i.slurm_component for i in infos]
        if any(components[r] is None for r in workers):
            raise ValueError(
                "groups='slurm' needs a Slurm heterogeneous job step (srun "
                "--het-group=...): some ranks see no component index"
            )
        layout = _by_key(workers, components)
    elif policy == "speed":
        try:
            k = int(arg) if arg else None
        except ValueError:
            raise ValueError(
                f"groups={groups!r}: K in speed:K must be an integer"
            ) from None
        missing = [r for r in workers if infos[r].speed is None]
        if missing:
            raise ValueError(f"groups='speed' but ranks {missing} measured no speed")
        layout = speed_groups({r: infos[r].speed for r in workers}, k)
    else:
        layout = parse_group_spec(groups)
    layout = sorted((sorted(g) for g in layout), key=lambda g: g[0] if g else -1)
    return Topology(
        world_size=world_size,
        groups=tuple(tuple(g) for g in layout),
        servers=tuple(range(world_size - servers, world_size)),
        hosts=tuple(i.host for i in infos),
        rank=rank,
        policy=groups,
        devices=tuple(i.device for i in infos),
    )


# --------------------------------------------------------------------- MPI
def _device_kind(device: str) -> str:
    """The kind of the device this rank trains on (``--groups device`` compares it)."""
    import torch

    cuda_name = None
    if device.startswith("cuda") and torch.cuda.is_available():
        cuda_name = torch.cuda.get_device_name(torch.device(device))
    return device_label(device, cuda_name, _cpu_model())


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def _cuda_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def probe_speed(
    factor: float = 1.0, reps: int = 7, size: int | None = None, device: str = "cpu"
) -> float:
    """Time a matrix product on the device this rank trains on; return 1 / median seconds.

    What is timed is :func:`hybridagg.devices.probe_plan`'s choice: on a GPU
    a larger CUDA product, with the device synchronised before each reading
    of the clock (kernels return before they finish); else the CPU product.
    The emulated slowdown ``factor`` is applied as a sleep of
    ``(factor - 1) x compute time`` after each repetition, like training.
    """
    import torch

    probe = probe_plan(device)
    n = probe.size if size is None else size
    a = torch.randn(n, n, device=probe.device)
    b = torch.randn(n, n, device=probe.device)

    def sync() -> None:
        if probe.synchronize:
            torch.cuda.synchronize(probe.device)

    a = torch.tanh(a @ b * 0.01)  # (warm-up: CUDA's first kernel loads it)
    sync()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        for _ in range(4):
            a = torch.tanh(a @ b * 0.01)
        sync()
        compute = time.perf_counter() - start
        if factor > 1.0:
            time.sleep((factor - 1.0) * compute)
        times.append(time.perf_counter() - start)
    return 1.0 / statistics.median(times)


def init(
    comm=None,
    groups: str = "world",
    servers: int = 0,
    *,
    slowdown: str | Slowdown | None = None,
    num_threads: int | None = None,
    device: str = "auto",
) -> Topology:
    """Form the topology of this MPI job and create its communicators.

    Collective over ``comm``. Every rank must pass the same ``groups`` and
    ``servers``; a bad or disagreeing spec raises the same ``ValueError`` on
    every rank. Installs the abort-on-unhandled-error hook and sets one
    compute thread per rank (see :mod:`hybridagg.comm`). Shows hybridagg's
    log messages on stderr, rank-tagged, rank 0's only, at
    ``HYBRIDAGG_LOG_LEVEL`` (:mod:`hybridagg.runtime.logs`; a script that
    configured ``logging`` itself keeps its own handlers). Each worker that
    trains on a GPU (``device``, as :func:`hybridagg.devices.resolve_device_spec`
    reads it: by default its node-local GPU ``local_rank % device_count``
    where it has one) is bound to it (``torch.cuda.set_device``); the
    ``device`` and ``speed`` groupings see the device each rank trains on.

    Args:
        comm: The user's mpi4py communicator (default ``COMM_WORLD``), duplicated once.
        groups: Grouping spec (see the module docstring).
        servers: Number of parameter-server ranks (the last ranks).
        slowdown: Emulated heterogeneity seen by ``groups='speed'``'s probe
            (default ``HYBRIDAGG_SLOWDOWN``).
        num_threads: Compute threads per rank (default 1, see
            :func:`hybridagg.comm.configure_threads`).
        device: ``auto`` (default), ``cpu``, ``cuda`` or ``cuda:N``: where
            this rank trains (``hybridagg train --device``).

    Returns:
        The :class:`Topology` of this rank, with ``comms`` attached.
    """
    import torch
    from mpi4py import MPI

    from .comm import Comm, configure_threads, install_abort_hook
    from .runtime import envvars, logs

    install_abort_hook()
    configure_threads(num_threads)
    world = Comm(comm, name="world")
    error: BaseException | None = None
    schedule = Slowdown()
    train_on = "cpu"
    local_rank = _local_rank(world)  # (collective: before any rank may raise)
    try:
        if not isinstance(groups, str):
            raise TypeError(
                f"groups must be a string spec, got {type(groups).__name__}"
            )
        if isinstance(servers, bool) or not isinstance(servers, int):
            raise TypeError(f"servers must be an int, got {type(servers).__name__}")
        if not isinstance(device, str):
            raise TypeError(f"device must be a string, got {type(device).__name__}")
        train_on = resolve_device_spec(device, local_rank, _cuda_count())
        if 0 < servers < world.size and world.rank >= world.size - servers:
            train_on = (
                "cpu"  # (a server trains nothing: its shard stays in host memory)
            )
        # rank-tagged log messages, rank 0's (HYBRIDAGG_LOG_LEVEL, _RANKS)
        logs.configure(world.rank, force=False)
        if slowdown is None:
            slowdown = envvars.get_str("HYBRIDAGG_SLOWDOWN")
        schedule = (
            slowdown if isinstance(slowdown, Slowdown) else parse_slowdown(slowdown)
        )
    except (TypeError, ValueError) as exc:
        error = exc
    world.check(error, what="hybridagg.init arguments")
    specs = world.allgather((groups, servers), what="init spec agreement")
    if len(set(specs)) != 1:
        detail = ", ".join(f"rank {r}: {s}" for r, s in enumerate(specs))
        raise ValueError(f"ranks disagree on (groups, servers): {detail}")

    is_worker = world.rank < world.size - servers if servers < world.size else True
    speed = None
    if groups.strip().startswith("speed"):
        # One rank at a time, so the probe does not measure oversubscription.
        for turn in range(world.size):
            if turn == world.rank and is_worker:
                speed = probe_speed(schedule.factor(world.rank), device=train_on)
            world.barrier(what="speed probe turn")
    info = RankInfo(
        host=MPI.Get_processor_name(),
        device=_device_kind(train_on),
        speed=speed,
        slurm_component=_slurm_component(),
    )
    infos = world.allgather(info, what="rank descriptors")
    topo = None
    try:
        topo = plan(groups, infos, world.size, servers, world.rank)
    except (TypeError, ValueError) as exc:
        error = exc
    world.check(error, what="topology")

    group_index = topo.group
    workers = world.split(0 if topo.is_worker else None, world.rank, name="workers")
    group = world.split(group_index, world.rank, name=f"group{group_index}")
    in_leaders = topo.is_leader or topo.is_server
    leaders = world.split(0 if in_leaders else None, world.rank, name="leaders+servers")
    node = world.split_shared(name="node")
    # server 0 serves the dynamic shares' chunk counter by messages where a
    # window would be slow (workers on several nodes); every job with
    # servers gets the communicator, so a one-node job can ask for it too
    chunks = None
    if topo.servers:
        member = topo.is_worker or world.rank == topo.servers[0]
        chunks = world.split(0 if member else None, world.rank, name="chunk counter")
    comms = Comms(
        world=world,
        workers=workers,
        group=group,
        leaders=leaders,
        node=node,
        chunks=chunks,
    )
    if train_on.startswith("cuda") and topo.is_worker:
        torch.cuda.set_device(torch.device(train_on))
    global _CURRENT
    _CURRENT = Topology(
        world_size=topo.world_size,
        groups=topo.groups,
        servers=topo.servers,
        hosts=topo.hosts,
        rank=topo.rank,
        policy=topo.policy,
        comms=comms,
        device=train_on,
        devices=topo.devices,
    )
    return _CURRENT


# The topology the last init() of this process formed. Library calls made
# without topology= (Horovod's habit: hvd.broadcast_parameters(...) names no
# communicator) use it: a second init() there would be collective over the
# whole world, which the servers, serving, never join, so the workers hung
# until the timeout (issue 23). Explicit topologies are still the rule
# inside hybridagg; this is only the default of the public calls.
_CURRENT: Topology | None = None


def _local_rank(world) -> int:
    """This rank's index among the ranks of its node (a node communicator,
    created and freed here: the topology's own comes after the plan)."""
    node = world.split_shared(name="node.probe")
    try:
        return node.rank
    finally:
        node.free()


def _slurm_component() -> int | None:
    from .runtime.launchenv import slurm_het_component

    return slurm_het_component()


def current_topology() -> Topology | None:
    """The topology the last :func:`init` of this process formed (``None``:
    none, or its communicators were freed since)."""
    from mpi4py import MPI

    topo = _CURRENT
    if topo is None or topo.comms is None or topo.comms.world.mpi == MPI.COMM_NULL:
        return None
    return topo


def forget_topology(topology: Topology | None = None) -> None:
    """Stop using ``topology`` (default: the current one) as the default.

    Call it before freeing its communicators; the next call without
    ``topology=`` then initialises again.
    """
    global _CURRENT
    if topology is None or topology is _CURRENT:
        _CURRENT = None


def default_topology(topology: Topology | None) -> Topology:
    """``topology`` as given; when ``None``, the one :func:`init` already formed
    in this process, else :func:`init` of ``COMM_WORLD`` (collective).

    Raises:
        TypeError: ``topology`` did not come from :func:`init`.
    """
    if topology is None:
        return current_topology() or init()
    if not isinstance(topology, Topology) or topology.comms is None:
        raise TypeError("topology must come from hybridagg.init(...)")
    return topology
