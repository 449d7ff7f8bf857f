"""What one simulation runs: ranks on hosts, groups, servers, batches (pure logic).

:func:`build_job` resolves ``hybridagg train``'s options against a cluster
and a profile into a :class:`SimJob` of plain numbers, which the engine
(:mod:`hybridagg.sim.engine`, in a process of its own: SimGrid allows one
engine per process) turns into a platform and actors. Groups follow
:func:`hybridagg.topology.plan`, each rank described by its node (``node``),
its node type (``device``), its compute speed (``speed``) and its node type's
index (``slurm``), so every grouping policy means here what it means in a run.

Adaptive batches are simulated at the controller's steady state: batches in
proportion to speed (:func:`hybridagg.batching.proportional_batches`) over
the pool the controller balances (every worker in sync and async, each
group's members in hybrid, and with ``adaptive_groups`` each group's total
in proportion to its summed speed).
"""

from __future__ import annotations

import itertools
import math
import statistics
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Protocol

from ..batching import proportional_batches
from ..modes import check_mode
from ..slowdown import parse_slowdown
from ..topology import RankInfo, plan
from ..windows import window_samples_for
from .cluster import ClusterSpec, LinkSpec, NodeType, ServerPlacement
from .pipelines import pipeline_groups, pipeline_spec, pipeline_step_seconds
from .profile import Profile, load_profile
from .routes import link_between

__all__ = [
    "BANK_MIN_FLOWS",
    "LOADER_CLAIM_AHEAD",
    "LOADER_WINDOWS_AHEAD",
    "PS_PART_BYTES",
    "PULL_COPIES",
    "JobOptions",
    "SimJob",
    "bank_servers",
    "build_job",
    "calibrated_cluster",
    "machine_cluster",
    "ring_allreduce_seconds",
]


class JobOptions(Protocol):
    """The options a simulation reads (``hybridagg train``'s fields of these names)."""

    mode: str
    groups: str | None
    servers: int | None
    batch_size: int
    slowdown: str | None
    sample_ms: float
    adaptive_batch: bool
    adaptive_groups: bool
    min_batch: int
    max_batch: int | None
    overlap: bool
    stream_push: bool
    staleness_bound: int | None
    wire: str
    steps: int | None
    epochs: int | None
    # (read when present) lookahead: --lookahead, the servers' momentum
    # lookahead on every reply


PS_PART_BYTES = 4 * 2**20
"""The run's part of a parameter-server message (``HYBRIDAGG_PS_PART_BYTES``'s
default): a server updates and returns each part as it arrives."""

PULL_COPIES = 4
"""Copies of the model rank 0 makes around a validation's pull, as
:meth:`hybridagg.ps.exchange.GroupExchange.pull` and the validation do:
the model's weights set aside, the pulled ones copied out, the model's put
back, the pulled ones loaded into the evaluated copy of the model."""


@dataclass(frozen=True)
class SimJob:
    """A resolved simulation (plain values; crosses to the engine's process as JSON).

    Attributes:
        mode: sync, hybrid or async.
        nodes: Per node: ``name``, ``type``, ``shared`` (one host of shared
            cores), ``cores``, ``speed``, ``intra`` (bandwidth, latency) and
            ``memcpy_Bps`` (shared nodes: a core's copy bandwidth).
        inter: The link between a node and the core switch (bandwidth, latency).
        core: The core switch every message between nodes crosses (bandwidth,
            latency), its bandwidth shared by all of them in each direction;
            ``None``: it never limits.
        machine: The nodes as namespaces of one machine (``cores``,
            ``kernel_Bps``): what every node executes shares its cores, and
            a message between nodes also costs ``bytes / kernel_Bps`` of a
            core at each end; ``None``: the nodes are machines.
        workers: Per worker rank: ``node``, ``device`` (index on the node),
            ``seconds_per_sample`` (at speed 1 of its host: the amount an
            execution carries), ``batch``; its own work besides compute and
            communication, seconds at speed 1 executed on its host (0: not
            modelled): ``grad_s``, zeroing the gradient and checking the
            reduced one each step; ``update_s``, the update of the whole
            model after a sync reduction (the optimizer step); and
            ``copy_s``, one copy of the whole model between its tensors and
            a flat buffer (with servers a leader flattens the gradient
            before a push and copies the reply's weights in; in a group of
            several ranks it flattens the weights for the broadcast, which
            each member copies in); and ``paced_tail``, with
            ``sleep_compute`` the share of its compute the pacer cannot hide
            (the profile's :attr:`~.profile.Profile.paced_tail_share`).
        groups: Worker ranks per group, leader first.
        servers: Per server: ``node`` and ``speed``.
        phases: The slowdown schedule, ``[start, {rank: factor}]``.
        sleep_compute: A step lasts what ``--sample-ms`` says (the pacer's
            emulation sleeps what the model's own compute did not take); the
            model's compute still executes on the host, under the sleeps
            but for ``paced_tail``.
        sample_s: ``--sample-ms`` in seconds.
        grad_bytes: Bytes of a gradient on the wire (also of the weights).
        master_bytes: Bytes of the servers' float32 master weights (what an
            update walks, whatever the wire).
        server_update_s: A server's fixed seconds per update.
        server_byte_s: A server's seconds per byte of its shard (with
            ``--lookahead``, also the reply's weights moved along the
            momentum: the profile's ``lookahead_per_byte``).
        overlap: A leader's exchange overlaps its group's next step.
        steps: Updates to simulate (sync: all-reduces; else server versions).
        target_samples: Or samples to train (epochs x the data's samples).
        staleness_bound: SSP: server 0 holds the reply to a group more than
            this many of its updates ahead of the slowest.
        forward_share: The forward pass's share of a step's compute (the
            pacer's third with ``--sample-ms``, else the profile's).
        buckets: ``[share of backward done, share of the bytes]`` per
            gradient bucket in the order backward fills them: each bucket's
            all-reduce starts then, overlapping the rest of backward.
        hierarchical: Sync with several groups (``SyncOptimizer``'s
            hierarchical reduction): per bucket, a reduce to the group's
            leader, an all-reduce across the leaders, a broadcast in the
            group; else one ring all-reduce per group.
        accumulate: Backward passes per update (``--accumulate``): the
            batch's compute is split into that many passes and the buckets
            fill during the last one only.
        server_bank: The servers are simulated as one bank (see
            :func:`bank_servers`): a push is one flow of the whole gradient
            to one server actor whose links are the servers' links side by
            side, not one flow per server.
        eval_every: Rank 0 validates every this many updates (``--eval-every``:
            sync's steps, else server versions), as a run does; ``None``:
            never.
        validation_s: Seconds of one validation on rank 0's device (the
            profile's, at its node's speed; 0: not measured, none simulated).
        validation_pull: A validation first pulls the weights from the
            servers (hybrid and async: rank 0's own weights are stale).
        claim_ahead: Hybrid and async with ``target_samples``: the run's
            samples are dynamic shares, claimed a batch at a time from one
            pool, and each worker's loader holds this many batches claimed
            beyond the one it computes (its read-ahead); the run ends when
            every claimed batch is computed and pushed, so a slow worker's
            claims make the end's tail.
        windows_ahead: With ``epoch_samples``: chunks a worker's loader
            draws beyond the one it cuts batches from (its window reader's
            read-ahead); ``claim_ahead`` is then the batches it has cut
            beyond the one it computes (:class:`~.loader.WorkerLoader`).
        chunk_samples: Samples of a chunk a worker draws (a loader window;
            0: the run's batch size).
        epoch_samples: Samples of an epoch: each epoch's chunks are drawn
            apart, a group beginning the next epoch once an update of its
            carried no samples (0: one pool of ``target_samples``, drawn a
            batch at a time).
        part_bytes: A leader's exchange with a server on another host (not
            a copy on a node of shared cores) is cut into parts of at most
            this many bytes of the server's float32 shard
            (:data:`PS_PART_BYTES`, the run's): the leader sends them in
            order, and the server updates and returns each as it arrives,
            so push, update and reply overlap (0: one message each way).
    """

    mode: str
    nodes: list[dict[str, Any]]
    inter: dict[str, float]
    workers: list[dict[str, Any]]
    groups: list[list[int]]
    servers: list[dict[str, Any]]
    phases: list[list[Any]] = field(default_factory=list)
    sleep_compute: bool = False
    sample_s: float = 0.0
    grad_bytes: float = 0.0
    master_bytes: float = 0.0
    server_update_s: float = 0.0
    server_byte_s: float = 0.0
    overlap: bool = False
    steps: int | None = None
    target_samples: int | None = None
    staleness_bound: int | None = None
    forward_share: float = 1.0 / 3.0
    buckets: list[list[float]] = field(default_factory=lambda: [[1.0, 1.0]])
    hierarchical: bool = False
    accumulate: int = 1
    server_bank: bool = False
    eval_every: int | None = None
    validation_s: float = 0.0
    validation_pull: bool = False
    claim_ahead: int = 0
    windows_ahead: int = 0
    chunk_samples: int = 0
    epoch_samples: int = 0
    pipelines: list[Any] = field(default_factory=list)
    core: dict[str, float] | None = None
    part_bytes: float = 0.0
    machine: dict[str, float] | None = None

    def pipeline_of(self, group: int) -> dict[str, Any] | None:
        """``group``'s pipeline (``None``: its ranks each hold a whole replica)."""
        return self.pipelines[group] if self.pipelines else None

    def exchange_parts(self) -> int:
        """The parts a leader's exchange with a server it reaches by a flow
        (not a copy on a node of shared cores) is cut into: ``part_bytes``
        of a server's float32 shard, as the run's client cuts it."""
        if self.part_bytes <= 0 or not self.servers:
            return 1
        shard = self.master_bytes / len(self.servers)
        return max(1, math.ceil(shard / self.part_bytes))

    def pipeline_step_seconds(self, group: int) -> float:
        """Seconds of one step of pipelined ``group`` (its stages paced as at
        the start, as a run paces them: a later phase of ``--slowdown`` does
        not re-pace a stage)."""
        return pipeline_step_seconds(self.pipelines[group])

    def as_dict(self) -> dict[str, Any]:
        """Plain values (JSON)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SimJob:
        """The job :meth:`as_dict` wrote."""
        return cls(**data)

    def factor(self, rank: int, elapsed: float) -> float:
        """``rank``'s slowdown factor at simulated time ``elapsed``."""
        current: dict = {}
        for start, factors in self.phases:
            if elapsed >= start:
                current = factors
            else:
                break
        return float(current.get(str(rank), current.get(rank, 1.0)))

    def phase_starts(self) -> list[float]:
        """The simulated times at which the slowdown schedule changes (0 first)."""
        return sorted({0.0} | {float(s) for s, _ in self.phases if s > 0})

    def frozen_at(self, elapsed: float) -> SimJob:
        """This job with the slowdown held at its level at ``elapsed`` throughout."""
        factors = {
            str(r): self.factor(r, elapsed)
            for r in range(len(self.workers))
            if self.factor(r, elapsed) != 1.0
        }
        return replace(self, phases=[[0.0, factors]] if factors else [])

    def compute_seconds(self, rank: int, batch: int, elapsed: float = 0.0) -> float:
        """Seconds of ``rank``'s compute for ``batch`` samples, uncontended."""
        w = self.workers[rank]
        factor = self.factor(rank, elapsed)
        if self.sleep_compute:
            return self.sample_s * batch * factor
        speed = self.nodes[w["node"]]["speed"]
        return w["seconds_per_sample"] * batch * factor / speed

    def executed_amount(self, rank: int, batch: int, elapsed: float = 0.0) -> float:
        """Seconds at speed 1 of the model's own compute that executes on
        ``rank``'s host for ``batch`` samples: stretched by the slowdown
        factor, unless the pacer sleeps the factor (``sleep_compute``)."""
        amount = self.workers[rank]["seconds_per_sample"] * batch
        return amount if self.sleep_compute else amount * self.factor(rank, elapsed)

    def _rate(self, elapsed: float) -> float:
        rates: dict[int, float] = {}
        counts: dict[int, int] = {}
        for r, w in enumerate(self.workers):
            rates[w["node"]] = rates.get(w["node"], 0.0) + 1.0 / self.compute_seconds(
                r, 1, elapsed
            )
            counts[w["node"]] = counts.get(w["node"], 0) + 1
        total = 0.0
        for n, rate in rates.items():
            node = self.nodes[n]
            if node["shared"] and not self.sleep_compute and not self.machine:
                # ranks that execute share the node's cores
                rate *= min(1.0, node["cores"] / counts[n])
            total += rate
        if self.machine and not self.sleep_compute:
            # (namespaces of one machine: every rank shares its cores)
            total *= min(1.0, self.machine["cores"] / len(self.workers))
        return total

    def ideal_samples_per_sec(self, wall_s: float = 0.0) -> float:
        """Every worker's compute-only rate, summed, time-averaged over ``wall_s``
        seconds of the slowdown schedule (``hybridagg train``'s ideal); ranks
        that execute on shared cores count the cores' share they can have."""
        starts = sorted({0.0} | {float(s) for s, _ in self.phases if 0 < s < wall_s})
        if wall_s <= 0:
            return self._rate(0.0)
        total = 0.0
        for i, start in enumerate(starts):
            end = starts[i + 1] if i + 1 < len(starts) else wall_s
            total += self._rate(start) * (end - start)
        return total / wall_s


def machine_cluster(profile: Profile, workers: int, servers: int) -> ClusterSpec:
    """This machine as profiled: one node whose ranks share its cores, and
    whose transfers are memory copies on them.

    Calibrated (:func:`hybridagg.sim.calibrate.calibrate`): a copy's latency
    and one core's copy bandwidth are the all-reduce fit's at the group size
    nearest ``workers`` (its measured ranks shared the cores: the bandwidth
    per core is the fit's times ranks per core); else the profile's measured
    copy bandwidth and no latency. The servers' transfer fit reaches the
    simulation through :func:`build_job` (``server_link``).
    """
    fit = profile.allreduce_for(workers) if profile.allreduce_by_ranks else None
    cores = profile.machine.cores
    if fit is not None:
        copies = LinkSpec(
            bandwidth=fit.bandwidth_Bps * max(1.0, fit.ranks / cores),
            latency=fit.latency_s,
        )
    else:
        copies = LinkSpec(bandwidth=profile.machine.memcpy_Bps, latency=0.0)
    node = NodeType(
        name="this-machine", count=1, devices=workers, cores=profile.machine.cores
    )
    return ClusterSpec(
        name="this machine (profiled)",
        node_types=(node,),
        intra_node=copies,
        inter_node=copies,
        servers=ServerPlacement(node_types=(node.name,), per_node=max(1, servers)),
    )


def calibrated_cluster(cluster: ClusterSpec, profile: Profile) -> ClusterSpec:
    """``cluster`` with its links between nodes as the profile calibrated
    them on this cluster (:class:`~.profile.NetworkFit`, by the cluster's
    name): the fitted latency between nodes, and the fitted core bandwidth
    (the cluster file's own ``core`` where the fit found none) or, on one
    machine's namespaces, the fitted kernel rate."""
    fit = profile.network_for(cluster.name)
    if fit is None:
        return cluster
    inter = LinkSpec(bandwidth=cluster.inter_node.bandwidth, latency=fit.latency_s)
    core, machine = cluster.core, cluster.machine
    if fit.core_Bps > 0:
        core = LinkSpec(bandwidth=fit.core_Bps, latency=core.latency if core else 0.0)
    if machine is not None and fit.kernel_Bps > 0:
        machine = replace(machine, kernel_bandwidth=fit.kernel_Bps)
    return replace(cluster, inter_node=inter, core=core, machine=machine)


def _server_nodes(
    cluster: ClusterSpec, node_index: list[tuple[int, NodeType]], count: int
) -> list[int]:
    """Nodes of the servers: allowed nodes from the last backwards, ``per_node`` each."""
    allowed = [i for i, t in node_index if t.name in cluster.servers.node_types]
    slots = [i for i in reversed(allowed) for _ in range(cluster.servers.per_node)]
    if count > len(slots):
        raise ValueError(
            f"{count} servers do not fit the cluster's server placement "
            f"({len(allowed)} nodes of {', '.join(cluster.servers.node_types)} x "
            f"{cluster.servers.per_node} per node = {len(slots)})"
        )
    return sorted(slots[:count])


def build_job(
    options: JobOptions,
    cluster: ClusterSpec,
    profile: Profile,
    *,
    samples: int | None = None,
    block_samples: int | None = None,
) -> SimJob:
    """Resolve the options against ``cluster`` and ``profile`` (see the module).

    Args:
        options: ``hybridagg train``'s options (a ``TrainConfig`` or alike).
        cluster: Every device is a worker; servers are placed as it says.
        profile: The model's profile (node types may carry their own).
        samples: The data's training samples (needed with ``epochs``).
        block_samples: The data file's rows per block: hybrid and async
            workers draw an epoch in windows of blocks, sized as a run sizes
            them (``None``: a batch a draw).

    Raises:
        ValueError: Options that do not fit the cluster, naming what.
    """
    num_servers = (
        options.servers
        if options.servers is not None
        else (0 if options.mode == "sync" else 1)
    )
    check_mode(options.mode, servers=num_servers, cli=True)
    if options.stream_push:
        raise ValueError(
            "hybridagg simulate does not model --stream-push yet (a push per "
            "bucket); leave it out"
        )
    _check_profiled_as(options, profile)
    cluster = calibrated_cluster(cluster, profile)
    profiles: dict[str, Profile] = {}
    nodes: list[dict[str, Any]] = []
    node_index: list[tuple[int, NodeType]] = []
    workers: list[dict[str, Any]] = []
    infos: list[RankInfo] = []
    for type_index, t in enumerate(cluster.node_types):
        own = profile
        if t.profile is not None:
            own = profiles.setdefault(t.profile, load_profile(t.profile))
        speed = 1.0 if t.profile is not None else t.speed
        link = cluster.intra_link(t)
        for k in range(t.count):
            n = len(nodes)
            node_index.append((n, t))
            nodes.append(
                {
                    "name": f"{t.name}{k}",
                    "type": t.name,
                    "shared": t.shared_cores,
                    "cores": t.cores or 1,
                    "speed": speed,
                    "server_speed": t.server_speed,
                    "intra": {"bandwidth": link.bandwidth, "latency": link.latency},
                    "memcpy_Bps": link.bandwidth,
                }
            )
            fit = profile.server
            if t.shared_cores and (fit.transfer_Bps > 0 or fit.transfer_latency_s > 0):
                # this machine's memory, calibrated on bench/ps.py: a
                # leader's transfer to a server on the node (a fit whose
                # round trips did not grow with the bytes measured only the
                # latency: the bytes then move at the node's copy bandwidth)
                nodes[-1]["server_link"] = {
                    "bandwidth": fit.transfer_Bps or link.bandwidth,
                    "latency": fit.transfer_latency_s,
                }
            for d in range(t.devices):
                workers.append(
                    {
                        "node": n,
                        "device": d,
                        "seconds_per_sample": own.sample_seconds,
                        "batch": options.batch_size,
                        "grad_s": own.grad_s,
                        "update_s": own.update_s,
                        "copy_s": own.copy_s,
                        "paced_tail": (
                            own.paced_tail_share if options.sample_ms > 0 else 0.0
                        ),
                    }
                )
                infos.append(
                    RankInfo(
                        host=f"{t.name}{k}", device=t.name, slurm_component=type_index
                    )
                )
    num_workers = len(workers)
    slowdown = parse_slowdown(options.slowdown)
    slowdown.validate_workers(num_workers)
    phases = [
        [start, {str(r): f for r, f in factors.items()}]
        for start, factors in slowdown.phases
    ]
    sleep_compute = options.sample_ms > 0
    job_args: dict[str, Any] = {
        "mode": options.mode,
        "nodes": nodes,
        "inter": {
            "bandwidth": cluster.inter_node.bandwidth,
            "latency": cluster.inter_node.latency,
        },
        "core": (
            None
            if cluster.core is None
            else {"bandwidth": cluster.core.bandwidth, "latency": cluster.core.latency}
        ),
        "part_bytes": PS_PART_BYTES,
        "machine": (
            None
            if cluster.machine is None
            else {
                "cores": cluster.machine.cores,
                "kernel_Bps": cluster.machine.kernel_bandwidth,
            }
        ),
        "workers": workers,
        "groups": [],
        "servers": [],
        "phases": phases,
        "sleep_compute": sleep_compute,
        "sample_s": options.sample_ms / 1000.0,
        "grad_bytes": profile.gradient_bytes(options.wire),
        "master_bytes": profile.gradient_bytes("fp32"),
        "server_update_s": profile.server.seconds_per_update,
        "server_byte_s": profile.server.seconds_per_byte
        + (
            profile.server.lookahead_per_byte
            if getattr(options, "lookahead", False) and options.mode != "sync"
            else 0.0
        ),
        "overlap": bool(options.overlap),
        "staleness_bound": options.staleness_bound,
        "forward_share": (
            1.0 / 3.0
            if options.sample_ms > 0
            else profile.forward_s_per_sample / profile.sample_seconds
        ),
        "buckets": [list(b) for b in profile.buckets] or [[1.0, 1.0]],
        "steps": options.steps,
        "accumulate": int(getattr(options, "accumulate", 1)),
        "eval_every": getattr(options, "eval_every", None),
        "claim_ahead": 0 if options.mode == "sync" else LOADER_CLAIM_AHEAD,
    }
    probe = SimJob(**job_args)
    speeds = [1.0 / probe.compute_seconds(r, 1) for r in range(num_workers)]
    infos = [
        RankInfo(
            host=i.host, device=i.device, speed=s, slurm_component=i.slurm_component
        )
        for i, s in zip(infos, speeds, strict=True)
    ]
    # plan() describes every world rank; the servers' descriptors are never grouped
    world = num_workers + num_servers
    infos += [RankInfo(host=f"server{s}") for s in range(num_servers)]
    spec = (
        {"sync": "world", "hybrid": "node", "async": "each"}[options.mode]
        if not options.groups
        else options.groups
    )
    topo = plan(spec, infos, world, servers=num_servers)
    if options.mode == "async" and any(len(g) > 1 for g in topo.groups):
        raise ValueError(
            "--mode async puts every worker in its own group; drop --groups"
        )
    groups = [list(g) for g in topo.groups]
    job_args["groups"] = groups
    # SyncOptimizer reduces hierarchically (group, leaders, group) with
    # several groups: the simulation does what the run does
    job_args["hierarchical"] = options.mode == "sync" and len(groups) > 1
    job_args["servers"] = [
        {"node": n, "speed": nodes[n]["server_speed"]}
        for n in _server_nodes(cluster, node_index, num_servers)
    ]
    job_args["server_bank"] = bank_servers(nodes, job_args["servers"], len(groups))
    job_args["validation_s"] = _validation_seconds(
        profile, profiles, node_index[workers[0]["node"]][1]
    )
    job_args["validation_pull"] = options.mode != "sync" and num_servers > 0
    if options.adaptive_batch:
        for rank, b in enumerate(_adaptive_batches(options, groups, speeds)):
            workers[rank]["batch"] = b
    _pipelines(options, profile, job_args)
    _chunk_counter(options, job_args)
    if options.epochs is not None:
        if samples is None:
            raise ValueError(
                "--epochs needs the data's size: give --data FILE.h5 or --samples N"
            )
        job_args["target_samples"] = int(options.epochs) * int(samples)
        if options.mode != "sync":  # each epoch's chunks, drawn as the loader does
            job_args["epoch_samples"] = int(samples)
            job_args["windows_ahead"] = LOADER_WINDOWS_AHEAD
            if block_samples:
                job_args["chunk_samples"] = window_samples_for(
                    int(samples), int(block_samples), num_workers
                )
    elif options.steps is None:
        raise ValueError("give --steps N (or --epochs with --data or --samples)")
    return SimJob(**job_args)


def _chunk_counter(options: JobOptions, job_args: dict[str, Any]) -> None:
    """Refuse the one chunk counter the simulator does not model.

    A draw from server 0 (the default across nodes) or from a window on one
    node takes well under a millisecond, once per chunk, and is left out. A
    window across nodes completes a draw only when worker 0 next enters
    MPI, about two of its steps later (bench/chunk_draw.py): a wait the
    simulator would silently miss.
    """
    if options.mode == "sync" or getattr(options, "chunk_counter", "auto") != "window":
        return
    nodes = {w["node"] for w in job_args["workers"]}
    if len(nodes) > 1:
        raise ValueError(
            "hybridagg simulate does not model --chunk-counter window with workers "
            f"on {len(nodes)} nodes (a draw waits for worker 0's next MPI call, "
            "about two of its steps); drop the flag (auto draws from server 0 there)"
        )


def _pipelines(
    options: JobOptions,
    profile: Profile,
    job_args: dict[str, Any],
) -> None:
    """Cut the groups ``--pipeline-groups`` names (:mod:`.pipelines`) into
    ``job_args`` as the run cuts them; the leader of each carries the
    group's batch. (Memory is the planner's check: the run's cut does not
    weigh it, so neither does this one.)"""
    groups = job_args["groups"]
    named = pipeline_groups(getattr(options, "pipeline_groups", None), groups)
    if not named:
        return
    if options.mode != "hybrid":
        raise ValueError(
            "hybridagg simulate models pipelined groups in hybrid mode; sync's "
            "sum of the stages' parts across groups is not modelled yet"
        )
    if options.wire != "fp32" or int(getattr(options, "accumulate", 1)) != 1:
        raise ValueError(
            "a pipelined job runs with --wire fp32 and --accumulate 1 (as hybridagg "
            "train does)"
        )
    if options.overlap:
        raise ValueError(
            "a pipelined job does not overlap its exchange; drop --overlap"
        )
    if options.adaptive_batch:
        raise ValueError(
            "--adaptive-batch with pipelined groups is sync mode's (a hybrid run "
            "refuses it); leave it out"
        )
    if not profile.units:
        raise ValueError(
            f"profile of {profile.model!r} records no pipeline units (profile the "
            "model again with this hybridagg; a model it cannot pipeline has "
            "none: see its notes)"
        )
    probe = SimJob(**job_args)
    units = [
        {"cost": u.cost, "parameters": u.parameters, "output_bytes": u.output_bytes}
        for u in profile.units
    ]
    wire = profile.gradient_bytes(options.wire) / profile.parameters
    specs: list[Any] = [None] * len(groups)
    for g in named:
        ranks = groups[g]
        nodes = [probe.workers[r]["node"] for r in ranks]
        links = []
        for a, b in itertools.pairwise(nodes):
            bw, lat, _copy = link_between(probe, a, b)
            links.append((lat, bw))
        # as the run's cut: speeds from --slowdown at the start, the model's
        # time per sample (the ranks' median, --sample-ms when paced) as the
        # unit that compute and links share
        factors = [probe.factor(r, 0.0) for r in ranks]
        seconds = [probe.compute_seconds(r, 1) for r in ranks]
        specs[g] = pipeline_spec(
            ranks=ranks,
            units=units,
            seconds=seconds,
            speeds=[1.0 / f for f in factors],
            model_seconds=statistics.median(
                s / f for s, f in zip(seconds, factors, strict=True)
            ),
            links=links,
            batch=options.batch_size,
            micro_batches=int(getattr(options, "micro_batches", 4)),
            schedule=str(getattr(options, "pipeline_schedule", "1f1b")),
            partition=str(getattr(options, "pipeline_partition", "auto")),
            wire_bytes=wire,
        )
        for r in ranks[1:]:
            job_args["workers"][r]["batch"] = 0
    job_args["pipelines"] = specs


LOADER_CLAIM_AHEAD = 5
"""Batches a hybrid or async worker's loader has cut beyond the one it
computes: its read-ahead (``HDF5Loader``'s ``prefetch`` of 4 in its queue,
and the one its reader thread holds while the queue is full)."""

LOADER_WINDOWS_AHEAD = 3
"""Chunks (windows) a worker's loader has drawn beyond the one it cuts
batches from: its window reader's two queued windows and the one it has
drawn and waits to read into a free buffer
(:func:`hybridagg.data.pipeline._read_ahead`)."""

#: From this many pushes in a round (groups x servers) on, interchangeable
#: servers are simulated as a bank.
BANK_MIN_FLOWS = 4096


def bank_servers(
    nodes: list[dict[str, Any]], servers: list[dict[str, Any]], groups: int
) -> bool:
    """Whether the simulation treats ``servers`` as one bank.

    Every push goes to every server in equal shards, and every server serves
    its shards in arrival order at the same cost, so interchangeable servers
    (the same speed, on devices of nodes with the same links, none on a node
    of shared cores) see nearly the same pushes and reply nearly together.
    The engine then moves a push as one flow of the whole gradient over the
    servers' links side by side (``servers x`` their bandwidth) to one server
    actor, instead of one flow per server: a leader's exchange costs a few
    simulated events, not ``4 x servers`` (1,024 async leaders and 64
    servers: 65,536 concurrent flows became 1,024, and SimGrid re-solves the
    sharing of every concurrent flow at each flow's end). Only when a round
    of pushes is at least :data:`BANK_MIN_FLOWS` flows (``groups x
    servers``); below, each server is simulated on its own, exactly. What
    the bank drops: which server's node a leader shares (its own node's
    server is reached without the node's link; a server node's link carries
    its workers' traffic only) and that servers serve the same pushes in
    different orders (a leader waits for its last shard's server). Measured
    at 256 ranks of two-generation-1024 with 16 servers (bench/simscale.py's
    profile): async 0.4% fewer samples/s than the servers one by one, hybrid
    grouped by node 8.5% more.
    """
    if len(servers) < 2 or len(servers) * groups < BANK_MIN_FLOWS:
        return False
    first = nodes[servers[0]["node"]]
    return all(
        not nodes[s["node"]]["shared"]
        and s["speed"] == servers[0]["speed"]
        and nodes[s["node"]]["intra"] == first["intra"]
        for s in servers
    )


def _validation_seconds(
    profile: Profile, profiles: dict[str, Profile], node_type: NodeType
) -> float:
    """One validation on rank 0's node type: its own profile's, or the
    model's at the type's speed (the speed relative to the profiled device).

    A ``--slowdown`` does not stretch it: the emulation paces training
    steps, and validation runs at the machine's real speed."""
    if node_type.profile is not None:
        return profiles[node_type.profile].validation_s
    return profile.validation_s / node_type.speed


def _check_profiled_as(options: JobOptions, profile: Profile) -> None:
    """Refuse ``--amp`` and ``--device`` the profile was not measured with
    (its compute times would not be the run's)."""
    accumulate = getattr(options, "accumulate", 1)
    if (
        isinstance(accumulate, bool)
        or not isinstance(accumulate, int)
        or accumulate < 1
    ):
        raise ValueError(f"--accumulate must be an integer >= 1, got {accumulate!r}")
    amp = getattr(options, "amp", "none")
    if amp != "none" and amp != profile.machine.amp:
        raise ValueError(
            f"--amp {amp}: the profile was measured with --amp {profile.machine.amp}; "
            f"profile the model with --amp {amp} (hybridagg profile) to simulate it"
        )
    device = str(getattr(options, "device", "cpu"))
    kind = device.split(":")[0]
    if kind not in ("cpu", "auto") and kind != profile.machine.device.split(":")[0]:
        raise ValueError(
            f"--device {device}: the profile was measured on "
            f"{profile.machine.device}; profile the model on {kind} to simulate it"
        )


def _adaptive_batches(
    options: JobOptions, groups: list[list[int]], speeds: list[float]
) -> list[int]:
    """The adaptive controller's steady state: batches in proportion to speed."""
    n = len(speeds)
    batches = [options.batch_size] * n
    low, high = options.min_batch, options.max_batch
    if options.mode in ("sync", "async"):
        return proportional_batches(speeds, options.batch_size * n, low=low, high=high)
    totals = [options.batch_size * len(g) for g in groups]
    if options.adaptive_groups:
        rates = [sum(speeds[r] for r in g) for g in groups]
        lows = [low * len(g) for g in groups]
        highs = None if high is None else [high * len(g) for g in groups]
        totals = proportional_batches(rates, sum(totals), low=lows, high=highs)
    for g, total in zip(groups, totals, strict=True):
        for r, b in zip(
            g,
            proportional_batches([speeds[r] for r in g], total, low=low, high=high),
            strict=True,
        ):
            batches[r] = b
    return batches


def ring_allreduce_seconds(
    ranks: int, nbytes: float, bandwidth: float, latency: float, buckets: int = 1
) -> float:
    """The closed form of a ring all-reduce of ``nbytes`` in ``buckets``
    collectives one after another (all ready at once): each bucket pays the
    ring's ``2(n-1)`` latencies, so ``2(n-1)(buckets x latency + bytes/(n bandwidth))``."""
    if ranks <= 1:
        return 0.0
    return 2 * (ranks - 1) * (buckets * latency + nbytes / (ranks * bandwidth))
