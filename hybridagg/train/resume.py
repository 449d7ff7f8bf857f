"""How a run starts with respect to its checkpoint folder: fresh, refused, or resumed.

Called on every rank before any role starts (collective over the world).
Rank 0 looks at ``--checkpoint DIR`` and decides; every decision and every
error is agreed on, so each rank starts the same run or stops with the same
message (exit 2):

* **Fresh** (no ``--resume``): the run gets a new id. If DIR already holds
  checkpoints, they are another run's: the run refuses to start unless
  ``--overwrite-checkpoints`` (their removal then happens at this run's
  first commit, :class:`~hybridagg.train.checkpoint.Checkpointer`).
* **Resume**: the candidates are the checkpoints of the run that committed
  last, newest first (:func:`~hybridagg.train.checkpoint.resume_candidates`).
  For each: its manifest must be readable and its configuration acceptable
  (:func:`~hybridagg.train.common.check_manifest`; a refused configuration
  stops the run, it does not fall back; another number of ranks, servers or
  groups is accepted and resharded, :mod:`~hybridagg.train.elastic`), then
  every rank loads the parts it needs by the reshard plan
  (:mod:`~hybridagg.train.resume_parts`: a worker its own old part or one
  made from the lowest old worker's, and every old worker's data position
  when the number of workers changed; a server the old server parts its
  shard overlaps) and the world agrees whether all did. The first that loads
  everywhere is resumed, with a warning on rank 0 naming each newer one
  that did not and why; if none loads, the run stops. The run keeps the id
  of the run it resumes.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from ..comm import Comm
from ..topology import Topology
from .checkpoint import (
    Entry,
    load_part,
    new_run_id,
    resume_candidates,
    run_of,
    scan,
)
from .common import check_manifest
from .config import TrainConfig
from .elastic import ReshardPlan
from .resume_parts import ResumedServer, ResumedWorker, resumed_server, resumed_worker

__all__ = ["Resumed", "RunStart", "start_run"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Resumed:
    """The checkpoint a run resumes from, as this rank loaded it.

    Attributes:
        path: The checkpoint directory.
        manifest: Its manifest.
        plan: How this run's ranks map to the checkpoint's (it says
            whether and how the run is resharded).
        worker: Workers: the part it continues from (``part`` ``None``:
            its group had finished; hybrid and async) and its data position.
        first: Sync workers: rank 0's part (the model and the optimizer).
        server: Servers: its old part's state, or the old parts its shard
            is rebuilt from.
    """

    path: Path
    manifest: dict
    plan: ReshardPlan
    worker: ResumedWorker | None = None
    first: dict | None = None
    server: ResumedServer | None = None

    @property
    def part(self) -> dict | None:
        """A worker's part (own, or made for it; ``None``: its group had finished)."""
        return None if self.worker is None else self.worker.part

    @property
    def number(self) -> int:
        """The checkpoint's number."""
        return int(self.manifest.get("number") or self.path.name.split("-")[1])


@dataclass(frozen=True)
class RunStart:
    """How this run starts.

    Attributes:
        run_id: The run's id (new, or the resumed run's).
        resumed: What it resumes from (``None``: a fresh start).
    """

    run_id: str
    resumed: Resumed | None = None


def _refuse_fresh(root: Path, entries: list[Entry]) -> str:
    """The message of a fresh run that finds another run's checkpoints in ``root``."""
    readable = [e for e in entries if e.manifest is not None]
    newest = (readable or entries)[-1]
    runs = {e.run for e in entries}
    who = f"run {newest.run}" if newest.run else "a run whose manifest cannot be read"
    more = f" and {len(runs) - 1} other run(s)" if len(runs) > 1 else ""
    return (
        f"checkpoint folder {root} holds checkpoints of another run ({who}, newest "
        f"{newest.path.name}{more}); pass --resume to continue that run, or "
        "--overwrite-checkpoints to start a fresh one that deletes them (or choose "
        "another --checkpoint folder)"
    )


def _plan(cfg: TrainConfig) -> tuple[str, list[tuple[str, dict | None, str | None]]]:
    """Rank 0: a new run id and the candidates to resume from, or a refusal.

    Raises:
        ValueError: A fresh run in a folder holding another run's checkpoints.
        OSError: The folder cannot be read.
    """
    if not cfg.checkpoint:
        return new_run_id(), []
    root = Path(cfg.checkpoint)
    if not cfg.resume:
        entries = scan(root)
        if entries and not cfg.overwrite_checkpoints:
            raise ValueError(_refuse_fresh(root, entries))
        return new_run_id(), []
    found = resume_candidates(root)
    return new_run_id(), [(str(e.path), e.manifest, e.error) for e in found]


def _load_mine(
    cfg: TrainConfig, topo: Topology, path: Path, manifest: dict, plan: ReshardPlan
) -> Resumed:
    """Load the parts this rank needs from ``path``, by the reshard plan.

    Raises:
        ValueError: A part is missing, truncated or corrupt.
    """
    if topo.is_server:
        server = resumed_server(
            path, manifest, plan, topo.servers.index(topo.rank), topo.num_groups
        )
        return Resumed(path, manifest, plan, server=server)
    worker = resumed_worker(
        path,
        manifest,
        plan,
        topo.rank,
        sync=cfg.mode == "sync",
        group=topo.group,
        seed=cfg.seed,
    )
    first = None
    if cfg.mode == "sync":
        # rank 0 is old worker 0 at any size: its part holds the model
        own = worker.part if topo.rank == 0 else None
        first = own if own is not None else load_part(path, 0)
        if first is None or "model" not in first:
            raise ValueError(f"checkpoint {path} has no part for rank 0")
    return Resumed(path, manifest, plan, worker, first)


def _agree(world: Comm, error: BaseException | None, what: str) -> None:
    """``world.check``, but a ``ValueError`` found alike on every rank is reported once, as rank 0's."""
    world.check(error if world.rank == 0 or error is None else None, what=what)


def start_run(cfg: TrainConfig, topo: Topology) -> RunStart:
    """Decide, on every rank alike, whether this run starts fresh or resumes what.

    Raises:
        ValueError: A fresh run in a folder of another run's checkpoints, a
            refused configuration change, or no checkpoint that loads; the
            same error on every rank.
    """
    world = topo.comms.world
    err, plan = None, None
    if world.rank == 0:
        try:
            plan = _plan(cfg)
        except (ValueError, OSError) as exc:
            err = exc
    world.check(err, what="checkpoint folder")
    run_id, candidates = world.bcast(plan, 0, what="checkpoints to resume from")
    if not cfg.resume or not candidates:
        return RunStart(run_id)
    failed: list[tuple[str, str]] = []
    for path_s, manifest, error in candidates:
        path = Path(path_s)
        if manifest is None:  # the same verdict everywhere: rank 0 read it
            failed.append((path.name, error or "unreadable manifest"))
            continue
        err, accepted, plan = None, [], None
        try:
            accepted, plan = check_manifest(manifest, cfg, topo, path)
        except ValueError as exc:
            err = exc
        _agree(world, err, "checkpoint's configuration")
        err, resumed = None, None
        try:
            resumed = _load_mine(cfg, topo, path, manifest, plan)
        except ValueError as exc:
            err = str(exc)
        errors = world.allgather(err, what=f"loading checkpoint {path.name}")
        bad = [(r, e) for r, e in enumerate(errors) if e is not None]
        if not bad:
            if world.rank == 0:
                _tell(path, run_of(manifest), failed, accepted, plan)
            return RunStart(run_of(manifest), resumed)
        rank, reason = bad[0]
        failed.append((path.name, f"rank {world.world_rank_of(rank)}: {reason}"))
    tried = "; ".join(f"{name}: {why}" for name, why in failed)
    err = ValueError(f"no checkpoint in {cfg.checkpoint} can be resumed: {tried}")
    _agree(world, err, "checkpoint to resume from")  # raises on every rank
    raise err  # not reached: kept for readers and type checkers


def _tell(
    path: Path,
    run: str,
    failed: list[tuple[str, str]],
    accepted,
    plan: ReshardPlan,
) -> None:
    """Rank 0: warn about checkpoints passed over, note accepted changes and resharding."""
    for name, why in failed:
        log.warning(
            "hybridagg train: warning: checkpoint %s cannot be resumed (%s); "
            "resuming from %s, the previous checkpoint of run %s",
            name,
            why,
            path.name,
            run,
        )
    if accepted:
        log.warning(
            "hybridagg train: resuming %s with a changed configuration: %s",
            path.name,
            "; ".join(map(str, accepted)),
        )
    if plan.changed:
        old, new = plan.old, plan.new
        log.warning(
            "hybridagg train: resuming %s resharded: %d workers, %d servers, groups "
            "%s before; %d workers, %d servers, groups %s now",
            path.name,
            old.workers,
            old.servers,
            [list(g) for g in old.groups],
            new.workers,
            new.servers,
            [list(g) for g in new.groups],
        )
