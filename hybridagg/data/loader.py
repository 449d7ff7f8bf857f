"""The sharded, prefetching HDF5 loader and a map-style dataset.

:class:`HDF5Loader` is what a training loop iterates: each worker reads only
its share of the epoch (static shares proportional to batch sizes, or
dynamic chunks taken on demand), a background thread keeps the next batches
ready, and :attr:`HDF5Loader.stats` says how long the loop waited for data.
:class:`HDF5Dataset` is a plain ``torch.utils.data.Dataset`` over the same
files for users who bring their own loop.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch

from .format import SplitInfo, inspect_split, open_file
from .pipeline import Job, generate
from .position import DynamicTrack, counter_pieces, merge_states, snapshot
from .readahead import STOP, ReadAhead, read_ahead_threads
from .reader import SplitReader, mpio_available
from .shares import (
    EpochPlan,
    LocalCounter,
    WindowCounter,
    drop_prefix,
    resplit_static,
    split_static,
)
from .stats import LoaderStats

__all__ = [
    "HDF5Loader",
    "LoaderStats",
    "load_split_info",
    "workers_comm",
]


def _as_comm(comm: Any):
    """Wrap the workers' communicator once (``None``: this process alone, no MPI)."""
    if comm is None:
        return None
    from ..comm import Comm

    if isinstance(comm, Comm):
        return Comm(comm.mpi, name="data", timeout=comm.timeout)
    return Comm(comm, name="data")


def workers_comm(comm: Any, workers: Sequence[int]):
    """Return a communicator of the ranks in ``workers`` (``None`` on the others).

    Collective over ``comm`` (a :class:`hybridagg.comm.Comm`).
    """
    return comm.split(
        0 if comm.rank in set(workers) else None, comm.rank, name="workers"
    )


def load_split_info(
    paths: Sequence[str],
    split: str,
    *,
    samples_key: str = "samples",
    labels_key: str = "labels",
    num_classes: int | None = None,
    locking: bool | str | None = None,
) -> list[SplitInfo]:
    """Validate one split in every file; the files must share one layout."""
    infos = []
    for path in paths:
        with open_file(path, locking=locking) as f:
            infos.append(
                inspect_split(
                    f,
                    split,
                    samples_key=samples_key,
                    labels_key=labels_key,
                    num_classes=num_classes,
                    path=path,
                )
            )
    for info in infos[1:]:
        if info.layout() != infos[0].layout():
            raise ValueError(
                f"data file {info.path} ('{info.samples_key}': samples "
                f"{info.sample_shape} {info.dtype}, {info.num_classes} classes) does "
                f"not match {infos[0].path} ({infos[0].sample_shape} "
                f"{infos[0].dtype}, {infos[0].num_classes} classes)"
            )
    return infos


def _paths(paths: Any) -> list[str]:
    if isinstance(paths, (str, os.PathLike)):
        return [os.fspath(paths)]
    if isinstance(paths, Sequence) and paths:
        out = []
        for p in paths:
            if not isinstance(p, (str, os.PathLike)):
                raise TypeError(f"data paths must be str or os.PathLike, got {type(p)}")
            out.append(os.fspath(p))
        return out
    raise TypeError(
        f"paths must be a file name or a non-empty list of them, got {paths!r}"
    )


class HDF5Loader:
    """Iterate batches of one split, each worker reading only its share.

    One pass of ``for x, y in loader`` is one epoch; the epoch number then
    advances (or set it with :meth:`set_epoch`). Batches are torch tensors
    on ``device``: samples ``(b, *sample_shape)`` and int64 labels ``(b,)``.

    Args:
        paths: An HDF5 file in hybridagg's format, or a list of them.
        batch_size: This worker's batch size.
        comm: The communicator of the *workers* (a
            :class:`hybridagg.comm.Comm` or an mpi4py communicator; it is
            duplicated once), or ``None`` for one process without MPI.
            Construction is collective over it.
        split: Group of the split (``"train"``, ``"val"``).
        shares: ``"static"``: contiguous shares proportional to the batch
            sizes, the same number of steps on every worker (sync mode).
            ``"dynamic"``: chunks on demand from a shared counter (hybrid
            and async modes); workers take different numbers of steps.
        batch_sizes: Every worker's batch size, for static shares (default:
            gathered from the workers' ``batch_size``).
        seed: Seed of the shuffle (with the epoch it fixes the order).
        epoch: First epoch.
        shuffle: Shuffle blocks and within windows (``False`` for evaluation).
        window_blocks: Blocks per window: the in-memory shuffle buffer and
            the dynamic chunk.
        prefetch: Batches kept ready by the reader thread (0: no thread).
        device: Where batches go (``.to(device, non_blocking=True)`` from
            pinned memory on CUDA).
        normalize: Return float32 ``(x - norm_mean) / norm_std`` using the
            statistics the converter recorded.
        drop_last: Leave out the final partial step instead of covering
            every sample.
        driver: ``"auto"`` (``mpio`` when h5py has MPI and there is a
            communicator), ``"mpio"`` or ``"posix"``.
        collective: With ``mpio`` and static shares, read collectively. Off by
            default: with HDF5 1.10.8 and Open MPI 4.1.4 a collective read of
            these chunked selections was ~200x slower than independent
            reads (bench/RESULTS.md).
        locking: h5py's ``locking=`` (default: ``HDF5_USE_FILE_LOCKING``,
            else ``"best-effort"``).
        samples_key: Name of the samples dataset in a split group.
        labels_key: Name of the labels dataset.
        num_classes: Overrides the file's ``num_classes``.
        timeout: Longest wait for a batch (default ``HYBRIDAGG_TIMEOUT``).

    Raises:
        FileNotFoundError, ValueError, TypeError: Bad files or arguments; the
            same error on every worker.
    """

    def __init__(
        self,
        paths: str | os.PathLike | Sequence[str | os.PathLike],
        *,
        batch_size: int,
        comm: Any = None,
        split: str = "train",
        shares: str = "static",
        batch_sizes: Sequence[int] | None = None,
        seed: int = 0,
        epoch: int = 0,
        shuffle: bool = True,
        window_blocks: int = 8,
        prefetch: int = 4,
        device: str | torch.device = "cpu",
        normalize: bool = False,
        drop_last: bool = False,
        driver: str = "auto",
        collective: bool = False,
        locking: bool | str | None = None,
        samples_key: str = "samples",
        labels_key: str = "labels",
        num_classes: int | None = None,
        timeout: float | None = None,
    ) -> None:
        self._readahead: ReadAhead | None = None
        self.comm = _as_comm(comm)
        self.rank = self.comm.rank if self.comm else 0
        self.size = self.comm.size if self.comm else 1
        self.reader: SplitReader | None = None
        self._counter = None
        self._file_comm = None
        err: BaseException | None = None
        try:
            self._configure(
                paths,
                batch_size,
                split,
                shares,
                seed,
                epoch,
                window_blocks,
                prefetch,
                device,
                normalize,
                driver,
                timeout,
            )
            self.infos = load_split_info(
                self.paths,
                split,
                samples_key=samples_key,
                labels_key=labels_key,
                num_classes=num_classes,
                locking=locking,
            )
        except (ValueError, TypeError, OSError) as exc:
            err = exc
        if self.comm:
            try:
                self.comm.check(err, what="data set validation")
            except BaseException:
                self.comm.free()
                raise
        elif err is not None:
            raise err
        self.shuffle, self.drop_last = bool(shuffle), bool(drop_last)
        try:
            self._agree(batch_sizes)
            self._open(driver, collective, locking)
        except BaseException:
            self.close()
            raise
        self._consumed = 0
        self._steps_done = 0
        self._resume_static = None
        self._active = False

    # --- construction -----------------------------------------------------------
    def _configure(
        self,
        paths,
        batch_size,
        split,
        shares,
        seed,
        epoch,
        window_blocks,
        prefetch,
        device,
        normalize,
        driver,
        timeout,
    ) -> None:
        self.paths = _paths(paths)
        self.split = split
        for name, value, low in (
            ("batch_size", batch_size, 1),
            ("seed", seed, 0),
            ("epoch", epoch, 0),
            ("window_blocks", window_blocks, 1),
            ("prefetch", prefetch, 0),
        ):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
                raise TypeError(f"{name} must be an int, got {value!r}")
            if value < low:
                raise ValueError(f"{name} must be >= {low}, got {value}")
        if shares not in ("static", "dynamic"):
            raise ValueError(f"shares must be 'static' or 'dynamic', got {shares!r}")
        if driver not in ("auto", "mpio", "posix"):
            raise ValueError(
                f"driver must be 'auto', 'mpio' or 'posix', got {driver!r}"
            )
        if driver == "mpio" and not mpio_available():
            raise ValueError(
                "driver='mpio' needs h5py built with MPI (h5py.get_config().mpi)"
            )
        if driver == "mpio" and self.comm is None:
            raise ValueError("driver='mpio' needs a communicator (comm=)")
        self.batch_size, self.seed, self.epoch = int(batch_size), int(seed), int(epoch)
        self._batch_box = [self.batch_size]
        self.shares, self.window_blocks, self.prefetch = (
            shares,
            int(window_blocks),
            int(prefetch),
        )
        self.device = torch.device(device)
        self.normalize = bool(normalize)
        from .. import comm as comm_mod

        self.timeout = (
            float(timeout) if timeout is not None else comm_mod.default_timeout()
        )
        self.stats = LoaderStats()

    def _agree(self, batch_sizes: Sequence[int] | None) -> None:
        """Check that every worker sees the same data and agree on batch sizes."""
        mine = (
            [i.length for i in self.infos],
            self.infos[0].layout(),
            [os.path.abspath(p) for p in self.paths],
            self.batch_size,
            None if batch_sizes is None else [int(b) for b in batch_sizes],
        )
        views = (
            self.comm.allgather(mine, what="data set agreement")
            if self.comm
            else [mine]
        )
        for r, view in enumerate(views):
            if view[:2] != views[0][:2]:
                raise ValueError(
                    f"worker {r} sees split '{self.split}' of {view[2]} as "
                    f"{sum(view[0])} samples {view[1]}, worker 0 sees "
                    f"{views[0][2]} as {sum(views[0][0])} samples {views[0][1]}; "
                    "all workers must read the same data"
                )
        self.lengths = [i.length for i in self.infos]
        self.total = sum(self.lengths)
        self.paths_agree = all(v[2] == views[0][2] for v in views)
        gathered = [int(v[3]) for v in views]
        if batch_sizes is not None:
            given = [int(b) for b in batch_sizes]
            if any(v[4] != given for v in views):
                raise ValueError("batch_sizes must be the same list on every worker")
            if len(given) != self.size or given[self.rank] != self.batch_size:
                raise ValueError(
                    f"batch_sizes {given} must have one entry per worker "
                    f"({self.size}) with this worker's batch_size at index {self.rank}"
                )
            gathered = given
        self.batch_sizes = gathered
        limit = sum(gathered) if self.shares == "static" else self.batch_size
        if limit > self.total:
            what = (
                f"the global batch of {limit} samples (batch sizes {gathered})"
                if self.shares == "static"
                else f"batch_size {limit}"
            )
            raise ValueError(
                f"{what} is larger than split '{self.split}' of "
                f"{', '.join(self.paths)} ({self.total} samples in "
                f"'{self.infos[0].samples_key}')"
            )
        info = self.infos[0]
        if self.normalize and (info.norm_mean is None or info.norm_std is None):
            raise ValueError(
                f"normalize=True but data file {info.path} records no norm_mean/"
                "norm_std (write it with 'hybridagg convert')"
            )
        self.sample_shape, self.dtype = info.sample_shape, info.dtype
        self.num_classes, self.block_samples = info.num_classes, info.block_samples
        self._labels = [i.labels for i in self.infos]

    def _open(self, driver: str, collective: bool, locking) -> None:
        if driver == "auto":
            driver = (
                "mpio"
                if (self.comm and mpio_available() and self.paths_agree)
                else "posix"
            )
        if driver == "mpio" and not self.paths_agree:
            raise ValueError("driver='mpio' needs every worker to name the same files")
        self.driver = driver
        self.collective = bool(
            collective and driver == "mpio" and self.shares == "static"
        )
        self.thread_mpi = True
        if self.comm:
            from mpi4py import MPI

            self.thread_mpi = MPI.Query_thread() >= MPI.THREAD_MULTIPLE
        # the reader thread calls MPI for mpio reads and for the chunk counter;
        # without MPI_THREAD_MULTIPLE those stay on the main thread (no prefetch)
        needs_mpi = self.comm is not None and (
            driver == "mpio" or self.shares == "dynamic"
        )
        self.threaded = read_ahead_threads(
            self.prefetch, thread_multiple=self.thread_mpi, reader_calls_mpi=needs_mpi
        )
        self._readahead = ReadAhead(
            threaded=self.threaded,
            depth=self.prefetch,
            timeout=self.timeout,
            name=f"hybridagg-data-{self.rank}",
        )
        self._file_comm = None
        err: BaseException | None = None
        try:
            if driver == "mpio":
                from ..comm import Comm

                self._file_comm = Comm(
                    self.comm.mpi, name="data-files", timeout=self.timeout
                )
            self.reader = SplitReader(
                self.infos,
                driver=driver,
                file_comm=self._file_comm,
                collective=self.collective,
                locking=locking,
            )
        except (ValueError, TypeError, OSError) as exc:
            err = exc
        if self.comm:
            self.comm.check(err, what="opening the data files")
        elif err is not None:
            raise err
        if self.shares == "dynamic":
            self._counter = WindowCounter(self.comm) if self.comm else LocalCounter()
            windows = EpochPlan(
                self.lengths, self.block_samples, self.window_blocks, self.seed, 0
            ).n_windows
            self._track = DynamicTrack(n_windows=windows, epoch=self.epoch)

    # --- public API ---------------------------------------------------------------
    @property
    def steps_per_epoch(self) -> int | None:
        """Steps of an epoch under static shares (``None`` for dynamic shares)."""
        if self.shares != "static":
            return None
        plan_total = self.total
        return split_static(
            [(0, plan_total)], self.batch_sizes, drop_last=self.drop_last
        )[1]

    @property
    def batches_left(self) -> int | None:
        """Batches this worker still gets in the epoch being iterated.

        Static shares: exact, and the same on every worker (they all take
        the same number of steps), so 0 after a batch means the epoch is
        over everywhere. ``None`` for dynamic shares (other workers may
        still take chunks) and outside an iteration.
        """
        if self.shares != "static" or not self._active:
            return None
        return int(self._steps_left - self._steps_done)

    @property
    def windows_per_epoch(self) -> int:
        """Chunks (windows) of one epoch."""
        return EpochPlan(
            self.lengths, self.block_samples, self.window_blocks, self.seed, 0
        ).n_windows

    def __len__(self) -> int:
        steps = self.steps_per_epoch
        if steps is None:
            raise TypeError("a loader with dynamic shares has no fixed number of steps")
        return steps

    def set_epoch(self, epoch: int) -> None:
        """Choose the epoch the next iteration covers (with ``seed``, its order)."""
        if epoch < 0:
            raise ValueError(f"epoch must be >= 0, got {epoch}")
        self.epoch = int(epoch)

    def set_batch_sizes(self, batch_sizes: Sequence[int]) -> None:
        """Change the workers' batch sizes, also in the middle of an epoch.

        Static shares: collective over the workers, with the same list on
        every worker; the unread rest of the epoch is re-cut so that every
        sample is still read exactly once. Dynamic shares: local, only this
        worker's entry is used.
        """
        sizes = [int(b) for b in batch_sizes]
        if len(sizes) != self.size or min(sizes) < 1:
            raise ValueError(
                f"batch_sizes needs {self.size} positive entries (one per worker), got {sizes}"
            )
        if self.shares == "dynamic":
            # batches already cut keep the old size; the next ones take the new
            self.batch_size = self._batch_box[0] = sizes[self.rank]
            self.batch_sizes = sizes
            return
        views = (
            self.comm.allgather((sizes, self._consumed), what="set_batch_sizes")
            if self.comm
            else [(sizes, self._consumed)]
        )
        if any(v[0] != sizes for v in views):
            raise ValueError(
                f"set_batch_sizes got different lists on different workers: "
                f"{[v[0] for v in views]}"
            )
        self.batch_size, self.batch_sizes = sizes[self.rank], sizes
        self._batch_box[0] = self.batch_size
        if self._active:
            self._stop_reader()
            self._plan_shares, self._steps_left = resplit_static(
                self._plan_shares,
                [v[1] for v in views],
                sizes,
                drop_last=self.drop_last,
            )
            self._consumed = 0
            self._steps_done = 0
            self._start_reader()

    # --- position -------------------------------------------------------------
    def state_dict(self) -> dict:
        """Where this worker is in the data, to resume from (plain numbers and lists).

        Static shares: collective over the workers (every worker returns the
        same state: the unread rest of every share). Dynamic shares: local,
        this worker's own position; any moment will do, also while other
        workers run on (see :mod:`hybridagg.data.position`).
        """
        if self.shares == "dynamic":
            track = self._track
            with track.lock:
                if not self._active and track.epoch != self.epoch:
                    track.epoch, track.yielded = self.epoch, []
                consumed = self._consumed if self._active else 0
                state = snapshot(track, consumed, self._counter.read())
            state["kind"] = "dynamic"
            state["epoch"] = self.epoch
            return state
        if not self._active:
            return {"kind": "static", "epoch": self.epoch, "shares": None}
        views = (
            self.comm.allgather(
                (self._consumed, self._steps_done), what="loader position"
            )
            if self.comm
            else [(self._consumed, self._steps_done)]
        )
        shares = [
            [list(iv) for iv in drop_prefix(share, consumed)]
            for share, (consumed, _) in zip(self._plan_shares, views, strict=True)
        ]
        return {
            "kind": "static",
            "epoch": self.epoch,
            "shares": shares,
            "steps_left": int(self._steps_left - views[0][1]),
            "batch_sizes": list(self.batch_sizes),
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue from :meth:`state_dict`'s result (collective over the workers).

        Dynamic shares: every worker passes the state it saved; chunks that
        no worker's state accounts for are handed out again.

        Raises:
            ValueError: A state of the other kind of shares, another number
                of workers, or a loader that is being iterated.
        """
        if self._active:
            raise ValueError("load_state_dict() while the loader is being iterated")
        kind = state.get("kind")
        if kind != self.shares:
            raise ValueError(
                f"loader state is for {kind!r} shares, this loader has {self.shares!r}"
            )
        if self.shares == "static":
            self.epoch = int(state["epoch"])
            if state.get("shares") is None:
                self._resume_static = None
                return
            if len(state["shares"]) != self.size:
                raise ValueError(
                    f"loader state has {len(state['shares'])} workers, this job {self.size}"
                )
            self.batch_size = int(state["batch_sizes"][self.rank])
            self._batch_box[0] = self.batch_size
            self.batch_sizes = [int(b) for b in state["batch_sizes"]]
            shares = [[tuple(iv) for iv in share] for share in state["shares"]]
            self._resume_static = (shares, int(state["steps_left"]))
            return
        states = (
            self.comm.allgather(state, what="loader resume") if self.comm else [state]
        )
        carry, epochs, counter = merge_states(states)
        self._counter.set(counter)
        track = self._track
        with track.lock:
            track.carry, track.stash, track.taken = carry[self.rank], None, []
            track.epoch, track.yielded = epochs[self.rank], []
        self.epoch = epochs[self.rank]

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        self._begin_epoch()
        try:
            while True:
                t0 = time.perf_counter()
                item = self._next_item()
                if item is STOP:
                    break
                x, y = item
                if self.device.type != "cpu":
                    x = x.to(self.device, non_blocking=True)
                    y = y.to(self.device, non_blocking=True)
                self.stats.record_batch(time.perf_counter() - t0, len(y))
                self._consumed += len(y)
                self._steps_done += 1
                yield x, y
            self.epoch += 1
        finally:
            self._end_epoch()

    def close(self) -> None:
        """Stop the reader thread and close the files (collective with ``mpio``)."""
        self._stop_reader()
        if self.reader is not None:
            self.reader.close()
            self.reader = None
        if self._counter is not None:
            self._counter.free()
            self._counter = None
        for c in (self._file_comm, self.comm):
            if c is not None:
                c.free()
        self._file_comm = self.comm = None

    def __enter__(self) -> HDF5Loader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- epochs and the reader ------------------------------------------------------
    def _begin_epoch(self) -> None:
        if self.reader is None:
            raise ValueError("this loader is closed")
        if self._active:
            raise RuntimeError("this loader is already being iterated")
        self._plan = EpochPlan(
            self.lengths,
            self.block_samples,
            self.window_blocks,
            self.seed,
            self.epoch,
            shuffle=self.shuffle,
        )
        if self.shares == "static":
            if self._resume_static is not None:
                self._plan_shares, self._steps_left = self._resume_static
                self._resume_static = None
            else:
                self._plan_shares, self._steps_left = split_static(
                    [(0, self._plan.total)], self.batch_sizes, drop_last=self.drop_last
                )
        else:
            self._track.start_epoch(self.epoch)
        self._consumed = 0
        self._steps_done = 0
        self._active = True
        self._start_reader()

    def _end_epoch(self) -> None:
        self._stop_reader()
        if (
            self._active
            and self.shares == "dynamic"
            and self._track.epoch == self.epoch
        ):
            # an abandoned pass: the shared counter has moved on, so the next
            # pass is the next epoch (chunks left of this one are skipped)
            self.epoch += 1
        self._active = False

    def _start_reader(self) -> None:
        self._readahead.start(generate(self._job(), read_ahead=self.threaded))

    def _stop_reader(self) -> None:
        if self._readahead is not None:
            self._readahead.stop()

    def _next_item(self) -> Any:
        return self._readahead.next()

    # --- the reader's work ------------------------------------------------------------
    def _job(self) -> Job:
        plan = self._plan
        calls = 0
        if self.shares == "static":
            pieces: Any = list(plan.pieces(self._plan_shares[self.rank]))
            if self.collective:
                calls = max(
                    len({g for g, _, _ in plan.pieces(s)}) for s in self._plan_shares
                )
        else:
            pieces = counter_pieces(self._track, plan, self._counter)
        info = self.infos[0]
        return Job(
            plan=plan,
            reader=self.reader,
            stats=self.stats,
            labels=self._labels,
            pieces=pieces,
            steps=self._steps_left if self.shares == "static" else None,
            collective_calls=calls,
            batch=self._batch_box,
            capacity=self.window_blocks * self.block_samples,
            sample_shape=self.sample_shape,
            dtype=self.dtype,
            pinned=self.device.type == "cuda",
            norm=(info.norm_mean, info.norm_std) if self.normalize else None,
        )
