"""The loader's parts and their lifetime: built in order, freed in reverse.

:class:`LoaderParts` is what :class:`~hybridagg.data.HDF5Loader` stands on:
the workers' communicator, the validated options, the agreed split, the open
files, the share policy, the stall statistics and the epoch loop. Building is
collective over the workers, and every check either runs on data all workers
exchanged or goes through ``Comm.check``, so a bad input fails on every
worker alike and no collective file operation starts before the checks.
"""

from __future__ import annotations

import operator
from typing import Any

from .epochs import EpochLoop
from .files import SplitFiles, choose_driver
from .format import SplitInfo
from .options import LoaderOptions
from .readahead import ReadAhead, read_ahead_threads
from .reader import mpio_available
from .share_policy import DynamicShares, SharePolicy, StaticShares
from .shares import EpochPlan
from .split import AgreedSplit, WorkerView, agree_split
from .stats import LoaderStats

__all__ = ["LoaderParts", "PartAttribute", "data_comm"]


def data_comm(comm: Any):
    """The loader's own duplicate of the workers' communicator (``None``: no MPI).

    Args:
        comm: A :class:`hybridagg.comm.Comm`, an mpi4py communicator, or
            ``None`` for one process alone.
    """
    if comm is None:
        return None
    from ..comm import Comm

    if isinstance(comm, Comm):
        return Comm(comm.mpi, name="data", timeout=comm.timeout)
    return Comm(comm, name="data")


class PartAttribute:
    """A read-only attribute of an owner object that lives in one of its parts.

    Args:
        part: Dotted path of the part on the owner (``"_parts.options"``);
            the attribute of the same name is read there.
    """

    def __init__(self, part: str) -> None:
        self.part = part

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name
        self._get = operator.attrgetter(f"{self.part}.{name}")

    def __get__(self, obj: Any, objtype: type | None = None) -> Any:
        if obj is None:
            return self
        return self._get(obj)

    def __set__(self, obj: Any, value: Any) -> None:
        raise AttributeError(f"{self.name} is read-only (it lives in {self.part})")


class LoaderParts:
    """Owns every part of one loader, from the communicator to the epoch loop.

    Args:
        comm: The workers' communicator, as given to the loader (duplicated
            here once), or ``None``.
        chunk_counter: Dynamic shares' counter (``None``: the default one).

    Attributes:
        comm: The loader's communicator (``None`` without MPI or once closed).
        rank: This worker's index among the workers.
        size: Number of workers.
        options: The validated options (set by :meth:`build`).
        agreed: The split as the workers agreed on it.
        files: The open files.
        thread_mpi: MPI may be called from any thread (``True`` without MPI).
        threaded: Batches are read and cut in threads of their own.
        windows_per_epoch: Windows (dynamic chunks) of one epoch.
        policy: The share policy.
        stats: Stall statistics.
        epochs: The epoch loop.
    """

    def __init__(self, comm: Any, chunk_counter: Any = None) -> None:
        self.comm = data_comm(comm)
        self.chunk_counter = chunk_counter
        self.rank = self.comm.rank if self.comm else 0
        self.size = self.comm.size if self.comm else 1
        self.files: SplitFiles | None = None
        self.policy: SharePolicy | None = None
        self.epochs: EpochLoop | None = None

    def agree_on(self, err: BaseException | None, *, what: str) -> None:
        """Raise ``err``, one worker's error on every worker (collective).

        On an error the communicator is freed: nothing else is held yet.
        """
        if self.comm:
            try:
                self.comm.check(err, what=what)
            except BaseException:
                self.comm.free()
                raise
        elif err is not None:
            raise err

    def build(self, options: LoaderOptions, infos: list[SplitInfo]) -> None:
        """Agree on the data, open the files, set up shares and the epoch loop.

        Collective over the workers. On an error, call :meth:`close`: what
        was built is freed, on every worker alike.
        """
        comm = self.comm
        self.options = options
        mine = WorkerView.of(infos, options)
        views = comm.allgather(mine, what="data set agreement") if comm else [mine]
        self.agreed: AgreedSplit = agree_split(
            views, rank=self.rank, infos=infos, options=options
        )
        driver = choose_driver(
            options.driver,
            with_comm=comm is not None,
            mpio=mpio_available(),
            paths_agree=self.agreed.paths_agree,
        )
        self.files = SplitFiles(
            driver=driver,
            collective=options.collective and options.shares == "static",
            timeout=options.timeout,
        )
        self.thread_mpi = True
        if comm:
            from mpi4py import MPI

            self.thread_mpi = MPI.Query_thread() >= MPI.THREAD_MULTIPLE
        self.threaded = read_ahead_threads(
            options.prefetch,
            thread_multiple=self.thread_mpi,
            reader_calls_mpi=comm is not None
            and (driver == "mpio" or options.shares == "dynamic"),
        )
        self.files.open(infos, comm=comm, locking=options.locking)
        self.windows_per_epoch = EpochPlan(
            self.agreed.lengths,
            self.agreed.first.block_samples,
            options.window_blocks,
            options.seed,
            0,
        ).n_windows
        self.policy = self._share_policy()
        self.stats = LoaderStats()
        self.epochs = EpochLoop(
            options=options,
            split=self.agreed,
            files=self.files,
            policy=self.policy,
            stats=self.stats,
            readahead=ReadAhead(
                threaded=self.threaded,
                depth=options.prefetch,
                timeout=options.timeout,
                name=f"hybridagg-data-{self.rank}",
            ),
        )

    def _share_policy(self) -> SharePolicy:
        if self.options.shares == "static":
            return StaticShares(
                comm=self.comm,
                rank=self.rank,
                workers=self.size,
                total=self.agreed.total,
                batch_sizes=self.agreed.batch_sizes,
                drop_last=self.options.drop_last,
            )
        # collective: the counter's MPI window is created over the workers
        return DynamicShares(
            comm=self.comm,
            rank=self.rank,
            workers=self.size,
            batch_sizes=self.agreed.batch_sizes,
            n_windows=self.windows_per_epoch,
            epoch=self.options.epoch,
            counter=self.chunk_counter,
        )

    def close(self) -> None:
        """Stop the read-ahead, then free the parts in reverse order of building.

        The chunk counter (dynamic shares), the files and their communicator
        (mpio) and the loader's communicator are collective to free, so every
        worker closes. A second call does nothing.
        """
        if self.epochs is not None:
            self.epochs.readahead.stop()
            if self.epochs.sample_log is not None:
                self.epochs.sample_log.close()
        if self.policy is not None:
            self.policy.free()
        if self.files is not None:
            self.files.close()
        if self.comm is not None:
            self.comm.free()
        self.comm = None
