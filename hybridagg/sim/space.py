"""The planner's search space and its cost model (pure logic).

A :class:`Candidate` is one configuration of a job on a cluster: the mode,
how many nodes of each node type it uses, how its workers are grouped, how
many servers and on which node type, and whether per-rank batches are equal
or in proportion to speed (OmniLearn's rule, which ``--adaptive-batch``
reaches at its steady state). A :class:`Space` is a product of choices per
decision; :meth:`Space.candidate` maps one choice per decision to a
canonical candidate (sync has no servers and one group; async one group per
worker), so the exact searcher and the policy share one space. The per-rank
batch (``--batch-size``) may be a decision too (``Space.batch_sizes``).

:class:`CostModel` scores a candidate: it cuts the cluster to the
candidate's nodes, resolves the candidate as ``hybridagg train``'s options
into a :class:`~.job.SimJob` (:func:`~.job.build_job`: the simulator's own
reading), and predicts it with :func:`~.analytic.estimate`; the cost per
hour is the price of the nodes it uses (worker nodes, and nodes that only
hold servers); with a convergence table (:mod:`.convergence`), its
predicted time to the target accuracy from the same estimate's group
cycles. Scores are cached: the searchers ask for the same candidate many
times.

Memory: a candidate whose device would need more than its node type's
``memory`` is dropped (it does not fit; :attr:`CostModel.memory_dropped`
counts them). A worker needs the profile's activation bytes per sample
times its batch, plus the parameters and their gradient (twice the
profile's parameter bytes), plus the optimizer's state in sync mode (one
copy of the parameters per :data:`OPTIMIZER_STATES`; in hybrid and async
the servers step the optimizer and hold its state). On a node of shared
cores ``memory`` is the node's: its workers' needs add up.

Pipelines (Ling et al.; HeterPS's layer-to-resource assignment): with
``pipelines`` ``groups``, every hybrid group of two ranks or more is a
pipeline (``--pipeline-groups``) whose ranks hold consecutive stages of the
model, cut by the exact program over the profile's units
(:mod:`.pipelines`); a stage needs only its units' parameters, so a model
too large for one device fits a group of them. Pipelined candidates are
hybrid (what the simulator models) with equal batches (a hybrid run
refuses adaptive batches with pipelines), and the space has them only when
the profile records pipeline units.

On this machine's emulation (``CostModel.workers``) a candidate's ``nodes``
is ``(k,)``: it trains on the ``k`` fastest of the emulated workers (by
``--slowdown``; the plan's own slowdown names them, renumbered from 0). The
space offers every ``k`` that keeps whole speed classes: leaving the
slowest class idle trades its samples for fresher updates, which a time
objective can find worth it (a real cluster's space chooses node counts
per node type the same way).

Groupings: ``node`` (one group per node), ``device`` (per node type),
``speed:K`` (``hybridagg.topology.speed_groups`` on the ranks' speeds) and
``split:K`` (``K`` contiguous runs of ranks as equal as can be). A plan
writes its groups as explicit rank ranges, which mean the same in any run.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field, replace
from typing import Any

from ..modes import MODES
from ..slowdown import fastest_ranks, format_slowdown, parse_slowdown
from .analytic import estimate
from .cluster import ClusterSpec, ServerPlacement
from .convergence import ConvergenceTable, time_to_target
from .job import SimJob, build_job, machine_cluster
from .profile import Profile

__all__ = [
    "BATCH_RULES",
    "OPTIMIZER_STATES",
    "PIPELINE_RULES",
    "Candidate",
    "CostModel",
    "Score",
    "Space",
    "parse_batch_choices",
]

BATCH_RULES = ("equal", "speed")
"""Per-rank batches: all ``--batch-size``, or in proportion to speed."""

PIPELINE_RULES = ("none", "groups")
"""Pipelined groups: none, or every hybrid group of several ranks."""

DEFAULT_GROUPINGS = ("node", "device", "speed:2", "speed:3", "split:2", "split:4")

OPTIMIZER_STATES = {"sgd": 1, "adam": 2, "adamw": 2}
"""Copies of the parameters an optimizer keeps (SGD's momentum; Adam's two
moments); an unknown optimizer counts as ``sgd``, ``hybridagg train``'s
default."""


@dataclass(frozen=True)
class Candidate:
    """One configuration (see the module).

    Attributes:
        mode: sync, hybrid or async.
        nodes: Nodes used of each node type that has devices (cluster
            order); on this machine's emulation, ``(k,)``: its ``k``
            fastest workers.
        grouping: ``world`` (sync), ``each`` (async), or a grouping of
            :data:`DEFAULT_GROUPINGS`' kinds (hybrid).
        servers: Parameter servers (0 in sync).
        server_type: The node type holding them (``None`` without servers).
        batches: ``equal`` or ``speed`` (:data:`BATCH_RULES`).
        batch_size: The per-rank batch (``--batch-size``; ``None``: the cost
            model's); a pipelined group's batch.
        pipelines: ``none`` or ``groups`` (:data:`PIPELINE_RULES`).
    """

    mode: str
    nodes: tuple[int, ...]
    grouping: str = "world"
    servers: int = 0
    server_type: str | None = None
    batches: str = "equal"
    batch_size: int | None = None
    pipelines: str = "none"

    def describe(self) -> str:
        """One line for people."""
        parts = [self.mode, f"nodes {list(self.nodes)}"]
        if self.mode == "hybrid":
            parts.append(f"groups {self.grouping}")
        if self.servers:
            parts.append(f"{self.servers} server(s) on {self.server_type}")
        parts.append(f"batches {self.batches}")
        if self.batch_size is not None:
            parts.append(f"batch size {self.batch_size}")
        if self.pipelines != "none":
            parts.append("groups pipelined")
        return ", ".join(parts)


@dataclass(frozen=True)
class Score:
    """A candidate's prediction and price.

    Attributes:
        samples_per_sec: Predicted samples/s.
        ideal_samples_per_sec: Its workers' compute-only rates summed.
        cost_per_hour: The price of the nodes it uses.
        time_to_target_s: Predicted seconds to the target accuracy (``None``:
            the cost model has no convergence table, or the configuration's
            updates are predicted never to reach it: every group's drift
            beyond where the table's updates still buy progress).
    """

    samples_per_sec: float
    ideal_samples_per_sec: float
    cost_per_hour: float
    time_to_target_s: float | None = None


@dataclass(frozen=True)
class Space:
    """Choices per decision (see the module).

    Attributes:
        nodes: Per node type with devices, the node counts to try.
        modes: Modes to try.
        groupings: Hybrid groupings to try.
        servers: Server counts to try (hybrid and async).
        server_types: Node types that may hold the servers.
        batches: Batch rules to try.
        batch_sizes: Per-rank batches to try (``None``: the cost model's).
        pipelines: Pipeline rules to try (:data:`PIPELINE_RULES`).
    """

    nodes: tuple[tuple[int, ...], ...]
    modes: tuple[str, ...] = MODES
    groupings: tuple[str, ...] = DEFAULT_GROUPINGS
    servers: tuple[int, ...] = (1,)
    server_types: tuple[str, ...] = ()
    batches: tuple[str, ...] = BATCH_RULES
    batch_sizes: tuple[int | None, ...] = (None,)
    pipelines: tuple[str, ...] = ("none",)

    def __post_init__(self) -> None:
        for name in (
            "modes", "groupings", "servers", "batches", "batch_sizes", "pipelines"
        ):  # fmt: skip
            if not getattr(self, name):
                raise ValueError(f"the search space needs at least one of {name}")
        if not self.nodes or any(not c for c in self.nodes):
            raise ValueError("the search space needs node counts for every node type")
        bad = [m for m in self.modes if m not in MODES]
        if bad:
            raise ValueError(f"unknown mode(s) {bad}; known: {', '.join(MODES)}")
        bad = [p for p in self.pipelines if p not in PIPELINE_RULES]
        if bad:
            raise ValueError(f"unknown pipeline rule(s) {bad}; known: {PIPELINE_RULES}")
        bad = [b for b in self.batches if b not in BATCH_RULES]
        if bad:
            raise ValueError(f"unknown batch rule(s) {bad}; known: {BATCH_RULES}")
        for g in self.groupings:
            _check_grouping(g)
        if any(k < 1 for k in self.servers):
            raise ValueError(f"server counts must be >= 1, got {self.servers}")
        if any(b is not None and b < 1 for b in self.batch_sizes):
            raise ValueError(f"batch sizes must be >= 1, got {self.batch_sizes}")

    def decisions(self) -> list[tuple[str, tuple[Any, ...]]]:
        """The factored decisions, each with its choices (the policy's actions)."""
        out: list[tuple[str, tuple[Any, ...]]] = [
            (f"nodes[{i}]", c) for i, c in enumerate(self.nodes)
        ]
        out += [
            ("mode", self.modes),
            ("grouping", self.groupings),
            ("servers", self.servers),
            ("server_type", self.server_types or (None,)),
            ("batches", self.batches),
            ("batch_size", self.batch_sizes),
            ("pipelines", self.pipelines),
        ]
        return out

    @property
    def size(self) -> int:
        """Number of raw choice combinations (before canonical duplicates go)."""
        return math.prod(len(c) for _, c in self.decisions())

    def candidate(self, choice: tuple[Any, ...]) -> Candidate:
        """The canonical candidate of one choice per decision."""
        k = len(self.nodes)
        nodes = tuple(choice[:k])
        mode, grouping, servers, server_type, batches, batch, pipes = choice[k:]
        if mode == "sync":
            return Candidate("sync", nodes, "world", 0, None, batches, batch)
        if mode == "async":
            return Candidate(mode, nodes, "each", servers, server_type, batches, batch)
        if pipes != "none":
            batches = "equal"  # (a hybrid run refuses adaptive batches with pipelines)
        return Candidate(
            mode, nodes, grouping, servers, server_type, batches, batch, pipes
        )

    def candidates_on(self, nodes: tuple[int, ...]) -> list[Candidate]:
        """Every distinct candidate on these node counts, in a fixed order."""
        seen: dict[Candidate, None] = {}
        rest = [c for _, c in self.decisions()[len(self.nodes) :]]
        for choice in itertools.product(*rest):
            seen.setdefault(self.candidate((*nodes, *choice)), None)
        return list(seen)

    def node_choices(self) -> list[tuple[int, ...]]:
        """Every combination of node counts that uses at least one node."""
        return [n for n in itertools.product(*self.nodes) if any(n)]


def parse_batch_choices(text: str | None) -> tuple[int | None, ...]:
    """``--batch-choices`` (``16,32,64``) as :attr:`Space.batch_sizes`
    (``None``: the model's ``--batch-size`` alone).

    Raises:
        ValueError: Not positive integers separated by commas.
    """
    if text is None:
        return (None,)
    try:
        sizes = tuple(sorted({int(s) for s in str(text).split(",")}))
    except ValueError:
        sizes = ()
    if not sizes or sizes[0] < 1:
        raise ValueError(
            f"--batch-choices must be positive integers with commas, got {text!r}"
        )
    return sizes


def _check_grouping(g: str) -> None:
    kind, _, arg = g.partition(":")
    if kind in ("node", "device") and not arg:
        return
    if kind in ("speed", "split") and arg.isdigit() and int(arg) >= 2:
        return
    raise ValueError(
        f"unknown grouping {g!r}: use node, device, speed:K or split:K (K >= 2)"
    )


def _split(workers: int, k: int) -> str:
    if k > workers:
        raise ValueError(f"split:{k} needs at least {k} workers, got {workers}")
    bounds = [workers * i // k for i in range(k + 1)]
    return ",".join(f"{a}-{b - 1}" for a, b in itertools.pairwise(bounds))


@dataclass(frozen=True)
class _Options:
    """``hybridagg train``'s options that a simulation reads (``JobOptions``)."""

    mode: str
    groups: str | None
    servers: int | None
    batch_size: int
    slowdown: str | None = None
    sample_ms: float = 0.0
    adaptive_batch: bool = False
    adaptive_groups: bool = False
    min_batch: int = 1
    max_batch: int | None = None
    overlap: bool = False
    stream_push: bool = False
    staleness_bound: int | None = None
    wire: str = "fp32"
    steps: int | None = 1
    epochs: int | None = None
    lookahead: bool = True  # (the run's default: a plan does not change it)
    pipeline_groups: str | None = None
    micro_batches: int = 4
    pipeline_schedule: str = "1f1b"
    pipeline_partition: str = "auto"


@dataclass
class CostModel:
    """Scores candidates on a cluster for a profile (see the module).

    Args:
        cluster: The cluster (ignored with ``workers``).
        profile: The model's profile.
        batch_size: ``--batch-size`` (per rank; the base of both batch rules).
        workers: This machine's emulation: this many workers on
            :func:`~.job.machine_cluster` (``--slowdown`` names them), the
            candidate's servers beside them; ``None`` for ``cluster``.
        slowdown: ``--slowdown`` (emulation).
        sample_ms: ``--sample-ms`` (emulation).
        wire: ``--wire``.
        optimizer: ``--optimizer`` (its state counts in a device's memory;
            ``None``: unknown, counted as SGD's).
        convergence: Updates to the target per samples per update and
            staleness: with it, each score carries its predicted time to
            the target (:func:`~.convergence.time_to_target` on the
            analytic model's group cycles).
        micro_batches: ``--micro-batches`` of pipelined groups.
    """

    cluster: ClusterSpec
    profile: Profile
    batch_size: int = 32
    workers: int | None = None
    slowdown: str | None = None
    sample_ms: float = 0.0
    wire: str = "fp32"
    optimizer: str | None = None
    convergence: ConvergenceTable | None = None
    micro_batches: int = 4
    _cache: dict[Candidate, Score | None] = field(default_factory=dict, repr=False)
    _errors: dict[Candidate, str] = field(default_factory=dict, repr=False)
    _memory: set[Candidate] = field(default_factory=set, repr=False)

    # -------------------------------------------------------------- space
    def worker_types(self) -> list[int]:
        """Indices of the node types with devices (a candidate's ``nodes``)."""
        return [i for i, t in enumerate(self.cluster.node_types) if t.devices > 0]

    def default_space(
        self,
        *,
        modes: tuple[str, ...] = MODES,
        batch_sizes: tuple[int | None, ...] = (None,),
        pipelines: bool = True,
    ) -> Space:
        """Every node count up to 8 nodes of a type (beyond: powers of two,
        every eighth of the type's nodes, and all), server counts in powers
        of two up to the placement's limit; ``batch_sizes``: per-rank
        batches to choose from (default: the model's ``batch_size``);
        ``pipelines``: pipelined groups too, where :meth:`can_pipeline`."""
        pipes = ("none",)
        if pipelines and self.can_pipeline(modes):
            pipes = ("none", "groups")
        if self.workers is not None:
            limit = max(1, self.workers // 2)
            return Space(
                nodes=(self.worker_counts(),),
                modes=modes,
                groupings=("speed:2", "speed:3", "split:2", "split:4"),
                servers=tuple(k for k in (1, 2, 3, 4) if k <= limit),
                server_types=(self.cluster.node_types[0].name,),
                batch_sizes=batch_sizes,
                pipelines=pipes,
            )
        nodes = []
        for i in self.worker_types():
            count = self.cluster.node_types[i].count
            if count <= 8:
                nodes.append(tuple(range(count + 1)))
            else:
                # powers of two for the small end, eighths for the large one
                # (a plan may want 48 of 64 nodes, not only 32 or 64)
                eighths = {count * j // 8 for j in range(1, 9)}
                powers = {2**j for j in range(count.bit_length())}
                nodes.append(tuple(sorted({0, count} | powers | eighths)))
        top = self.cluster.max_servers
        servers = tuple(sorted({top} | {2**j for j in range(top.bit_length())}))
        return Space(
            nodes=tuple(nodes),
            modes=modes,
            servers=tuple(k for k in servers if k <= top),
            server_types=self.cluster.servers.node_types,
            batch_sizes=batch_sizes,
            pipelines=pipes,
        )

    def worker_counts(self) -> tuple[int, ...]:
        """This machine's emulation: the worker counts a candidate may use,
        the fastest first, each keeping whole speed classes (only all of
        them under a slowdown that changes during the run)."""
        if self.workers is None:
            raise ValueError("worker counts belong to this machine's emulation")
        slowdown = parse_slowdown(self.slowdown)
        if slowdown.changes:
            return (self.workers,)
        factors = sorted(slowdown.factor(r) for r in range(self.workers))
        return tuple(
            k
            for k in range(1, self.workers + 1)
            if k == self.workers or factors[k] > factors[k - 1]
        )

    def slowdown_for(self, c: Candidate) -> str | None:
        """``--slowdown`` of ``c``'s job: on the emulation, its kept workers'
        factors renumbered from 0 (all of them: the spec as given)."""
        if self.workers is None or c.nodes[0] == self.workers:
            return self.slowdown
        slowdown = parse_slowdown(self.slowdown)
        kept = fastest_ranks(slowdown, self.workers, c.nodes[0])
        return (
            format_slowdown(
                {
                    i: slowdown.factor(r)
                    for i, r in enumerate(kept)
                    if slowdown.factor(r) != 1.0
                }
            )
            or None
        )

    def can_pipeline(self, modes: tuple[str, ...] = MODES) -> bool:
        """Whether pipelined candidates belong in the space: hybrid is among
        ``modes``, the profile records pipeline units, and the wire is fp32
        (a pipelined run's only one)."""
        return "hybrid" in modes and bool(self.profile.units) and self.wire == "fp32"

    # ------------------------------------------------------------ cluster
    def cluster_for(self, c: Candidate) -> ClusterSpec:
        """The cluster cut to ``c``'s nodes (nodes only for servers as needed).

        Raises:
            ValueError: ``c`` uses no worker, or its servers do not fit.
        """
        if self.workers is not None:
            (k,) = c.nodes
            if not 1 <= k <= self.workers:
                raise ValueError(
                    f"a candidate must use 1 to {self.workers} of this machine's "
                    f"workers, not {k}"
                )
            return machine_cluster(self.profile, k, c.servers)
        kept = []
        counts = dict(zip(self.worker_types(), c.nodes, strict=True))
        if not any(c.nodes):
            raise ValueError("a candidate must use at least one node of workers")
        place = self.cluster.servers.per_node
        for i, t in enumerate(self.cluster.node_types):
            if t.devices > 0:
                n = counts[i]
            elif c.servers and t.name == c.server_type:  # nodes only for servers
                n = -(-c.servers // place)
            else:
                n = 0
            if n > t.count:
                raise ValueError(f"{n} nodes of {t.name!r}: the cluster has {t.count}")
            if n:
                kept.append(replace(t, count=n))
        names = [t.name for t in kept]
        if c.servers and c.server_type not in names:
            raise ValueError(f"no node of {c.server_type!r} to hold the servers")
        where = (c.server_type,) if c.servers else (names[0],)
        return replace(
            self.cluster,
            node_types=tuple(kept),
            servers=ServerPlacement(node_types=where, per_node=place),
        )

    def cost_per_hour(self, c: Candidate) -> float:
        """The price of the nodes ``c`` uses (no simulation needed)."""
        return sum(t.count * t.price_per_hour for t in self.cluster_for(c).node_types)

    def options(self, c: Candidate, *, steps: int = 1) -> _Options:
        """``c`` as ``hybridagg train``'s options (groups as explicit ranges)."""
        workers = self.cluster_for(c).num_devices
        groups: str | None = None
        if c.mode == "hybrid":
            kind, _, arg = c.grouping.partition(":")
            groups = _split(workers, int(arg)) if kind == "split" else c.grouping
        return _Options(
            mode=c.mode,
            groups=groups,
            servers=c.servers,
            batch_size=c.batch_size or self.batch_size,
            slowdown=self.slowdown_for(c),
            sample_ms=self.sample_ms,
            adaptive_batch=c.batches == "speed",
            wire=self.wire,
            steps=steps,
            micro_batches=self.micro_batches,
        )

    def job(self, c: Candidate, *, steps: int = 1) -> SimJob:
        """The simulator's job for ``c`` (pipelined: every group of several
        ranks named by ``--pipeline-groups``).

        Raises:
            ValueError: ``c`` does not fit the cluster.
        """
        options, cluster = self.options(c, steps=steps), self.cluster_for(c)
        if c.pipelines == "groups":
            plain = build_job(options, cluster, self.profile)
            several = [g for g, ranks in enumerate(plain.groups) if len(ranks) > 1]
            if not several:
                raise ValueError(
                    f"grouping {c.grouping} has no group of several ranks to pipeline"
                )
            options = replace(options, pipeline_groups=",".join(map(str, several)))
        return build_job(options, cluster, self.profile)

    # -------------------------------------------------------------- score
    def score(self, c: Candidate) -> Score | None:
        """``c``'s predicted samples/s, ideal and cost; ``None`` if it does not
        fit (:meth:`error` says why)."""
        if c in self._cache:
            return self._cache[c]
        try:
            job = self.job(c)
            if c.mode == "hybrid" and len(job.groups) < 2:
                raise ValueError(
                    f"grouping {c.grouping} makes one group (that is sync)"
                )
            short = self._memory_shortfall(c, job)
            if short is not None:
                self._memory.add(c)
                raise ValueError(short)
            result = estimate(job)
            score: Score | None = Score(
                result.samples_per_sec,
                result.ideal_samples_per_sec,
                self.cost_per_hour(c),
                self._time_to_target(job, result.group_cycle_s),
            )
        except ValueError as exc:
            score = None
            self._errors[c] = str(exc)
        self._cache[c] = score
        return score

    def _time_to_target(self, job: SimJob, cycles: tuple[float, ...]) -> float | None:
        """Predicted seconds to the target (``None`` without a table, or
        never)."""
        if self.convergence is None:
            return None
        samples = [sum(job.workers[r]["batch"] for r in g) for g in job.groups]
        mode = "sync" if job.mode == "sync" or not job.servers else job.mode
        t = time_to_target(self.convergence, mode, samples, cycles)
        return t if math.isfinite(t) else None

    # ------------------------------------------------------------- memory
    def device_memory(self, mode: str, batch: int) -> float:
        """Bytes one worker needs for ``batch`` samples (see the module)."""
        p = self.profile
        states = OPTIMIZER_STATES.get(self.optimizer or "sgd", 1)
        state = states * p.parameter_bytes if mode == "sync" else 0.0
        return p.activation_bytes_per_sample * batch + 2 * p.parameter_bytes + state

    def stage_memory(self, spec: dict[str, Any], stage: int) -> float:
        """Bytes one stage of a pipelined group needs: its units' parameters
        and their gradient, and the activations of the micro-batches it
        holds in flight (1F1B: at most as many as stages; GPipe: all)."""
        p = self.profile
        per_param = p.parameter_bytes / p.parameters
        held = len(spec["micro"])
        if spec["schedule"] == "1f1b":
            held = min(held, len(spec["ranks"]) - stage)
        activations = p.activation_bytes_per_sample * spec["shares"][stage]
        return (
            2 * spec["parameters"][stage] * per_param
            + activations * max(spec["micro"]) * held
        )

    def _needs(self, c: Candidate, job: SimJob) -> dict[int, float]:
        """Bytes needed per node of ``job`` (a device's most, or the sum on
        shared cores)."""
        needs: dict[int, float] = {}
        stages: dict[int, float] = {}
        for spec in job.pipelines or ():
            for k, r in enumerate(spec["ranks"] if spec else ()):
                stages[r] = self.stage_memory(spec, k)
        for rank, w in enumerate(job.workers):
            n = w["node"]
            need = stages.get(rank)
            if need is None:
                need = self.device_memory(c.mode, int(w["batch"]))
            if job.nodes[n]["shared"]:
                needs[n] = needs.get(n, 0.0) + need
            else:
                needs[n] = max(needs.get(n, 0.0), need)
        return needs

    def _memory_shortfall(self, c: Candidate, job: SimJob) -> str | None:
        types = {t.name: t for t in self.cluster_for(c).node_types}
        for n, need in self._needs(c, job).items():
            node = job.nodes[n]
            memory = types[node["type"]].memory
            if memory is not None and need > memory:
                per = "node" if node["shared"] else "device"
                return (
                    f"out of memory on {node['type']}: a {per} needs "
                    f"{need / 2**30:.2f} GiB, it has {memory / 2**30:.2f} GiB"
                )
        return None

    def peak_memory(self, c: Candidate) -> float | None:
        """The most bytes one device (or node of shared cores) of ``c`` needs
        (``None``: the profile records no memory)."""
        if not (
            self.profile.parameter_bytes or self.profile.activation_bytes_per_sample
        ):
            return None
        return max(self._needs(c, self.job(c)).values())

    @property
    def memory_dropped(self) -> int:
        """Distinct candidates dropped so far for want of memory."""
        return len(self._memory)

    def error(self, c: Candidate) -> str | None:
        """Why :meth:`score` found ``c`` does not fit (``None`` if it does)."""
        return self._errors.get(c)

    @property
    def evaluated(self) -> int:
        """Distinct candidates scored so far."""
        return len(self._cache)

    def upper_bound(self, nodes: tuple[int, ...]) -> float:
        """Samples/s no candidate on these nodes can beat: their ideal (every
        worker computing, nothing else), servers left out."""
        return self.job(Candidate("sync", nodes)).ideal_samples_per_sec()

    def node_price(self, nodes: tuple[int, ...]) -> float:
        """The price of these worker nodes (a lower bound of a candidate's cost)."""
        if self.workers is not None:
            return self.cost_per_hour(Candidate("sync", nodes))
        types = self.cluster.node_types
        return sum(
            n * types[i].price_per_hour
            for i, n in zip(self.worker_types(), nodes, strict=True)
        )
