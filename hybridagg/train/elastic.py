"""Resuming at another size: which old parts each new rank continues from (pure logic).

A checkpoint records the topology that wrote it (``world_size``,
``servers``, ``groups`` in its manifest). A run resumed with another
topology is accepted and *resharded*: :func:`reshard_plan` compares the two
and says what each new rank continues from. Workers are world ranks
``0..W-1`` and servers the last ``K`` ranks, so worker ``j`` is world rank
``j`` and server ``s`` world rank ``W + s`` in either run:

* New worker ``j < W_old`` continues from old worker ``j``'s part (its RNG
  and counters); a worker that did not exist, or whose old group had
  finished and saved none, continues from the lowest old worker's part
  with an RNG derived from ``(seed, checkpoint, j)`` (:func:`worker_part`).
* The data position: with the same number of workers each continues from
  its own saved position; with another number every worker reads every old
  worker's position and the loader divides what none of them consumed
  (:meth:`hybridagg.data.HDF5Loader.load_resharded_state`). The epoch's
  sample order stays the old run's (its ``window_blocks``).
* The servers: with the same number, server ``s`` loads old server ``s``'s
  part; with another number each rebuilds its shard from the old parts it
  overlaps (:mod:`hybridagg.ps.reshard`). Per-group state is kept when the
  groups are the same and reset otherwise
  (:func:`hybridagg.ps.reshard.group_state` says why).
* Sync: rank 0's part holds the model and optimizer, read by every rank at
  any size.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

__all__ = [
    "Layout",
    "ReshardPlan",
    "derived_seed",
    "reshard_plan",
    "worker_part",
]


@dataclass(frozen=True)
class Layout:
    """The sizes of a run that checkpoints and resumes: ranks, servers, groups.

    Attributes:
        world_size: Ranks of the job.
        servers: Parameter servers (the last ranks).
        groups: Each group's worker ranks (one group of every worker in sync).
    """

    world_size: int
    servers: int
    groups: tuple[tuple[int, ...], ...]

    @property
    def workers(self) -> int:
        """Worker ranks (``0..workers-1``)."""
        return self.world_size - self.servers

    @classmethod
    def of(cls, topo) -> Layout:
        """The layout of a :class:`~hybridagg.topology.Topology`."""
        return cls(
            topo.world_size,
            len(topo.servers),
            tuple(tuple(int(r) for r in g) for g in topo.groups),
        )

    @classmethod
    def from_manifest(cls, manifest: dict, path: Path | str = "checkpoint") -> Layout:
        """The layout a checkpoint's manifest records.

        Raises:
            ValueError: The manifest lacks it or it is inconsistent.
        """
        try:
            layout = cls(
                int(manifest["world_size"]),
                int(manifest["servers"]),
                tuple(tuple(int(r) for r in g) for g in manifest["groups"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(
                f"checkpoint {path} does not record its ranks, servers and groups "
                f"({type(exc).__name__}: {exc})"
            ) from None
        ranks = sorted(r for g in layout.groups for r in g)
        if layout.workers < 1 or ranks != list(range(layout.workers)):
            raise ValueError(
                f"checkpoint {path} records groups {layout.as_dict()['groups']} that "
                f"are not its {layout.workers} workers"
            )
        return layout

    def as_dict(self) -> dict:
        """Plain numbers and lists (the summary and metrics record them)."""
        return {
            "world_size": self.world_size,
            "workers": self.workers,
            "servers": self.servers,
            "groups": [list(g) for g in self.groups],
        }


@dataclass(frozen=True)
class ReshardPlan:
    """How a resumed run's ranks map to the checkpoint's.

    Attributes:
        old: The layout that wrote the checkpoint.
        new: The resumed run's layout.
        checkpoint: The checkpoint's number (it seeds derived RNG states).
    """

    old: Layout
    new: Layout
    checkpoint: int = 0

    @property
    def changed(self) -> bool:
        """The layouts differ: something is resharded."""
        return self.old != self.new

    @property
    def workers_changed(self) -> bool:
        """Another number of workers: the data position is divided anew."""
        return self.old.workers != self.new.workers

    @property
    def servers_changed(self) -> bool:
        """Another number of servers: every shard is rebuilt."""
        return self.old.servers != self.new.servers

    @property
    def groups_changed(self) -> bool:
        """Other groups: per-group state is reset."""
        return self.old.groups != self.new.groups

    def old_worker_rank(self, worker: int) -> int | None:
        """The old rank whose part new worker ``worker`` continues (``None``: it is new)."""
        return worker if worker < self.old.workers else None

    def old_server_rank(self, server: int) -> int:
        """The world rank old server ``server`` had."""
        if not 0 <= server < self.old.servers:
            raise ValueError(
                f"the checkpoint has {self.old.servers} servers, not a server {server}"
            )
        return self.old.workers + server

    def record(self) -> dict | None:
        """What the summary and metrics say about it (``None``: nothing changed)."""
        if not self.changed:
            return None
        return {"from": self.old.as_dict(), "to": self.new.as_dict()}


def reshard_plan(
    old_manifest: dict, new: Layout, path: Path | str = "checkpoint"
) -> ReshardPlan:
    """Compare a checkpoint's layout with the resumed run's.

    Any number of ranks, servers and any groups may resume any checkpoint of
    the same mode; only the mapping changes.

    Args:
        old_manifest: The checkpoint's manifest.
        new: The resumed run's layout.
        path: The checkpoint (named in errors).

    Raises:
        ValueError: The manifest does not record a valid layout, or a mode
            with servers meets one without (the mode check names it first).
    """
    old = Layout.from_manifest(old_manifest, path)
    if (old.servers == 0) != (new.servers == 0):
        raise ValueError(
            f"checkpoint {path} was written with {old.servers} servers; this run has "
            f"{new.servers} (sync and server modes keep different state)"
        )
    return ReshardPlan(old, new, int(old_manifest.get("number", 0)))


def derived_seed(seed: int, checkpoint: int, worker: int) -> int:
    """The RNG seed of a worker that resumes without a state of its own.

    Deterministic in ``(seed, checkpoint, worker)``, different for every
    worker and every checkpoint, and independent of the old run's states.

    Returns:
        A seed in ``[0, 2**63)``.
    """
    words = np.random.SeedSequence([int(seed), int(checkpoint), int(worker)])
    return int(words.generate_state(1, dtype=np.uint64)[0] >> np.uint64(1))


_COUNTERS = (
    "step",
    "epochs_done",
    "train_time_s",
    "time_to_target_s",
    "updates_to_target",
    "updates",
)


def worker_part(
    plan: ReshardPlan, worker: int, own: dict | None, reference: dict, seed: int
) -> dict:
    """The part a new worker continues from, when it has none of its own.

    Its counters (steps, epochs, training time, updates, the data's
    ``window_blocks``, the fp16 loss scale) are the reference worker's: in sync they are the
    same on every worker, and elsewhere the lowest running worker's stand
    for the run. Its RNG is not copied (two workers drawing the same
    numbers would not be independent) but marked to be derived
    (:func:`derived_seed`); its data position is not here: the loader
    divides the old positions (see the module docstring).

    Args:
        plan: The plan.
        worker: The new worker's index.
        own: Its own old part, if it has one (returned unchanged).
        reference: The lowest old worker's part.
        seed: The run's ``--seed``.
    """
    if own is not None:
        return own
    part = {k: reference[k] for k in _COUNTERS if k in reference}
    for key in ("window_blocks", "loss_scale"):  # (--amp fp16: the scale goes on)
        if key in reference:
            part[key] = reference[key]
    part["rng_seed"] = derived_seed(seed, plan.checkpoint, worker)
    return part
