"""The plan file: what ``hybridagg plan`` chose, as ``hybridagg train``'s options.

A JSON object (``format: hybridagg-plan``, version 2) with at least
``mode``, ``groups`` (world ranks of each group), ``servers``,
``batch_sizes`` (per worker rank, at the adaptive controller's steady state
when ``adaptive_batch``), ``predicted_samples_per_sec``,
``ideal_samples_per_sec`` and ``cost_per_hour``; also ``ranks`` (workers
and servers: ``mpiexec -n``), ``nodes`` used per node type, ``train_args``
(the same choice as ``hybridagg train`` flags), ``sync_samples_per_sec``
(the best synchronous all-reduce configuration, for comparison) and, when
the simulator confirmed it, ``simulated_samples_per_sec`` (the rate over
the second half of the simulated updates); under
``--objective time``, ``predicted_time_to_target_s`` (and the best sync
configuration's, ``sync_time_to_target_s``) at the validation cadence of
the convergence table it used (``eval_every``). A plan with pipelined groups
names them (``pipeline_groups``: group indices, ``--pipeline-groups``) with
its ``micro_batches`` and the predicted cut of each (``pipeline_bounds``:
unit bounds per pipelined group, what the run's own program is expected to
choose); the first stage of a pipeline carries the group's batch in
``batch_sizes``, its other stages 0.

It also records what the prediction was scored under, so that a run can
be held to it: ``wire``, ``slowdown``, ``sample_ms`` and ``optimizer``
(``hybridagg train``'s options of those names; ``--plan`` applies them and
refuses a flag that disagrees), ``rank_nodes`` (the node of each world
rank, workers then servers: the rank-to-node order the groups and the
servers' placement assume; ``hybridagg-run --plan --cluster`` compares it
with the emulated cluster's), ``server_type``, ``cluster_file``, and
digests of the cluster and the profile (``cluster_digest``,
``profile_digest``: the first 16 hex digits of the SHA-256 of their
canonical JSON; the cluster's without the name of the file it was read
from) with a ``profile_summary``. ``hybridagg simulate --plan --cluster``
holds the cluster file to that digest and simulates the plan's nodes of it
(:func:`plan_cluster`). Pure logic.
"""

from __future__ import annotations

import hashlib
import itertools
import json
from collections.abc import Sequence
from dataclasses import MISSING, asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # types only: reading a plan (the launcher) needs no planner
    from .cluster import ClusterSpec
    from .job import SimJob
    from .profile import Profile
    from .space import Candidate, CostModel, Score

__all__ = [
    "FORMAT",
    "Plan",
    "cluster_digest",
    "digest",
    "groups_spec",
    "job_rank_nodes",
    "layout_conflict",
    "load_plan",
    "make_plan",
    "plan_cluster",
]

FORMAT = "hybridagg-plan"
VERSION = 2


def digest(data: Any) -> str:
    """The first 16 hex digits of the SHA-256 of ``data``'s canonical JSON."""
    text = json.dumps(data, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def cluster_digest(cluster: ClusterSpec) -> str:
    """The digest of a cluster as a plan records it: the file's name is left
    out (the same description read from another path is the same cluster)."""
    return digest({**asdict(cluster), "source": ""})


def job_rank_nodes(job: SimJob) -> list[str]:
    """The node of each world rank of ``job``, workers then servers."""
    nodes = [job.nodes[w["node"]]["name"] for w in job.workers]
    return nodes + [job.nodes[s["node"]]["name"] for s in job.servers]


def groups_spec(groups: list[list[int]]) -> str:
    """Explicit rank lists as a ``--groups`` string (``0-3,4+6``)."""
    out = []
    for g in groups:
        runs: list[str] = []
        start = prev = g[0]
        for r in [*g[1:], None]:
            if r is not None and r == prev + 1:
                prev = r
                continue
            runs.append(str(start) if start == prev else f"{start}-{prev}")
            if r is not None:
                start = prev = r
        out.append("+".join(runs))
    return ",".join(out)


@dataclass(frozen=True)
class Plan:
    """A chosen configuration and its predictions (see the module)."""

    cluster: str
    objective: str
    min_samples_per_sec: float | None
    searcher: str
    mode: str
    nodes: dict[str, int]
    ranks: int
    workers: int
    groups: list[list[int]]
    servers: int
    batch_size: int
    adaptive_batch: bool
    batch_sizes: list[int]
    predicted_samples_per_sec: float
    ideal_samples_per_sec: float
    cost_per_hour: float
    wire: str
    slowdown: str | None
    sample_ms: float
    optimizer: str | None
    """the optimizer the profile's server times were measured with (``None``:
    the profile does not say)"""
    rank_nodes: list[str]
    """the node of each world rank, workers then servers"""
    server_type: str | None
    cluster_file: str | None
    cluster_digest: str
    profile_digest: str
    profile_summary: dict[str, Any]
    peak_memory_bytes: float | None = None
    """the largest memory one device needs (``None``: no memory figures)"""
    sync_samples_per_sec: float | None = None
    """the best synchronous all-reduce configuration's prediction, for comparison"""
    sync_cost_per_hour: float | None = None
    predicted_time_to_target_s: float | None = None
    """seconds to the target accuracy the convergence table predicts (``None``:
    planned without one)"""
    sync_time_to_target_s: float | None = None
    eval_every: int | None = None
    """the validation cadence (``--eval-every``) the time to the target was
    predicted at: the convergence table's (``None``: no table)"""
    simulated_samples_per_sec: float | None = None
    evaluated: int = 0
    memory_dropped: int = 0
    """configurations the planner dropped: over a node type's memory"""
    pipeline_groups: list[int] = field(default_factory=list)
    """the groups that are pipelines (``--pipeline-groups``); empty: none"""
    micro_batches: int = 4
    """``--micro-batches`` of the pipelined groups"""
    pipeline_bounds: list[list[int]] = field(default_factory=list)
    """each pipelined group's predicted cut (unit bounds), in its order"""

    def train_args(self) -> list[str]:
        """The plan as ``hybridagg train`` flags."""
        args = ["--mode", self.mode, "--batch-size", str(self.batch_size)]
        if self.mode == "hybrid":
            args += ["--groups", groups_spec(self.groups)]
        if self.mode != "sync":
            args += ["--servers", str(self.servers)]
        if self.adaptive_batch:
            args.append("--adaptive-batch")
        if self.wire != "fp32":
            args += ["--wire", self.wire]
        if self.slowdown:
            args += ["--slowdown", self.slowdown]
        if self.sample_ms:
            args += ["--sample-ms", f"{self.sample_ms:g}"]
        if self.optimizer is not None:
            args += ["--optimizer", self.optimizer]
        if self.pipeline_groups:
            args += [
                "--pipeline-groups",
                ",".join(map(str, self.pipeline_groups)),
                "--micro-batches",
                str(self.micro_batches),
            ]
        return args

    def settings(self) -> dict[str, Any]:
        """The plan as ``hybridagg train``'s configuration fields (``--plan``):
        what it chose and what it was scored under."""
        out = {
            "mode": self.mode,
            "groups": groups_spec(self.groups) if self.mode == "hybrid" else None,
            "servers": self.servers,
            "batch_size": self.batch_size,
            "adaptive_batch": self.adaptive_batch,
            "wire": self.wire,
            "slowdown": self.slowdown,
            "sample_ms": self.sample_ms,
        }
        if self.optimizer is not None:
            out["optimizer"] = self.optimizer
        # a plan pins whether groups are pipelines, and how (what its
        # prediction assumed: the schedule and partition the cost model used)
        out["pipeline_groups"] = (
            ",".join(map(str, self.pipeline_groups)) if self.pipeline_groups else None
        )
        if self.pipeline_groups:
            out["micro_batches"] = self.micro_batches
            out["pipeline_schedule"] = "1f1b"
            out["pipeline_partition"] = "auto"
        return out

    def as_dict(self) -> dict[str, Any]:
        """The file's JSON object."""
        return {
            "format": FORMAT,
            "version": VERSION,
            **asdict(self),
            "train_args": self.train_args(),
        }

    def save(self, path: str | Path) -> Path:
        """Write the plan file."""
        path = Path(path)
        path.write_text(json.dumps(self.as_dict(), indent=2) + "\n")
        return path


def make_plan(
    model: CostModel,
    c: Candidate,
    score: Score,
    *,
    objective: str,
    min_samples_per_sec: float | None,
    searcher: str,
    evaluated: int = 0,
    cluster_file: str | None = None,
) -> Plan:
    """The plan of candidate ``c`` (scored ``score``) under ``model``."""
    job = model.job(c)
    cluster = model.cluster_for(c)
    profile = model.profile
    return Plan(
        cluster=model.cluster.name,
        objective=objective,
        min_samples_per_sec=min_samples_per_sec,
        searcher=searcher,
        mode=c.mode,
        nodes={t.name: t.count for t in cluster.node_types},
        ranks=len(job.workers) + len(job.servers),
        workers=len(job.workers),
        groups=[list(g) for g in job.groups],
        servers=len(job.servers),
        batch_size=c.batch_size or model.batch_size,
        adaptive_batch=c.batches == "speed",
        batch_sizes=[int(w["batch"]) for w in job.workers],
        predicted_samples_per_sec=score.samples_per_sec,
        ideal_samples_per_sec=score.ideal_samples_per_sec,
        cost_per_hour=score.cost_per_hour,
        predicted_time_to_target_s=score.time_to_target_s,
        eval_every=(
            None if model.convergence is None else model.convergence.eval_every
        ),
        wire=model.wire,
        slowdown=model.slowdown_for(c),
        sample_ms=float(model.sample_ms),
        optimizer=model.optimizer,
        rank_nodes=job_rank_nodes(job),
        server_type=c.server_type if c.servers else None,
        cluster_file=cluster_file,
        cluster_digest=cluster_digest(model.cluster),
        profile_digest=digest(profile.as_dict()),
        profile_summary={
            "model": profile.model,
            "parameters": profile.parameters,
            "sample_seconds": profile.sample_seconds,
            "device": profile.machine.device,
        },
        peak_memory_bytes=model.peak_memory(c),
        evaluated=evaluated,
        pipeline_groups=[g for g, p in enumerate(job.pipelines) if p is not None],
        micro_batches=model.micro_batches,
        pipeline_bounds=[list(p["bounds"]) for p in job.pipelines if p is not None],
    )


def layout_conflict(plan: Plan, hosts: Sequence[str]) -> str | None:
    """Why ranks placed on ``hosts`` (one host name per world rank) break the
    plan's rank-to-node order (``None``: they keep it).

    The names may differ (the plan's ``fast0`` is a real host's name): the
    ranks the plan puts on one node must share one host, and ranks on
    different nodes must not.
    """
    if len(hosts) != len(plan.rank_nodes):
        return (
            f"{len(hosts)} ranks, but the plan places {len(plan.rank_nodes)} "
            f"(mpiexec -n {plan.ranks})"
        )
    to_host: dict[str, str] = {}
    to_node: dict[str, str] = {}
    for rank, (node, host) in enumerate(zip(plan.rank_nodes, hosts, strict=True)):
        if to_host.setdefault(node, host) != host:
            return (
                f"rank {rank} is on host {host}, but the plan puts it on node "
                f"{node} with ranks on host {to_host[node]}"
            )
        if to_node.setdefault(host, node) != node:
            return (
                f"rank {rank} (plan node {node}) shares host {host} with ranks "
                f"of plan node {to_node[host]}"
            )
    return None


def plan_cluster(
    plan: Plan, cluster: ClusterSpec, profile: Profile, path: str | Path
) -> ClusterSpec:
    """The nodes of ``cluster`` that ``plan`` (read from ``path``) uses, cut
    as the planner cut them (:meth:`~.space.CostModel.cluster_for`: the
    plan's nodes of each type, its servers on its ``server_type``).

    Raises:
        ValueError: ``cluster`` is not the one the plan was made for (its
            digest differs, or the plan is for this machine's emulation),
            naming both.
    """
    from .space import Candidate, CostModel

    mine = cluster_digest(cluster)
    if mine != plan.cluster_digest:
        made_for = (
            f"cluster {plan.cluster} ({plan.cluster_file}, digest {plan.cluster_digest})"
            if plan.cluster_file
            else f"{plan.cluster} (no cluster file: simulate it without --cluster)"
        )
        raise ValueError(
            f"--plan {path} was made for {made_for}, but --cluster {cluster.source} "
            f"describes {cluster.name} (digest {mine}); give the plan's cluster "
            f"file, or plan again for this one"
        )
    model = CostModel(cluster, profile)
    types = cluster.node_types
    nodes = tuple(plan.nodes.get(types[i].name, 0) for i in model.worker_types())
    return model.cluster_for(
        Candidate(plan.mode, nodes, servers=plan.servers, server_type=plan.server_type)
    )


def load_plan(path: str | Path) -> Plan:
    """Read and check a plan file.

    Raises:
        ValueError: A missing or unreadable file, another format, a missing
            or bad field; the message names the file and the field.
    """
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"plan file {path} does not exist") from None
    except (OSError, ValueError) as exc:
        raise ValueError(f"plan file {path} cannot be read as JSON: {exc}") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ValueError(f"plan file {path} is not a {FORMAT} file (no format field)")
    if data.get("version") != VERSION:
        raise ValueError(
            f"plan file {path}: version {data.get('version')!r}, expected "
            f"{VERSION} (run hybridagg plan again: version 1 did not record what "
            f"its prediction assumed)"
        )
    fields = {k: v for k, v in data.items() if k in Plan.__dataclass_fields__}
    missing = [
        k
        for k, f in Plan.__dataclass_fields__.items()
        if k not in fields and f.default is MISSING and f.default_factory is MISSING
    ]
    if missing:
        raise ValueError(f"plan file {path}: missing field(s) {', '.join(missing)}")
    plan = Plan(**fields)
    _check(plan, path)
    return plan


def _check(plan: Plan, path: Path) -> None:
    where = f"plan file {path}"
    if plan.mode not in ("sync", "hybrid", "async"):
        raise ValueError(
            f"{where}: mode must be sync, hybrid or async, got {plan.mode!r}"
        )
    groups = plan.groups
    if not isinstance(groups, list) or not all(
        isinstance(g, list) and g and all(isinstance(r, int) for r in g) for g in groups
    ):
        raise ValueError(f"{where}: groups must be lists of world ranks")
    flat = sorted(r for g in groups for r in g)
    if flat != list(range(plan.workers)):
        raise ValueError(
            f"{where}: groups must hold every worker rank 0..{plan.workers - 1} once"
        )
    if plan.ranks != plan.workers + plan.servers:
        raise ValueError(f"{where}: ranks must be workers + servers")
    _check_pipelines(plan, where)
    later_stages = {r for g in plan.pipeline_groups for r in groups[g][1:]}
    if len(plan.batch_sizes) != plan.workers or any(
        not isinstance(b, int) or b < (0 if r in later_stages else 1)
        for r, b in enumerate(plan.batch_sizes)
    ):
        raise ValueError(
            f"{where}: batch_sizes must be one positive integer per worker "
            "(0 for a pipeline's later stages)"
        )
    if (plan.mode == "sync") != (plan.servers == 0):
        raise ValueError(f"{where}: sync has no servers; hybrid and async need some")
    if not isinstance(plan.rank_nodes, list) or len(plan.rank_nodes) != plan.ranks:
        raise ValueError(f"{where}: rank_nodes must name the node of every rank")
    if not isinstance(plan.sample_ms, (int, float)) or plan.sample_ms < 0:
        raise ValueError(f"{where}: sample_ms must be a number >= 0")
    for name in ("wire", "cluster_digest", "profile_digest"):
        if not isinstance(getattr(plan, name), str):
            raise ValueError(f"{where}: {name} must be a string")


def _check_pipelines(plan: Plan, where: str) -> None:
    """The pipelined groups of a plan, as ``hybridagg train`` would take them."""
    from ..pipeline.groups import layout_conflicts  # (reading a plan stays light)

    named, groups = plan.pipeline_groups, plan.groups
    if not isinstance(named, list) or not all(
        isinstance(g, int) and not isinstance(g, bool) and 0 <= g < len(groups)
        for g in named
    ):
        raise ValueError(f"{where}: pipeline_groups must be a list of group indices")
    if len(set(named)) != len(named):
        raise ValueError(f"{where}: pipeline_groups repeats a group")
    if not named:
        return
    if plan.mode != "hybrid":
        raise ValueError(f"{where}: pipeline_groups are planned in hybrid mode only")
    if plan.adaptive_batch:
        raise ValueError(f"{where}: pipeline_groups do not go with adaptive_batch")
    lone, wide = layout_conflicts(groups, named)
    wrong = sorted(lone + wide)
    if wrong:
        raise ValueError(
            f"{where}: pipeline_groups must name exactly the groups of several "
            f"ranks (groups {wrong} disagree)"
        )
    m = plan.micro_batches
    if isinstance(m, bool) or not isinstance(m, int) or m < 1:
        raise ValueError(f"{where}: micro_batches must be an integer >= 1")
    bounds = plan.pipeline_bounds
    if not isinstance(bounds, list) or len(bounds) != len(named):
        raise ValueError(f"{where}: pipeline_bounds needs one cut per pipelined group")
    for g, cut in zip(named, bounds, strict=True):
        if (
            not isinstance(cut, list)
            or len(cut) != len(groups[g]) + 1
            or not all(isinstance(b, int) and not isinstance(b, bool) for b in cut)
            or cut[0] != 0
            or any(a >= b for a, b in itertools.pairwise(cut))
        ):
            raise ValueError(
                f"{where}: pipeline_bounds of group {g} must be increasing unit "
                f"bounds from 0, one more than its {len(groups[g])} ranks"
            )
