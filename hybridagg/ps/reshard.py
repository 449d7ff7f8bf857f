"""Rebuilding a server's shard from a checkpoint written by another number of servers.

A checkpoint holds one part per server: the weights of its range of the flat
model, the state of the optimizer of each of its parts, its version and the
updates of each group (:meth:`hybridagg.ps.store.ShardStore.state`). When a
run resumes with ``K'`` servers from a checkpoint of ``K``, new server ``s``
reads the old parts whose ranges overlap its own (:func:`shard_overlaps`;
the cut of :func:`~hybridagg.ps.shards.shard_ranges` is part of the
checkpoint format) and copies, element by element, its weights and every
per-element optimizer state (momentum buffers, Adam's moments) into its own
range; per-piece scalar states (Adam's ``step``) are taken from the old
pieces it overlaps, which all hold the same value because every server
applies every push (:func:`reshard_shard`). Each old piece's place in the
flat model comes from :func:`~hybridagg.ps.shards.optimizer_order`, the
order the store builds its optimizers in.

What is global stays: the version (every server applied the same pushes up
to the consistent cut), the checkpoint number, server 0's floating buffers
(old server 0 always overlaps new server 0: both start at element 0).
What is per group is mapped by :func:`group_state`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .shards import optimizer_order, part_ranges, shard_ranges
from .spec import ServerSpec

__all__ = [
    "OldShard",
    "ShardSource",
    "group_state",
    "reshard_map",
    "reshard_shard",
    "shard_overlaps",
]


def shard_overlaps(
    old_ranges: Sequence[tuple[int, int]], lo: int, hi: int
) -> list[tuple[int, int, int]]:
    """Which old shards hold which elements of the new range ``[lo, hi)``.

    Args:
        old_ranges: Each old shard's ``(start, stop)`` in the flat model.
        lo: First element of the new range.
        hi: One past its last element.

    Returns:
        ``(old shard, start, stop)`` for each old shard that overlaps, in
        order; the pieces cover ``[lo, hi)`` exactly.

    Raises:
        ValueError: The old shards do not cover ``[lo, hi)`` exactly once
            (another model, or ranges that are not a cut of it).
    """
    out = []
    for s, (a, b) in enumerate(old_ranges):
        start, stop = max(a, lo), min(b, hi)
        if start < stop:
            out.append((s, start, stop))
    pos = lo
    for _, start, stop in sorted(out, key=lambda t: t[1]):
        if start != pos:
            break
        pos = stop
    if pos != hi or sum(b - a for _, a, b in out) != hi - lo:
        raise ValueError(
            f"the checkpoint's shards {list(old_ranges)} do not cover the elements "
            f"[{lo}, {hi}) exactly once (a checkpoint of another model?)"
        )
    return out


def reshard_map(
    total: int, old_servers: int, new_servers: int
) -> list[list[tuple[int, int, int]]]:
    """For each new shard, the old shards it is rebuilt from (:func:`shard_overlaps`).

    Args:
        total: Elements of the flat model.
        old_servers: Servers that wrote the checkpoint.
        new_servers: Servers of the resumed run.
    """
    old = shard_ranges(total, old_servers)
    return [shard_overlaps(old, lo, hi) for lo, hi in shard_ranges(total, new_servers)]


@dataclass(frozen=True)
class OldShard:
    """One old server's saved shard, with where each of its pieces lies.

    Attributes:
        range: ``(start, stop)`` of the shard in the flat model.
        layout: Per part, the flat-model range of each optimizer parameter
            in the order of that part's ``state_dict``.
        state: The saved shard (``flat``, ``buffers``, ``optimizers``).
    """

    range: tuple[int, int]
    layout: list[list[tuple[int, int]]]
    state: dict


def _is_per_element(value: Any, length: int) -> bool:
    # a piece's parameter is a 1-D view of the shard: a state shaped like it
    # is per element; 0-dim tensors and numbers (Adam's step) are per piece
    return torch.is_tensor(value) and value.dim() >= 1 and value.numel() == length


def _same(a: Any, b: Any) -> bool:
    if torch.is_tensor(a) and torch.is_tensor(b):
        return a.shape == b.shape and bool(torch.equal(a, b))
    return a == b


class _Gathered:
    """The old optimizer states that fall into ``[lo, hi)``, element by element."""

    def __init__(self, lo: int, hi: int) -> None:
        self.lo, self.hi = lo, hi
        self.elements: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self.scalars: dict[str, list[tuple[int, int, Any]]] = {}

    def add(self, key: str, value: Any, start: int, stop: int, a: int, b: int) -> None:
        """State ``key`` of the old piece ``[start, stop)``, of which ``[a, b)`` is ours."""
        if _is_per_element(value, stop - start):
            if key not in self.elements:
                n = self.hi - self.lo
                self.elements[key] = (
                    torch.zeros(n, dtype=value.dtype),
                    torch.zeros(n, dtype=torch.bool),
                )
            data, seen = self.elements[key]
            data[a - self.lo : b - self.lo] = value.reshape(-1)[a - start : b - start]
            seen[a - self.lo : b - self.lo] = True
        else:
            self.scalars.setdefault(key, []).append((a, b, value))

    def piece(self, start: int, stop: int) -> dict:
        """The state of a new piece ``[start, stop)``.

        Raises:
            ValueError: A state covers the piece only in part, or its old
                pieces disagree on a per-piece value.
        """
        out: dict[str, Any] = {}
        i, j = start - self.lo, stop - self.lo
        for key, (data, seen) in self.elements.items():
            covered = seen[i:j]
            if bool(covered.all()):
                out[key] = data[i:j].clone()
            elif bool(covered.any()):
                raise ValueError(
                    f"optimizer state {key!r} covers the elements [{start}, {stop}) "
                    "only in part: the checkpoint's servers disagree"
                )
        for key, segments in self.scalars.items():
            values = [v for a, b, v in segments if a < stop and start < b]
            if not values:
                continue
            if any(not _same(values[0], v) for v in values[1:]):
                raise ValueError(
                    f"optimizer state {key!r} differs between the old pieces of the "
                    f"elements [{start}, {stop}): {values}"
                )
            value = values[0]
            out[key] = value.clone() if torch.is_tensor(value) else value
        return out


def reshard_shard(
    olds: Sequence[OldShard],
    lo: int,
    hi: int,
    layout: Sequence[Sequence[tuple[int, int]]],
    param_groups: Sequence[list[dict] | None],
) -> dict:
    """The shard ``[lo, hi)`` rebuilt from old shards, in the new store's layout.

    Args:
        olds: The old shards that overlap ``[lo, hi)`` (any order).
        lo: First element of the new shard.
        hi: One past its last element.
        layout: The new store's layout (:attr:`~hybridagg.ps.store.ShardStore.layout`).
        param_groups: Each new part's fresh ``param_groups`` (``None``: a
            part without an optimizer).

    Returns:
        A shard state as :meth:`~hybridagg.ps.store.ShardStore.state` writes
        it, for :meth:`~hybridagg.ps.store.ShardStore.load`.

    Raises:
        ValueError: The old shards do not cover the range, or their states
            do not fit their layout.
    """
    ranges = [o.range for o in olds]
    shard_overlaps(ranges, lo, hi)  # covered exactly once, or a clear error
    flat: torch.Tensor | None = None
    buffers = None
    gathered = _Gathered(lo, hi)
    for old in olds:
        olo, ohi = old.range
        saved = old.state["flat"].reshape(-1)
        if saved.numel() != ohi - olo:
            raise ValueError(
                f"a checkpointed shard of [{olo}, {ohi}) holds {saved.numel()} elements"
            )
        if flat is None:
            flat = torch.empty(hi - lo, dtype=saved.dtype)
        a, b = max(lo, olo), min(hi, ohi)
        flat[a - lo : b - lo] = saved[a - olo : b - olo]
        if olo == 0 and lo == 0:
            buffers = old.state.get("buffers")
        saved_opts = old.state["optimizers"]
        if len(saved_opts) != len(old.layout):
            raise ValueError(
                f"the checkpointed shard of [{olo}, {ohi}) has {len(saved_opts)} "
                f"optimizer states for {len(old.layout)} parts"
            )
        for sd, pieces in zip(saved_opts, old.layout, strict=True):
            if sd is None:
                continue
            listed = sum(len(g["params"]) for g in sd["param_groups"])
            if listed != len(pieces):
                raise ValueError(
                    f"a checkpointed optimizer state lists {listed} parameters, its "
                    f"part of [{olo}, {ohi}) has {len(pieces)} pieces"
                )
            for index, per_param in sd["state"].items():
                start, stop = pieces[int(index)]
                a, b = max(lo, start), min(hi, stop)
                if a >= b:
                    continue
                for key, value in per_param.items():
                    gathered.add(key, value, start, stop, a, b)
    optimizers: list[dict | None] = []
    for pieces, groups in zip(layout, param_groups, strict=True):
        if groups is None:
            optimizers.append(None)
            continue
        state = {}
        for index, (start, stop) in enumerate(pieces):
            per_param = gathered.piece(start, stop)
            if per_param:
                state[index] = per_param
        optimizers.append({"state": state, "param_groups": groups})
    return {"flat": flat, "buffers": buffers, "optimizers": optimizers}


def group_state(saved: dict, num_groups: int, groups_changed: bool) -> dict:
    """The per-group part of a server's saved state, for a run with ``num_groups`` groups.

    A server keeps, per group, the number of updates it applied (the
    staleness bound compares them) and which groups have finished. When the
    groups of the resumed run are the ones that wrote the checkpoint, both
    are kept. When they are not, a new group is none of the old ones (its
    members came from several, or are new), so no old count means anything
    for it: every group starts at 0 updates, which puts every group level
    under the staleness bound (it bounds differences, and the global
    version, which compensation and the update budget use, is kept), and no
    group counts as finished (the workers of finished groups saved no part,
    so the new groups continue from the running ones').

    Args:
        saved: The old server's saved state.
        num_groups: Groups of the resumed run.
        groups_changed: The resumed run's groups differ from the checkpoint's.

    Returns:
        ``{"updates_per_leader": list | None, "done": list}`` (``None``:
        every group at 0).

    Raises:
        ValueError: The groups are said to be the same but their number differs.
    """
    if groups_changed:
        return {"updates_per_leader": None, "done": []}
    updates = [int(u) for u in saved["updates_per_leader"]]
    if len(updates) != num_groups:
        raise ValueError(
            f"the checkpoint counts updates of {len(updates)} groups, this run has "
            f"{num_groups}"
        )
    return {"updates_per_leader": updates, "done": list(saved.get("done", []))}


@dataclass(frozen=True)
class ShardSource:
    """A checkpoint written by another number of servers, to rebuild a shard from.

    Args:
        servers: Servers that wrote it.
        load: ``load(s)``: old server ``s``'s saved state (what
            :func:`~hybridagg.ps.server.serve` gave ``on_snapshot``).
        groups_changed: The resumed run's groups differ from the checkpoint's
            (see :func:`group_state`).
        elements: Elements of the flat model the checkpoint was written
            for (``None``: not recorded); a model of another size is refused
            with a clear message.
    """

    servers: int
    load: Callable[[int], dict]
    groups_changed: bool
    elements: int | None = None

    def restore(self, spec: ServerSpec, store, num_groups: int) -> dict:
        """This server's state rebuilt from the old parts it overlaps.

        Args:
            spec: This server's start-up settings (its range, the model's layout).
            store: Its fresh :class:`~hybridagg.ps.store.ShardStore`.
            num_groups: Groups of the resumed run.

        Returns:
            A state as the server saves it, for the usual restore.

        Raises:
            ValueError: The checkpoint does not fit this model.
        """
        total = sum(spec.numels)
        if self.elements is not None and self.elements != total:
            raise ValueError(
                f"the checkpoint holds a model of {self.elements} elements, this "
                f"run's model has {total} (another model?)"
            )
        if total < self.servers:
            raise ValueError(
                f"the checkpoint has {self.servers} shards of a {total}-element model"
            )
        old_ranges = shard_ranges(total, self.servers)
        lo, hi = spec.shard_range
        olds, first = [], None
        for s, _, _ in shard_overlaps(old_ranges, lo, hi):
            saved = self.load(s)
            shard = saved["shard"]
            rng = tuple(int(v) for v in shard.get("range", old_ranges[s]))
            if rng != old_ranges[s]:
                raise ValueError(
                    f"old server {s}'s shard is {list(rng)}, a cut of this model into "
                    f"{self.servers} gives {list(old_ranges[s])} (another model?)"
                )
            # checkpoints before this module recorded no cut into parts: it
            # was then this run's (the same HYBRIDAGG_PS_PART_BYTES)
            parts = shard.get("parts") or part_ranges(rng[1] - rng[0], spec.part_elems)
            layout = [
                [
                    r
                    for _, ranges in optimizer_order(
                        spec.numels, spec.group_of, rng[0] + a, rng[0] + b
                    )
                    for r in ranges
                ]
                for a, b in parts
            ]
            olds.append(OldShard(rng, layout, shard))
            first = first if first is not None else saved
        state = reshard_shard(olds, lo, hi, store.layout, store.fresh_param_groups())
        return {
            "checkpoint": int(first["checkpoint"]),
            "version": int(first["version"]),
            **group_state(first, num_groups, self.groups_changed),
            "shard": state,
        }
