"""Where a loader is in its data, and how it resumes (pure logic).

:class:`PassPosition` counts what this worker has handed to the training
loop in the pass being iterated; static shares resume from it directly (the
unread rest of every share, see :mod:`hybridagg.data.share_policy`).

Dynamic shares hand out *chunks* (windows) from one counter shared by all
workers that runs across epochs: value ``c`` is window ``c mod W`` of epoch
``c div W`` (``W`` windows per epoch). No worker ever waits for another at an
epoch boundary: a worker whose draw falls into the next epoch keeps that
chunk (the *stash*) for its next pass and ends its current one, while slower
workers finish the chunks that remain. Every chunk of an epoch is still
handed out exactly once.

A checkpoint records, per worker and without any collective (groups in
hybrid and async modes save at different moments): the pieces it holds but
has not consumed, the counter values it has drawn recently, and the
counter's value when it saved. On resume (:func:`merge_states`), chunks that
some worker drew *after* its own snapshot but before the last worker's (so
no snapshot accounts for them) are found as the gaps in ``[min counter, max
counter)`` and handed out again; the counter continues from the maximum.
Nothing is lost; a chunk is read twice only if a checkpoint's snapshots span
more than an epoch.

A run resumed with another number of workers (:func:`reshard_dynamic`)
merges the old workers' states the same way, then deals every piece no old
worker consumed to the new workers; the counter continues from where it was.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "DynamicTrack",
    "PassPosition",
    "Piece",
    "counter_pieces",
    "merge_states",
    "remaining_pieces",
    "reshard_dynamic",
    "snapshot",
]

Piece = tuple[int, int, int]  # window, first row, end row (of its permutation)
# (epoch, window, first row, end row); end -1: to the end of the window
Carried = tuple[int, int, int, int]


@dataclass
class PassPosition:
    """How far this worker is into the pass being iterated.

    Attributes:
        active: A pass is being iterated.
        consumed: Samples handed to the loop since the pass began, or since
            its shares were last cut again (new batch sizes).
        steps: Batches handed out over the same span.
    """

    active: bool = False
    consumed: int = 0
    steps: int = 0

    def start(self) -> None:
        """A pass begins."""
        self.active, self.consumed, self.steps = True, 0, 0

    def advance(self, samples: int) -> None:
        """A batch of ``samples`` went to the loop."""
        self.consumed += samples
        self.steps += 1

    def recut(self) -> None:
        """The unread rest was cut again: count from here."""
        self.consumed, self.steps = 0, 0

    def stop(self) -> None:
        """The pass ended (or was abandoned)."""
        self.active = False


@dataclass
class DynamicTrack:
    """A worker's bookkeeping of the chunks it draws (shared with its reader thread)."""

    n_windows: int
    epoch: int = 0
    stash: int | None = None
    taken: list[int] = field(default_factory=list)
    yielded: list[Piece] = field(default_factory=list)
    carry: list[Carried] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def start_epoch(self, epoch: int) -> None:
        """Begin a pass over ``epoch``; forget draws older than the epoch before."""
        with self.lock:
            self.epoch = int(epoch)
            self.yielded = []
            floor = (self.epoch - 1) * self.n_windows
            self.taken = [c for c in self.taken if c >= floor]
            self.carry = [c for c in self.carry if c[0] >= self.epoch]


def _next_piece(track: DynamicTrack, plan: Any, counter: Any) -> Piece | None:
    for i, (e, g, lo, hi) in enumerate(track.carry):
        if e == track.epoch:
            del track.carry[i]
            return g, lo, plan.window_size(g) if hi < 0 else hi
    if track.stash is not None:
        e, g = divmod(track.stash, track.n_windows)
        if e > track.epoch:
            return None
        track.stash = None
        return g, 0, plan.window_size(g)
    while True:
        c = counter.fetch_add()
        e, g = divmod(c, track.n_windows)
        track.taken.append(c)
        if e < track.epoch:
            continue  # a chunk of an epoch this worker abandoned
        if e > track.epoch:
            track.stash = c
            return None
        return g, 0, plan.window_size(g)


def counter_pieces(track: DynamicTrack, plan: Any, counter: Any) -> Iterator[Piece]:
    """The pieces of ``track.epoch`` this worker reads: carried ones, then drawn ones."""
    while True:
        with track.lock:
            piece = _next_piece(track, plan, counter)
            if piece is None:
                return
            track.yielded.append(piece)
        yield piece


def remaining_pieces(pieces: Sequence[Piece], consumed: int) -> list[Piece]:
    """``pieces`` without their first ``consumed`` rows."""
    out = []
    for g, lo, hi in pieces:
        if consumed >= hi - lo:
            consumed -= hi - lo
            continue
        out.append((g, lo + consumed, hi))
        consumed = 0
    return out


def snapshot(track: DynamicTrack, consumed: int, counter_value: int) -> dict:
    """This worker's position (call with ``track.lock`` held)."""
    carry = [
        (track.epoch, g, lo, hi)
        for g, lo, hi in remaining_pieces(track.yielded, consumed)
    ]
    carry += list(track.carry)
    if track.stash is not None:
        e, g = divmod(track.stash, track.n_windows)
        carry.append((e, g, 0, -1))
    return {
        "epoch": track.epoch,
        "carry": carry,
        "taken": sorted(set(track.taken)),
        "counter": int(counter_value),
        "n_windows": track.n_windows,
    }


def merge_states(states: Sequence[dict]) -> tuple[list[list[Carried]], list[int], int]:
    """Every worker's carried pieces and epoch on resume, and the counter's value.

    Args:
        states: One :func:`snapshot` per worker (worker order).

    Returns:
        ``(carry per worker, epoch per worker, counter)``.

    Raises:
        ValueError: The states disagree on the number of windows.
    """
    if not states:
        raise ValueError("no loader states to resume from")
    windows = {int(s["n_windows"]) for s in states}
    if len(windows) != 1:
        raise ValueError(f"loader states disagree on the windows per epoch: {windows}")
    nw = windows.pop()
    # a worker that had finished training saved nothing (counter None)
    active = [i for i, s in enumerate(states) if s["counter"] is not None]
    carry = [[tuple(int(v) for v in p) for p in s["carry"]] for s in states]
    if not active:
        return carry, [int(s["epoch"]) for s in states], 0
    top = max(int(states[i]["counter"]) for i in active)
    low = min(int(states[i]["counter"]) for i in active)
    seen = {int(c) for s in states for c in s["taken"]}
    for k, c in enumerate(c for c in range(low, top) if c not in seen):
        e, g = divmod(c, nw)
        carry[active[k % len(active)]].append((e, g, 0, -1))
    epochs = []
    for s, mine in zip(states, carry, strict=True):
        epochs.append(min([int(s["epoch"])] + [p[0] for p in mine]))
    return carry, epochs, top


def reshard_dynamic(
    states: Sequence[dict], workers: int
) -> tuple[list[list[Carried]], int, int]:
    """Old workers' positions dealt to ``workers`` new workers.

    The old states are merged as for a resume at the same size
    (:func:`merge_states`: what each old worker held unread, plus the chunks
    drawn after some worker's snapshot), so the pool is exactly the pieces
    of the saved epochs that no old worker consumed. They are dealt round
    robin in stream order (epoch, window, row), so the new workers get
    similar amounts and read in a similar order; the rest of the epoch
    comes from the shared counter as before, which continues from the
    merged value. Every new worker starts at one epoch, the oldest one that
    still has unconsumed pieces or a running old worker: a worker never
    drops a piece of an epoch before its own (:meth:`DynamicTrack.start_epoch`
    keeps later ones), and one whose first draw lies in a later epoch keeps
    it for that epoch's pass.

    Args:
        states: One :func:`snapshot` per old worker (old worker order; a
            worker of a finished group passes a state with counter ``None``).
        workers: Number of new workers.

    Returns:
        ``(carry per new worker, epoch of every new worker, counter)``.

    Raises:
        ValueError: No states, states that disagree on the windows per
            epoch, or ``workers`` below 1.
    """
    if workers < 1:
        raise ValueError(f"need at least one worker to resume, got {workers}")
    carry, epochs, counter = merge_states(states)
    pool = sorted(p for mine in carry for p in mine)
    active = [int(s["epoch"]) for s in states if s["counter"] is not None]
    candidates = [p[0] for p in pool] + active
    epoch = min(candidates) if candidates else max(epochs)
    dealt: list[list[Carried]] = [[] for _ in range(workers)]
    for k, piece in enumerate(pool):
        dealt[k % workers].append(piece)
    return dealt, epoch, counter
