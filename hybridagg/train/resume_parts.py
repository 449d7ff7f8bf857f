"""What a rank continues from: the parts of a checkpoint it reads, at any size.

Both readers follow the :class:`~hybridagg.train.elastic.ReshardPlan` and
run inside :func:`~hybridagg.train.resume.start_run`'s agreed loading, so a
part that is missing or does not load makes the whole world fall back to
the run's previous checkpoint, resharded or not.

* :func:`resumed_worker`: a worker's own old part when it has one, the
  lowest old worker's part for a worker that has none (see
  :func:`~hybridagg.train.elastic.worker_part`), and, when the number of
  workers changed, every old worker's data position (the loader divides
  what none of them consumed).
* :func:`resumed_server`: with the checkpoint's number of servers, server
  ``s``'s old part; with another, every old part its new shard overlaps,
  read now and handed to :func:`~hybridagg.ps.server.serve` as a
  :class:`~hybridagg.ps.reshard.ShardSource` (the shard is rebuilt there,
  where the model's layout is known). Which old parts overlap follows from
  the flat model's size, which the manifest records (``elements``); a
  checkpoint that does not record it has every old server part read. Only
  a model of another size than the checkpoint's (a ``--model`` change let
  through by ``--accept-config-changes``) is found later, in ``serve``, and
  stops the job there instead of falling back, as at the same size.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..ps.reshard import ShardSource, group_state, reshard_map
from .checkpoint import load_part
from .elastic import ReshardPlan, worker_part

__all__ = [
    "ResumedServer",
    "ResumedWorker",
    "resumed_server",
    "resumed_worker",
]


@dataclass
class ResumedWorker:
    """What a worker continues from.

    Attributes:
        part: Its part (own, or made from the lowest old worker's);
            ``None``: its group had finished (hybrid, async).
        window_blocks: The checkpoint's blocks per loader window (``None``:
            a checkpoint that did not record it).
        loader_state: Its own saved data position (same number of workers);
            ``None``: none of its own.
        loader_states: Every old worker's data position (another number of
            workers; ``None`` where an old worker saved none), else ``None``.
    """

    part: dict | None
    window_blocks: int | None
    loader_state: dict | None = None
    loader_states: list[dict | None] | None = None


def _lowest(resume: Path, old_workers: int) -> dict | None:
    for rank in range(old_workers):
        part = load_part(resume, rank)
        if part is not None:
            return part
    return None


def resumed_worker(
    resume: Path,
    manifest: dict,
    plan: ReshardPlan,
    worker: int,
    *,
    sync: bool,
    group: int,
    seed: int,
) -> ResumedWorker:
    """Read what worker ``worker`` continues from.

    Args:
        resume: The checkpoint.
        manifest: Its manifest.
        plan: How this run maps to it.
        worker: This worker's index (its world rank).
        sync: Sync mode (every worker saved a part).
        group: This worker's group in the resumed run.
        seed: The run's ``--seed`` (derived RNG states).

    Raises:
        ValueError: A part is missing or unreadable.
    """
    old_rank = plan.old_worker_rank(worker)
    own = load_part(resume, old_rank) if old_rank is not None else None
    if sync and old_rank is not None and own is None:
        # every sync worker saves a part: one missing is a damaged checkpoint
        raise ValueError(f"checkpoint {resume} has no part for rank {old_rank}")
    reference = own if own is not None else _lowest(resume, plan.old.workers)
    window_blocks = None
    if reference is not None and "window_blocks" in reference:
        window_blocks = int(reference["window_blocks"])
    if reference is None:
        if sync:
            raise ValueError(f"checkpoint {resume} has no part for rank 0")
        # every old group had finished: so has this run
        return ResumedWorker(None, window_blocks)
    if own is None and not plan.groups_changed:
        # the same groups: a group that had finished stays finished
        done = manifest.get("done_groups", [])
        if sync or group not in done:
            raise ValueError(f"checkpoint {resume} has no part for rank {worker}")
        return ResumedWorker(None, window_blocks)
    part = worker_part(plan, worker, own, reference, seed)
    if not plan.workers_changed:
        if own is not None:
            return ResumedWorker(part, window_blocks, loader_state=own["loader"])
        # its old group had finished and the groups changed: it holds
        # nothing, and draws from the shared counter in the running epoch
        ref = reference["loader"]
        idle = {"kind": ref["kind"], "epoch": ref["epoch"], "carry": [], "taken": []}
        idle.update(counter=None, n_windows=ref["n_windows"])
        return ResumedWorker(part, window_blocks, loader_state=idle)
    if sync:
        # saving a static position is collective: every part holds the same
        states = [reference["loader"]]
    else:
        states = [
            (p or {}).get("loader")
            for p in (
                own if r == old_rank else load_part(resume, r)
                for r in range(plan.old.workers)
            )
        ]
    return ResumedWorker(part, window_blocks, loader_states=states)


@dataclass(frozen=True)
class ResumedServer:
    """What a server continues from (exactly one of the two is set).

    Attributes:
        state: Its old part's state, per-group counts mapped
            (:func:`~hybridagg.ps.reshard.group_state`): the checkpoint's
            number of servers.
        shards: The old parts its shard is rebuilt from, already read:
            another number of servers.
    """

    state: dict | None = None
    shards: ShardSource | None = None


def _server_state(resume: Path, plan: ReshardPlan, server: int) -> dict:
    """Old server ``server``'s saved state.

    Raises:
        ValueError: Its part is missing or does not load.
    """
    rank = plan.old_server_rank(server)
    part = load_part(resume, rank)
    if part is None or "server" not in part:
        raise ValueError(f"checkpoint {resume} has no part for server rank {rank}")
    return part["server"]


def resumed_server(
    resume: Path, manifest: dict, plan: ReshardPlan, server: int, num_groups: int
) -> ResumedServer:
    """Read what server ``server`` (its index among the servers) continues from.

    Args:
        resume: The checkpoint.
        manifest: Its manifest.
        plan: How this run maps to it.
        server: This server's index.
        num_groups: Groups of the resumed run.

    Raises:
        ValueError: A part it needs is missing or does not load, or the
            manifest's model size cannot be cut into the old shards.
    """
    if not plan.servers_changed:
        state = _server_state(resume, plan, server)
        return ResumedServer(
            state={**state, **group_state(state, num_groups, plan.groups_changed)}
        )
    elements = manifest.get("elements")
    if isinstance(elements, int) and elements >= max(
        plan.old.servers, plan.new.servers
    ):
        pieces = reshard_map(elements, plan.old.servers, plan.new.servers)[server]
        needed = sorted({s for s, _, _ in pieces})
    else:  # a checkpoint that does not record the model's size
        elements, needed = None, list(range(plan.old.servers))
    loaded = {s: _server_state(resume, plan, s) for s in needed}

    def load(s: int) -> dict:
        if s not in loaded:  # only with a model of another size (refused first)
            raise ValueError(
                f"checkpoint {resume}: old server {s}'s part was not read for this "
                "model (another model?)"
            )
        return loaded[s]

    return ResumedServer(
        shards=ShardSource(plan.old.servers, load, plan.groups_changed, elements)
    )
