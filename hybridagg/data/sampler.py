"""A ``torch.utils.data`` sampler that gives each worker its share of every epoch.

:class:`ShareSampler` is for users who keep their own ``Dataset`` and
``DataLoader`` (transforms, augmentation, ``num_workers``, ``pin_memory``)
and want hybridagg's division of the data, the one its
:class:`~hybridagg.data.HDF5Loader` uses:

* ``shares="static"`` (sync mode): each epoch's order is a permutation
  seeded by ``(seed, epoch)``, cut into one contiguous share per worker in
  proportion to the workers' batch sizes (:func:`~.shares.split_even_steps`),
  so every worker's ``DataLoader`` takes the same number of steps, and every
  sample is read once an epoch (up to ``workers - 1`` read twice when fewer
  samples remain at the end than workers; none with ``drop_last``). No
  communication after construction.
* ``shares="dynamic"`` (hybrid and async modes): the epoch's order is cut
  into chunks of ``chunk_samples``, drawn from one counter (the protocol of
  :mod:`.position`: the counter runs on across epochs, so
  no group ever waits for another at an epoch boundary), so a fast group
  takes more chunks and a slow one fewer, and every chunk of an epoch goes
  to exactly one group. Inside a group of several workers (``group=``), which
  all-reduces every step, the group's leader draws and broadcasts each chunk
  and the group's samples are dealt in rounds of the group's batch: each
  worker gets its batch size of every round, so every worker of the group
  takes the same number of steps (the last, partial round gives each worker
  at least one sample, padded like ``DistributedSampler`` when fewer remain
  than workers). The counter is an MPI window on worker 0 when every worker
  is on one node; across nodes, where a window's draw waits until worker 0
  next enters MPI (about two of its steps: bench/chunk_draw.py), parameter
  server 0 holds it and answers draws by messages (:func:`hybridagg.serve`
  does, from its start until every group is done). One sampler at a time
  draws from server 0; another made meanwhile gets a window.

The ``DataLoader`` iterates the sampler in the main process, also with
``num_workers > 0``: the counter is only ever touched there. The workers of
a group pull indices at the same steps when their data loaders have the
same ``num_workers`` and ``prefetch_factor`` (one script on every rank); a
group whose workers prefetch differently can wait on itself, which ends
with the timeout's error, never a hang.

``torch.utils.data.DistributedSampler(num_replicas=size, rank=rank)`` gives
every worker the same number of samples. In hybrid and async modes a fast
group then finishes its share of the epochs early and sits idle while the
slow groups finish theirs: the run takes as long as the slowest group needs
for an equal share, as in sync mode. With dynamic shares the groups divide
each epoch by speed and finish together;
``ShareSampler(dataset, batch_size=b, topology=topo)`` replaces the
``DistributedSampler`` in one line.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sized
from typing import Any

import numpy as np
import torch

from .options import SHARES
from .parts import data_comm
from .position import DynamicTrack, counter_pieces
from .shares import LocalCounter, WindowCounter, intervals_length, split_even_steps

__all__ = ["ShareSampler"]

_log = logging.getLogger(__name__)

# Default chunk of dynamic shares, in batches of the largest batch size: small
# enough that workers finish an epoch close together, large enough that the
# counter is drawn from rarely.
_CHUNK_BATCHES = 4


class _Chunks:
    """An epoch's sample order cut into chunks (the dynamic shares' windows)."""

    def __init__(self, order: np.ndarray, chunk: int) -> None:
        self.order, self.chunk = order, chunk
        self.n_windows = -(-len(order) // chunk)

    def window_size(self, g: int) -> int:
        return min(self.chunk, len(self.order) - g * self.chunk)

    def indices(self, g: int, lo: int, hi: int) -> np.ndarray:
        return self.order[g * self.chunk + lo : g * self.chunk + hi]


def _length(data: Sized | int) -> int:
    if isinstance(data, (int, np.integer)) and not isinstance(data, bool):
        n = int(data)
    elif isinstance(data, Sized):
        n = len(data)
    else:
        raise TypeError(
            f"ShareSampler takes a dataset with len() or a sample count, got "
            f"{type(data).__name__}"
        )
    if n < 1:
        raise ValueError(f"ShareSampler needs at least one sample, got {n}")
    return n


COUNTERS = ("auto", "window", "server")


def _check_counter(choice: str, topology: Any) -> None:
    """Raise if the counter ``choice`` cannot be had (the same on every worker)."""
    if choice not in COUNTERS:
        raise ValueError(
            f"counter must be one of {', '.join(COUNTERS)} or a counter object, "
            f"got {choice!r}"
        )
    if choice != "server":
        return
    comms = topology.comms if topology is not None else None
    if comms is None or comms.chunks is None:
        raise ValueError(
            "counter='server' needs topology= from hybridagg.init with servers "
            "(server 0 holds the counter)"
        )
    if comms.chunks_in_use:
        raise ValueError(
            "counter='server': another ShareSampler holds server 0's counter; "
            "free() it first, or give this one counter='window'"
        )


class ShareSampler(torch.utils.data.Sampler):
    """This worker's sample indices of every epoch, for ``DataLoader(sampler=...)``.

    Construction is collective over ``comm``: the workers exchange what they
    were given, and any disagreement (dataset length, seed, shares, ...) is
    the same ``ValueError`` on every worker. Static shares hold nothing after
    that; dynamic shares hold the counter until :meth:`free` (collective).
    Use the same ``batch_size`` in this worker's ``DataLoader``
    (``drop_last=False`` there: the shares are cut so that every worker of a
    reduction takes the same number of steps).

    Args:
        data: The dataset (anything with ``len()``) or its length.
        batch_size: This worker's batch size (its ``DataLoader``'s).
        topology: A :class:`hybridagg.Topology` from :func:`hybridagg.init`:
            ``comm`` and ``group`` are its workers' and this worker's
            group's communicators, and ``shares`` defaults to ``"dynamic"``
            when it has servers (hybrid, async), else ``"static"``.
        comm: The communicator of the *workers* (``topology.comms.workers``,
            a :class:`hybridagg.comm.Comm`, or an mpi4py communicator; it is
            duplicated), or ``None`` for one process.
        group: Dynamic shares: the communicator of this worker's group
            (``topology.comms.group``), whose workers all-reduce every step
            and so must take the same number; ``None``: a group of one.
        shares: ``"static"`` (sync mode) or ``"dynamic"`` (hybrid, async);
            default ``"static"``, or as ``topology`` says.
        seed: Seed of the order; every worker must give the same.
        epoch: First epoch (see :meth:`set_epoch`).
        shuffle: Permute each epoch (``False``: index order).
        drop_last: Static shares: leave out the final partial step (no
            sample is then read twice in an epoch).
        chunk_samples: Dynamic shares: samples per chunk (default: four
            batches of the largest batch size).
        counter: Dynamic shares: where chunks are drawn from. ``"auto"``
            (default): with ``topology`` on several nodes, parameter server
            0 (when no other sampler holds it), else an MPI window over the
            workers (a local counter without ``comm``); ``"window"``;
            ``"server"`` (needs ``topology`` with servers and no other
            sampler holding it); or an object with ``fetch_add``, ``read``,
            ``set``, ``free``.

    Attributes:
        epoch: The epoch the next iteration covers; advanced after a whole
            pass (and by a dynamic pass left midway: its chunks are gone).
        batch_sizes: Every worker's batch size, in worker order.
        length: The dataset's length.

    Raises:
        TypeError, ValueError: Bad arguments, or workers that disagree.
    """

    def __init__(
        self,
        data: Sized | int,
        *,
        batch_size: int,
        topology: Any = None,
        comm: Any = None,
        group: Any = None,
        shares: str | None = None,
        seed: int = 0,
        epoch: int = 0,
        shuffle: bool = True,
        drop_last: bool = False,
        chunk_samples: int | None = None,
        counter: Any = None,
    ) -> None:
        if topology is not None:
            if comm is not None or group is not None:
                raise ValueError("give topology= or comm=/group=, not both")
            if topology.comms is None or topology.comms.workers is None:
                raise ValueError(
                    "topology= needs a worker's topology from hybridagg.init"
                )
            comm, group = topology.comms.workers, topology.comms.group
            if shares is None:
                shares = "dynamic" if topology.servers else "static"
        shares = "static" if shares is None else shares
        if group is not None and comm is None:
            raise ValueError("group= needs comm=, the workers' communicator")
        self.comm = data_comm(comm)
        self.rank = self.comm.rank if self.comm else 0
        self.size = self.comm.size if self.comm else 1
        self.counter: Any = None
        self.group: Any = None
        self._served: Any = None  # the Comms whose server-0 counter this holds
        err: BaseException | None = None
        mine: tuple = ()
        try:
            self.length = _length(data)
            if shares not in SHARES:
                raise ValueError(
                    f"shares must be 'static' or 'dynamic', got {shares!r}"
                )
            for name, value, low in (
                ("batch_size", batch_size, 1),
                ("seed", seed, 0),
                ("epoch", epoch, 0),
            ):
                if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
                    raise TypeError(f"{name} must be an int, got {value!r}")
                if value < low:
                    raise ValueError(f"{name} must be >= {low}, got {value}")
            if chunk_samples is not None and int(chunk_samples) < 1:
                raise ValueError(f"chunk_samples must be >= 1, got {chunk_samples}")
            if isinstance(counter, str) and shares == "dynamic":
                _check_counter(counter, topology)
            mine = (
                int(batch_size),
                (self.length, shares, int(seed), bool(shuffle), bool(drop_last),
                 counter if isinstance(counter, str) else None),
                chunk_samples,
            )  # fmt: skip
        except (TypeError, ValueError) as exc:
            err = exc
        self._agree(err)
        views = (
            self.comm.allgather(mine, what="sampler agreement") if self.comm else [mine]
        )
        try:
            self._check_views(views)
        except ValueError:
            self.free()
            raise
        self.shares, self.seed, self.shuffle = shares, int(seed), bool(shuffle)
        self.drop_last, self.epoch = bool(drop_last), int(epoch)
        self.batch_sizes = [int(v[0]) for v in views]
        self.chunk = int(
            chunk_samples
            if chunk_samples is not None
            else min(self.length, _CHUNK_BATCHES * max(self.batch_sizes))
        )
        self._active = False
        if shares == "static":
            try:
                split_even_steps(
                    self.length, self.batch_sizes, drop_last=self.drop_last
                )
            finally:
                # static shares follow from (seed, epoch, batch sizes) alone:
                # nothing is exchanged after this, so nothing stays held
                self.free()
            return
        if counter is None or isinstance(counter, str):
            counter = self._made_counter(counter, topology)
        self.counter = counter
        self.track = DynamicTrack(
            n_windows=-(-self.length // self.chunk), epoch=self.epoch
        )
        self.group_sizes, self.group_rank = [self.batch_sizes[self.rank]], 0
        if group is not None:
            # the group's own duplicate: its broadcasts never meet the
            # optimizer's reductions on the group's communicator
            self.group = data_comm(group)
            self.group_rank = self.group.rank
            self.group_sizes = [
                int(b)
                for b in self.group.allgather(int(batch_size), what="group batch sizes")
            ]

    def _made_counter(self, choice: str | None, topology: Any) -> Any:
        """The counter ``choice`` names (collective over the workers; the
        arguments were checked alike on every worker)."""
        comms = topology.comms if topology is not None else None
        served = comms is not None and comms.chunks is not None
        if choice == "server" or (
            choice in (None, "auto")
            and served
            and len({topology.hosts[r] for r in topology.workers}) > 1
            and not comms.chunks_in_use
        ):
            from ..comm.counter import ServedCounter

            counter = ServedCounter(comms.chunks, comms.chunks.size - 1, self.comm)
            if comms.chunks_used:  # a sampler before this one moved it on
                counter.reset()
            comms.chunks_in_use = comms.chunks_used = True
            self._served = comms
            where = "parameter server 0"
        elif self.comm:
            # collective: the counter's window is created over the workers
            counter = WindowCounter(self.comm)
            where = "a window on worker 0"
        else:
            return LocalCounter()
        if self.rank == 0:
            _log.info("ShareSampler: the workers draw their chunks from %s", where)
        return counter

    def _agree(self, err: BaseException | None) -> None:
        if self.comm:
            try:
                self.comm.check(err, what="sampler arguments")
            except BaseException:
                self.free()
                raise
        elif err is not None:
            raise err

    def _check_views(self, views: list) -> None:
        head = views[0]
        for r, view in enumerate(views):
            if view[1:] != head[1:]:
                raise ValueError(
                    f"worker {r} made its ShareSampler with (length, shares, seed, "
                    f"shuffle, drop_last, counter) = {view[1]} and chunk_samples "
                    f"{view[2]}, "
                    f"worker 0 with {head[1]} and {head[2]}; every worker must "
                    "give the same"
                )

    # --- the epoch's order ---------------------------------------------------
    def _order(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(self.length, dtype=np.int64)
        rng = np.random.default_rng([self.seed, int(epoch)])
        return rng.permutation(self.length).astype(np.int64)

    def set_epoch(self, epoch: int) -> None:
        """Choose the epoch the next iteration covers (with ``seed``, its order)."""
        if epoch < 0:
            raise ValueError(f"epoch must be >= 0, got {epoch}")
        if self._active:
            raise RuntimeError("set_epoch() while the sampler is being iterated")
        self.epoch = int(epoch)

    def share(self) -> list[tuple[int, int]]:
        """Static shares: this worker's stream positions of an epoch (intervals)."""
        if self.shares != "static":
            raise TypeError("dynamic shares are drawn as the epoch goes")
        shares, _ = split_even_steps(
            self.length, self.batch_sizes, drop_last=self.drop_last
        )
        return shares[self.rank]

    def __len__(self) -> int:
        """Static shares: this worker's samples of an epoch (dynamic: no fixed count)."""
        if self.shares != "static":
            raise TypeError("a ShareSampler with dynamic shares has no fixed length")
        return intervals_length(self.share())

    @property
    def steps_per_epoch(self) -> int | None:
        """Static shares: batches every worker takes an epoch (``None``: dynamic)."""
        if self.shares != "static":
            return None
        return split_even_steps(
            self.length, self.batch_sizes, drop_last=self.drop_last
        )[1]

    def __iter__(self) -> Iterator[int]:
        if self._active:
            raise RuntimeError("this sampler is already being iterated")
        epoch = self.epoch
        order = self._order(epoch)
        self._active = True
        done = False
        try:
            if self.shares == "static":
                for a, b in self.share():
                    yield from order[a:b].tolist()
            else:
                if self.counter is None:
                    raise ValueError("this sampler is closed")
                yield from self._dynamic_pass(_Chunks(order, self.chunk), epoch)
            done = True
        finally:
            self._active = False
            # a dynamic pass left midway counts too: the counter has moved on
            if done or self.shares == "dynamic":
                self.epoch = epoch + 1

    def _draw(self, draws: Iterator | None) -> tuple[int, int, int] | None:
        """The group's next chunk piece (``None``: the epoch has no more for it).

        The leader draws; with a group of several workers it broadcasts what
        it drew (collective over the group, in the same order everywhere).
        """
        piece = next(draws, None) if draws is not None else None
        if self.group is not None and self.group.size > 1:
            piece = self.group.bcast(piece, 0, what="the group's next chunk")
        return piece

    def _dynamic_pass(self, chunks: _Chunks, epoch: int) -> Iterator[int]:
        """This worker's indices of a dynamic pass: its part of each round of the group."""
        draws = None
        if self.group_rank == 0:
            self.track.start_epoch(epoch)
            draws = counter_pieces(self.track, chunks, self.counter)
        sizes, me = self.group_sizes, self.group_rank
        round_, lo = sum(sizes), sum(sizes[:me])
        pending = np.zeros(0, dtype=np.int64)
        ended = False
        try:
            while True:
                # every worker of the group draws at the same rounds: the
                # decision depends only on what the group has drawn
                while len(pending) < round_ and not ended:
                    piece = self._draw(draws)
                    if piece is None:
                        ended = True
                    else:
                        pending = np.concatenate([pending, chunks.indices(*piece)])
                if len(pending) >= round_:
                    yield from pending[lo : lo + sizes[me]].tolist()
                    pending = pending[round_:]
                    continue
                if len(pending):  # the last round: at least one sample each
                    last, _ = split_even_steps(len(pending), sizes)
                    for a, b in last[me]:
                        yield from pending[a:b].tolist()
                return
        finally:
            if draws is not None:
                draws.close()

    # --- lifetime --------------------------------------------------------------
    def free(self) -> None:
        """Free the chunk counter and the communicators (collective over the workers)."""
        if self.counter is not None:
            self.counter.free()
            self.counter = None
        if self._served is not None:
            self._served.chunks_in_use = False
            self._served = None
        if self.group is not None:
            self.group.free()
            self.group = None
        if self.comm is not None:
            self.comm.free()
            self.comm = None

    close = free

    def __enter__(self) -> ShareSampler:
        return self

    def __exit__(self, *exc: object) -> None:
        self.free()
