"""The share policy: which part of each epoch this worker reads, and how it resumes.

Two policies behind one interface (:class:`SharePolicy`), chosen by the
loader's ``shares=``:

* :class:`StaticShares` (sync mode): one contiguous piece of the epoch's
  stream per worker, sized by batch size so that every worker takes the same
  number of steps (:func:`~hybridagg.data.shares.split_static`). Changing
  batch sizes and saving a position are collective.
* :class:`DynamicShares` (hybrid and async modes): windows drawn on demand
  from a counter shared by all workers; a fast worker takes more. Changing
  batch sizes and saving a position are local; resuming is collective.

A policy also owns the workers' batch sizes and the one-element "batch box"
the reader thread reads its next batch size from.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Protocol

from .position import (
    DynamicTrack,
    PassPosition,
    Piece,
    counter_pieces,
    merge_states,
    reshard_dynamic,
    snapshot,
)
from .shares import (
    EpochPlan,
    Interval,
    LocalCounter,
    WindowCounter,
    drop_prefix,
    reshard_static,
    resplit_static,
    split_static,
)

__all__ = ["DynamicShares", "SharePolicy", "StaticShares", "checked_batch_sizes"]


def checked_batch_sizes(
    batch_sizes: Sequence[int], workers: int, *, parked: bool = False
) -> list[int]:
    """``batch_sizes`` as ints, one positive entry per worker.

    Args:
        batch_sizes: The sizes.
        workers: How many entries there must be.
        parked: Allow 0 (a parked worker: static shares hand it empty
            batches) while some entry is positive.

    Raises:
        ValueError: Another number of entries, or an entry below 1 (below
            0, or none positive, with ``parked``).
    """
    sizes = [int(b) for b in batch_sizes]
    low = 0 if parked else 1
    if len(sizes) != workers or min(sizes) < low or max(sizes) < 1:
        what = "non-negative entries, one positive," if parked else "positive entries"
        raise ValueError(
            f"batch_sizes needs {workers} {what} (one per worker), got {sizes}"
        )
    return sizes


def _check_kind(state: dict, kind: str) -> None:
    found = state.get("kind")
    if found != kind:
        raise ValueError(
            f"loader state is for {found!r} shares, this loader has {kind!r}"
        )


class SharePolicy(Protocol):
    """What the loader asks of a share policy.

    Attributes:
        kind: ``"static"`` or ``"dynamic"`` (the loader's ``shares``).
        batch_sizes: Every worker's batch size, in worker order.
        batch_box: ``[this worker's batch size]``, shared with the reader.
    """

    kind: str
    batch_sizes: list[int]
    batch_box: list[int]

    def steps_per_epoch(self) -> int | None:
        """Steps of a whole epoch, where every worker takes the same number."""

    def begin_pass(self, plan: EpochPlan, epoch: int) -> None:
        """Decide this worker's part of ``plan`` (epoch ``epoch``)."""

    def pieces(self, plan: EpochPlan) -> Iterable[Piece]:
        """This worker's ``(window, lo, hi)`` pieces of the pass, in order."""

    def pass_steps(self) -> int | None:
        """Batches every worker returns this pass (``None``: not fixed)."""

    def collective_calls(self, plan: EpochPlan) -> int:
        """Window reads of the longest share (every worker makes this many)."""

    def batches_left(self, position: PassPosition) -> int | None:
        """Batches this worker still returns this pass, if known."""

    def set_batch_sizes(
        self, batch_sizes: Sequence[int], position: PassPosition
    ) -> bool:
        """New batch sizes; ``True`` when the pass's pieces were cut again."""

    def moves_on_when_abandoned(self, epoch: int) -> bool:
        """Whether a pass over ``epoch`` left midway counts as that epoch."""

    def state_dict(self, position: PassPosition, epoch: int) -> dict:
        """Where this worker is (plain numbers and lists)."""

    def load_state_dict(self, state: dict) -> int:
        """Continue from :meth:`state_dict`'s result; returns the epoch."""

    def load_resharded(self, states: Sequence[dict]) -> int:
        """Continue from every old worker's state, saved by another number of workers."""

    def free(self) -> None:
        """Release what the policy holds (collective where it holds MPI)."""


class StaticShares:
    """Contiguous shares by batch size; owns this pass's shares and a pending resume.

    Args:
        comm: The workers' :class:`hybridagg.comm.Comm`, or ``None``.
        rank: This worker's index.
        workers: Number of workers.
        total: Samples of an epoch.
        batch_sizes: Every worker's batch size.
        drop_last: Leave out the final partial step.
    """

    kind = "static"

    def __init__(
        self,
        *,
        comm: Any,
        rank: int,
        workers: int,
        total: int,
        batch_sizes: Sequence[int],
        drop_last: bool,
    ) -> None:
        self.comm, self.rank, self.workers = comm, rank, workers
        self.total, self.drop_last = total, drop_last
        self.batch_sizes = [int(b) for b in batch_sizes]
        self.batch_box = [self.batch_sizes[rank]]
        self._shares: list[list[Interval]] = []
        self._steps = 0
        self._resume: tuple[list[list[Interval]], int] | None = None

    def steps_per_epoch(self) -> int:
        return split_static(
            [(0, self.total)], self.batch_sizes, drop_last=self.drop_last
        )[1]

    def begin_pass(self, plan: EpochPlan, epoch: int) -> None:
        if self._resume is not None:
            self._shares, self._steps = self._resume
            self._resume = None
        else:
            self._shares, self._steps = split_static(
                [(0, plan.total)], self.batch_sizes, drop_last=self.drop_last
            )

    def pieces(self, plan: EpochPlan) -> list[Piece]:
        return list(plan.pieces(self._shares[self.rank]))

    def pass_steps(self) -> int:
        return self._steps

    def collective_calls(self, plan: EpochPlan) -> int:
        # every worker computes every share, so all agree on the count
        return max(len({g for g, _, _ in plan.pieces(s)}) for s in self._shares)

    def batches_left(self, position: PassPosition) -> int | None:
        if not position.active:
            return None
        return int(self._steps - position.steps)

    def set_batch_sizes(
        self, batch_sizes: Sequence[int], position: PassPosition
    ) -> bool:
        """Collective: the unread rest of every share is pooled and cut again
        (a size of 0 parks its worker: empty batches until it gets a size)."""
        sizes = checked_batch_sizes(batch_sizes, self.workers, parked=True)
        mine = (sizes, position.consumed)
        views = (
            self.comm.allgather(mine, what="set_batch_sizes") if self.comm else [mine]
        )
        if any(v[0] != sizes for v in views):
            raise ValueError(
                f"set_batch_sizes got different lists on different workers: "
                f"{[v[0] for v in views]}"
            )
        self.batch_sizes = sizes
        self.batch_box[0] = sizes[self.rank]
        if not position.active:
            return False
        self._shares, self._steps = resplit_static(
            self._shares, [v[1] for v in views], sizes, drop_last=self.drop_last
        )
        return True

    def moves_on_when_abandoned(self, epoch: int) -> bool:
        return False

    def state_dict(self, position: PassPosition, epoch: int) -> dict:
        """Collective: every worker returns the unread rest of every share."""
        if not position.active:
            return {"kind": "static", "epoch": epoch, "shares": None}
        mine = (position.consumed, position.steps)
        views = (
            self.comm.allgather(mine, what="loader position") if self.comm else [mine]
        )
        shares = [
            [list(iv) for iv in drop_prefix(share, consumed)]
            for share, (consumed, _) in zip(self._shares, views, strict=True)
        ]
        return {
            "kind": "static",
            "epoch": epoch,
            "shares": shares,
            "steps_left": int(self._steps - views[0][1]),
            "batch_sizes": list(self.batch_sizes),
        }

    def load_state_dict(self, state: dict) -> int:
        _check_kind(state, self.kind)
        epoch = int(state["epoch"])
        if state.get("shares") is None:
            self._resume = None
            return epoch
        if len(state["shares"]) != self.workers:
            raise ValueError(
                f"loader state has {len(state['shares'])} workers, this job {self.workers}"
            )
        self.batch_sizes = [int(b) for b in state["batch_sizes"]]
        self.batch_box[0] = self.batch_sizes[self.rank]
        shares = [[tuple(iv) for iv in share] for share in state["shares"]]
        self._resume = (shares, int(state["steps_left"]))
        return epoch

    def load_resharded(self, states: Sequence[dict]) -> int:
        """Local: the unread rest of the old shares is cut for these workers.

        Every old worker saved the same state (saving is collective), so the
        first is taken. The old workers' batch sizes (adaptive batching may
        have moved them) mean nothing for other workers: the rest is cut by
        this loader's batch sizes (:func:`~hybridagg.data.shares.reshard_static`).
        """
        if not states:
            raise ValueError("no loader states to resume from")
        state = states[0]
        _check_kind(state, self.kind)
        epoch = int(state["epoch"])
        if state.get("shares") is None:
            self._resume = None
            return epoch
        shares = [[tuple(iv) for iv in share] for share in state["shares"]]
        self._resume = reshard_static(
            shares, self.batch_sizes, drop_last=self.drop_last
        )
        return epoch

    def free(self) -> None:
        """Nothing to free."""


class DynamicShares:
    """Windows drawn from a shared counter; owns the counter and the draw bookkeeping.

    Creating it is collective over ``comm`` (the counter's MPI window).

    Args:
        comm: The workers' :class:`hybridagg.comm.Comm`, or ``None`` (a
            counter in this process).
        rank: This worker's index.
        workers: Number of workers.
        batch_sizes: Every worker's batch size (only this worker's is used).
        n_windows: Windows of an epoch.
        epoch: First epoch.
        counter: The counter to draw from (``None``: an MPI window over
            ``comm``, or a local counter without one).
    """

    kind = "dynamic"

    def __init__(
        self,
        *,
        comm: Any,
        rank: int,
        workers: int,
        batch_sizes: Sequence[int],
        n_windows: int,
        epoch: int,
        counter: Any = None,
    ) -> None:
        self.comm, self.rank, self.workers = comm, rank, workers
        self.batch_sizes = [int(b) for b in batch_sizes]
        self.batch_box = [self.batch_sizes[rank]]
        if counter is None:
            counter = WindowCounter(comm) if comm else LocalCounter()
        self.counter: Any = counter
        self.track = DynamicTrack(n_windows=n_windows, epoch=epoch)

    def steps_per_epoch(self) -> None:
        return None

    def begin_pass(self, plan: EpochPlan, epoch: int) -> None:
        self.track.start_epoch(epoch)

    def pieces(self, plan: EpochPlan) -> Iterable[Piece]:
        # a module function, not a method: the reader thread must not hold
        # the policy (and through it nothing else of the loader)
        return counter_pieces(self.track, plan, self.counter)

    def pass_steps(self) -> None:
        return None

    def collective_calls(self, plan: EpochPlan) -> int:
        return 0  # workers draw different numbers of windows: never collective

    def batches_left(self, position: PassPosition) -> None:
        return None  # other workers may still take chunks

    def set_batch_sizes(
        self, batch_sizes: Sequence[int], position: PassPosition
    ) -> bool:
        """Local: only this worker's entry is used, from the next batch cut."""
        sizes = checked_batch_sizes(batch_sizes, self.workers)
        self.batch_box[0] = sizes[self.rank]
        self.batch_sizes = sizes
        return False

    def moves_on_when_abandoned(self, epoch: int) -> bool:
        # the shared counter has moved on, so the next pass is the next epoch
        # (chunks left of this one are skipped)
        return self.track.epoch == epoch

    def state_dict(self, position: PassPosition, epoch: int) -> dict:
        """Local: any moment will do, also while other workers run on."""
        track = self.track
        with track.lock:
            if not position.active and track.epoch != epoch:
                track.epoch, track.yielded = epoch, []
            consumed = position.consumed if position.active else 0
            state = snapshot(track, consumed, self.counter.read())
        state["kind"] = "dynamic"
        state["epoch"] = epoch
        return state

    def load_state_dict(self, state: dict) -> int:
        """Collective: chunks no worker's state accounts for are handed out again."""
        _check_kind(state, self.kind)
        states = (
            self.comm.allgather(state, what="loader resume") if self.comm else [state]
        )
        carry, epochs, counter = merge_states(states)
        self.counter.set(counter)
        track = self.track
        with track.lock:
            track.carry, track.stash, track.taken = carry[self.rank], None, []
            track.epoch, track.yielded = epochs[self.rank], []
        return epochs[self.rank]

    def load_resharded(self, states: Sequence[dict]) -> int:
        """Collective (the counter): the pieces no old worker consumed are dealt anew.

        Every worker passes the same states, so every worker computes the
        same deal (:func:`~hybridagg.data.position.reshard_dynamic`) and
        takes its own share of it.
        """
        if not states:
            raise ValueError("no loader states to resume from")
        for state in states:
            _check_kind(state, self.kind)
            if int(state["n_windows"]) != self.track.n_windows:
                raise ValueError(
                    f"loader state has {state['n_windows']} windows per epoch, this "
                    f"loader {self.track.n_windows} (another window_blocks?)"
                )
        carry, epoch, counter = reshard_dynamic(states, self.workers)
        self.counter.set(counter)
        track = self.track
        with track.lock:
            track.carry, track.stash, track.taken = carry[self.rank], None, []
            track.epoch, track.yielded = epoch, []
        return epoch

    def free(self) -> None:
        """Free the counter (collective over the workers)."""
        if self.counter is not None:
            self.counter.free()
            self.counter = None
