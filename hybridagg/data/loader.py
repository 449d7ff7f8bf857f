"""The sharded, prefetching HDF5 loader: the public facade over its parts.

:class:`HDF5Loader` is what a training loop iterates: each worker reads only
its share of the epoch (static shares proportional to batch sizes, or
dynamic chunks taken on demand), a background thread keeps the next batches
ready, and :attr:`HDF5Loader.stats` says how long the loop waited for data.
Each concept is a part of its own, which the loader builds in order and
frees in reverse:

* :class:`~.options.LoaderOptions`: the validated keywords;
* :mod:`.split`: the files validated by each worker, then agreed on by all;
* :class:`~.files.SplitFiles`: the open files, the driver, the files'
  communicator;
* :mod:`.share_policy`: static shares or dynamic chunks, the batch sizes,
  and how a position is saved and resumed;
* :class:`~.epochs.EpochLoop` with :class:`~.position.PassPosition`: the
  epoch number and the pass being iterated;
* :class:`~.readahead.ReadAhead`: the reader and batch-cutting threads;
* :class:`~.stats.LoaderStats`: stall statistics.

:class:`~hybridagg.data.HDF5Dataset` is a plain ``torch.utils.data.Dataset``
over the same files for users who bring their own loop.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from .options import LoaderOptions
from .parts import LoaderParts, PartAttribute
from .samplelog import SampleLog
from .split import load_split_info
from .stats import LoaderStats

__all__ = [
    "HDF5Loader",
    "LoaderOptions",
    "LoaderStats",
    "load_split_info",
    "workers_comm",
]


def workers_comm(comm: Any, workers: Sequence[int]):
    """Return a communicator of the ranks in ``workers`` (``None`` on the others).

    Collective over ``comm`` (a :class:`hybridagg.comm.Comm`).
    """
    return comm.split(
        0 if comm.rank in set(workers) else None, comm.rank, name="workers"
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
        normalize: Return float32 ``(x - mean) / std``, by default with the
            statistics the converter recorded.
        statistics: ``(mean, std)`` to normalise with instead (one entry
            per channel, or one), e.g. from
            :func:`~hybridagg.data.compute_statistics` for a file that
            records none.
        drop_last: Leave out the final partial step instead of covering
            every sample.
        driver: ``"auto"`` (``mpio`` when h5py has MPI and there is a
            communicator), ``"mpio"`` or ``"posix"``.
        collective: With ``mpio`` and static shares, read collectively. Off by
            default: on the one-node machine measured, collective reads of
            these chunked selections were far slower than independent ones
            (see bench/RESULTS.md); aggregation pays, if anywhere, on a
            parallel file system, to be measured there.
        locking: h5py's ``locking=`` (default: ``HDF5_USE_FILE_LOCKING``,
            else ``"best-effort"``).
        samples_key: Name of the samples dataset in a split group.
        labels_key: Name of the labels dataset.
        num_classes: Overrides the file's ``num_classes``.
        timeout: Longest wait for a batch (default ``HYBRIDAGG_TIMEOUT``).
        chunk_counter: Dynamic shares: the counter chunks are drawn from
            (``fetch_add``, ``read``, ``set``, ``free``), e.g. a
            :class:`hybridagg.comm.counter.ServedCounter`; default: an MPI
            window over the workers (or a local counter without MPI).

    Attributes:
        options: The validated keywords (:class:`LoaderOptions`); ``paths``,
            ``split``, ``shares``, ``seed``, ``window_blocks``, ``prefetch``,
            ``device``, ``normalize``, ``shuffle``, ``drop_last`` and
            ``timeout`` read from it.
        comm, rank, size: The workers' communicator (``None`` once closed)
            and this worker's place among them.
        infos, lengths, total, paths_agree, sample_shape, dtype,
            num_classes, block_samples: The split as the workers agreed on it.
        reader, driver, collective: The open files (``reader`` is ``None``
            once closed) and how they are read.
        thread_mpi, threaded: Whether MPI is thread-multiple, and whether
            batches are read ahead in threads.
        epoch, batch_size, batch_sizes: Where the loader stands now (see
            :meth:`set_epoch`, :meth:`set_batch_sizes`).
        stats: Stall statistics (:class:`LoaderStats`).

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
        statistics: tuple[Any, Any] | None = None,
        drop_last: bool = False,
        driver: str = "auto",
        collective: bool = False,
        locking: bool | str | None = None,
        samples_key: str = "samples",
        labels_key: str = "labels",
        num_classes: int | None = None,
        timeout: float | None = None,
        chunk_counter: Any = None,
    ) -> None:
        self._parts = parts = LoaderParts(comm, chunk_counter)
        err: BaseException | None = None
        try:
            options = LoaderOptions(
                paths=paths,
                batch_size=batch_size,
                split=split,
                shares=shares,
                batch_sizes=batch_sizes,
                seed=seed,
                epoch=epoch,
                shuffle=shuffle,
                window_blocks=window_blocks,
                prefetch=prefetch,
                device=device,
                normalize=normalize,
                statistics=statistics,
                drop_last=drop_last,
                driver=driver,
                collective=collective,
                locking=locking,
                samples_key=samples_key,
                labels_key=labels_key,
                num_classes=num_classes,
                timeout=timeout,
                with_comm=parts.comm is not None,
            )
            infos = load_split_info(
                options.paths,
                split,
                samples_key=samples_key,
                labels_key=labels_key,
                num_classes=num_classes,
                locking=locking,
            )
        except (ValueError, TypeError, OSError) as exc:
            err = exc
        parts.agree_on(err, what="data set validation")
        try:
            parts.build(options, infos)
        except BaseException:
            parts.close()
            raise

    # --- what the parts hold (read-only) ---------------------------------------------
    comm = PartAttribute("_parts")
    rank = PartAttribute("_parts")
    size = PartAttribute("_parts")
    options = PartAttribute("_parts")
    stats = PartAttribute("_parts")
    thread_mpi = PartAttribute("_parts")
    threaded = PartAttribute("_parts")
    paths = PartAttribute("_parts.options")
    split = PartAttribute("_parts.options")
    shares = PartAttribute("_parts.options")
    seed = PartAttribute("_parts.options")
    window_blocks = PartAttribute("_parts.options")
    prefetch = PartAttribute("_parts.options")
    device = PartAttribute("_parts.options")
    normalize = PartAttribute("_parts.options")
    shuffle = PartAttribute("_parts.options")
    drop_last = PartAttribute("_parts.options")
    timeout = PartAttribute("_parts.options")
    infos = PartAttribute("_parts.agreed")
    lengths = PartAttribute("_parts.agreed")
    total = PartAttribute("_parts.agreed")
    paths_agree = PartAttribute("_parts.agreed")
    sample_shape = PartAttribute("_parts.agreed.first")
    dtype = PartAttribute("_parts.agreed.first")
    num_classes = PartAttribute("_parts.agreed.first")
    block_samples = PartAttribute("_parts.agreed.first")
    driver = PartAttribute("_parts.files")
    collective = PartAttribute("_parts.files")
    batch_sizes = PartAttribute("_parts.policy")
    windows_per_epoch = PartAttribute("_parts")

    @property
    def reader(self):
        """The open files' :class:`~.reader.SplitReader` (``None`` once closed)."""
        return files.reader if (files := self._parts.files) is not None else None

    @property
    def batch_size(self) -> int:
        """This worker's batch size now (the next batch cut takes it)."""
        return self._parts.policy.batch_box[0]

    @property
    def epoch(self) -> int:
        """The epoch the next iteration covers (during one: the one iterated)."""
        return self._parts.epochs.epoch

    @epoch.setter
    def epoch(self, epoch: int) -> None:
        self.set_epoch(epoch)

    # --- public API ---------------------------------------------------------------
    @property
    def steps_per_epoch(self) -> int | None:
        """Steps of an epoch under static shares (``None`` for dynamic shares)."""
        return self._parts.policy.steps_per_epoch()

    @property
    def batches_left(self) -> int | None:
        """Batches this worker still gets in the epoch being iterated.

        Static shares: exact, and the same on every worker (they all take
        the same number of steps), so 0 after a batch means the epoch is
        over everywhere. ``None`` for dynamic shares (other workers may
        still take chunks) and outside an iteration.
        """
        return self._parts.policy.batches_left(self._parts.epochs.position)

    def __len__(self) -> int:
        steps = self.steps_per_epoch
        if steps is None:
            raise TypeError("a loader with dynamic shares has no fixed number of steps")
        return steps

    def set_epoch(self, epoch: int) -> None:
        """Choose the epoch the next iteration covers (with ``seed``, its order)."""
        if epoch < 0:
            raise ValueError(f"epoch must be >= 0, got {epoch}")
        self._parts.epochs.epoch = int(epoch)

    def set_batch_sizes(self, batch_sizes: Sequence[int]) -> None:
        """Change the workers' batch sizes, also in the middle of an epoch.

        Static shares: collective over the workers, with the same list on
        every worker; the unread rest of the epoch is re-cut so that every
        sample is still read exactly once. Dynamic shares: local, only this
        worker's entry is used (batches already cut keep the old size).
        """
        parts = self._parts
        if parts.policy.set_batch_sizes(batch_sizes, parts.epochs.position):
            parts.epochs.recut()

    def log_samples(self, path: str | os.PathLike) -> SampleLog:
        """From the next pass on, append the ids of every batch handed out to ``path``.

        One line per batch: the epoch, then the ids of its samples (row in
        the split, counted across its files in order); see
        :mod:`~hybridagg.data.samplelog`. Meant for checking which samples
        a run consumed (tests, debugging); the log is closed with the loader.

        Returns:
            The log (its :meth:`~hybridagg.data.samplelog.SampleLog.mark`
            records events between batches).
        """
        epochs = self._parts.epochs
        if epochs.sample_log is not None:
            epochs.sample_log.close()
        epochs.sample_log = SampleLog(path)
        return epochs.sample_log

    @property
    def sample_log(self) -> SampleLog | None:
        """The log of :meth:`log_samples`, or ``None``."""
        return self._parts.epochs.sample_log

    # --- position -------------------------------------------------------------
    def state_dict(self) -> dict:
        """Where this worker is in the data, to resume from (plain numbers and lists).

        Static shares: collective over the workers (every worker returns the
        same state: the unread rest of every share). Dynamic shares: local,
        this worker's own position; any moment will do, also while other
        workers run on (see :mod:`hybridagg.data.position`).
        """
        parts = self._parts
        return parts.policy.state_dict(parts.epochs.position, parts.epochs.epoch)

    def load_state_dict(self, state: dict) -> None:
        """Continue from :meth:`state_dict`'s result (collective over the workers).

        Dynamic shares: every worker passes the state it saved; chunks that
        no worker's state accounts for are handed out again.

        Raises:
            ValueError: A state of the other kind of shares, another number
                of workers, or a loader that is being iterated.
        """
        epochs = self._parts.epochs
        if epochs.position.active:
            raise ValueError("load_state_dict() while the loader is being iterated")
        epochs.epoch = self._parts.policy.load_state_dict(state)

    def load_resharded_state(self, states: Sequence[dict]) -> None:
        """Continue from positions saved by another number of workers (collective).

        Every worker passes the same list: the :meth:`state_dict` of every
        old worker, in old worker order (a worker that saved none, such as
        one of a finished group, passes a dynamic state whose ``counter`` is
        ``None``). The samples of the saved epoch that no old worker had
        consumed are divided among this loader's workers: none is read
        twice, none is skipped. The epoch's sample order depends on
        ``window_blocks``: use the old run's.

        Raises:
            ValueError: States of the other kind of shares, states that
                disagree on the windows per epoch, or a loader that is being
                iterated.
        """
        epochs = self._parts.epochs
        if epochs.position.active:
            raise ValueError(
                "load_resharded_state() while the loader is being iterated"
            )
        epochs.epoch = self._parts.policy.load_resharded(list(states))

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        # a generator of the loader's own, so iterating keeps the loader alive
        yield from self._parts.epochs.run()

    def close(self) -> None:
        """Stop the read-ahead, close the files and free the communicators.

        Collective over the workers where the loader holds MPI (the dynamic
        chunk counter, mpio files, its communicator). A second call does
        nothing.
        """
        self._parts.close()

    def __enter__(self) -> HDF5Loader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
