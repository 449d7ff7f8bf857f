"""The plan file: what ``hybridagg plan`` chose, as ``hybridagg train``'s options.

A JSON object (``format: hybridagg-plan``, version 1) with at least
``mode``, ``groups`` (world ranks of each group), ``servers``,
``batch_sizes`` (per worker rank, at the adaptive controller's steady state
when ``adaptive_batch``), ``predicted_samples_per_sec``,
``ideal_samples_per_sec`` and ``cost_per_hour``; also ``ranks`` (workers
and servers: ``mpiexec -n``), ``nodes`` used per node type, ``train_args``
(the same choice as ``hybridagg train`` flags) and, when the simulator
confirmed it, ``simulated_samples_per_sec``. Pure logic.
"""

from __future__ import annotations

import json
from dataclasses import MISSING, asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # types only: reading a plan (the launcher) needs no planner
    from .space import Candidate, CostModel, Score

__all__ = ["FORMAT", "Plan", "groups_spec", "load_plan", "make_plan"]

FORMAT = "hybridagg-plan"
VERSION = 1


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
    sync_samples_per_sec: float | None = None
    """sync on every node with equal batches, for comparison"""
    simulated_samples_per_sec: float | None = None
    evaluated: int = 0

    def train_args(self) -> list[str]:
        """The plan as ``hybridagg train`` flags."""
        args = ["--mode", self.mode, "--batch-size", str(self.batch_size)]
        if self.mode == "hybrid":
            args += ["--groups", groups_spec(self.groups)]
        if self.mode != "sync":
            args += ["--servers", str(self.servers)]
        if self.adaptive_batch:
            args.append("--adaptive-batch")
        return args

    def settings(self) -> dict[str, Any]:
        """The plan as ``hybridagg train``'s configuration fields (``--plan``)."""
        return {
            "mode": self.mode,
            "groups": groups_spec(self.groups) if self.mode == "hybrid" else None,
            "servers": self.servers,
            "batch_size": self.batch_size,
            "adaptive_batch": self.adaptive_batch,
        }

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
) -> Plan:
    """The plan of candidate ``c`` (scored ``score``) under ``model``."""
    job = model.job(c)
    cluster = model.cluster_for(c)
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
        batch_size=model.batch_size,
        adaptive_batch=c.batches == "speed",
        batch_sizes=[int(w["batch"]) for w in job.workers],
        predicted_samples_per_sec=score.samples_per_sec,
        ideal_samples_per_sec=score.ideal_samples_per_sec,
        cost_per_hour=score.cost_per_hour,
        evaluated=evaluated,
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
            f"plan file {path}: version {data.get('version')!r}, expected {VERSION}"
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
    if len(plan.batch_sizes) != plan.workers or any(
        not isinstance(b, int) or b < 1 for b in plan.batch_sizes
    ):
        raise ValueError(
            f"{where}: batch_sizes must be one positive integer per worker"
        )
    if (plan.mode == "sync") != (plan.servers == 0):
        raise ValueError(f"{where}: sync has no servers; hybrid and async need some")
