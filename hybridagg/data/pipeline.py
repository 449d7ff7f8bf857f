"""The reader's side of :class:`HDF5Loader`: batch cutting, prefetch thread, stats.

:func:`generate` is the reader's loop for one epoch: read a window of blocks,
permute it, cut batches of the worker's size. :class:`Prefetcher` runs it in a
daemon thread behind a bounded queue. Neither holds a reference to the
loader, so a dropped loader is collected and its finaliser stops the thread.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

from .reader import SplitReader
from .shares import EpochPlan

__all__ = [
    "STOP",
    "Job",
    "LoaderStats",
    "Prefetcher",
    "close_prefetcher",
    "generate",
]

STOP = object()


@dataclass
class LoaderStats:
    """Where a worker's time went on data (cumulative over epochs).

    Attributes:
        wait_seconds: Total time ``next()`` waited for a batch (the stall).
        last_wait: Wait of the most recent ``next()``.
        max_wait: Longest single wait.
        batches: Batches returned.
        samples: Samples returned.
        bytes_read: Bytes read from the files.
        read_seconds: Time the reader spent in HDF5 reads.
        windows: Windows (dynamic chunks) read.
    """

    wait_seconds: float = 0.0
    last_wait: float = 0.0
    max_wait: float = 0.0
    batches: int = 0
    samples: int = 0
    bytes_read: int = 0
    read_seconds: float = 0.0
    windows: int = 0

    def stall_fraction(self, elapsed: float) -> float:
        """Share of ``elapsed`` seconds spent waiting for data."""
        return self.wait_seconds / elapsed if elapsed > 0 else 0.0

    def as_dict(self) -> dict[str, float]:
        """The fields as a dict (for metrics records)."""
        return asdict(self)


class Prefetcher:
    """Runs a batch generator in a daemon thread behind a bounded queue.

    It holds no reference to the loader, so a loader that is dropped is
    collected and its finaliser stops the thread.
    """

    def __init__(self, gen: Iterator, depth: int, timeout: float, name: str) -> None:
        self.q: queue.Queue = queue.Queue(maxsize=depth)
        self.stop = threading.Event()
        self.timeout = timeout
        self.thread = threading.Thread(
            target=self._run, args=(gen,), name=name, daemon=True
        )
        self.thread.start()

    def _put(self, item: Any) -> bool:
        while not self.stop.is_set():
            try:
                self.q.put(item, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False

    def _run(self, gen: Iterator) -> None:
        try:
            for item in gen:
                # stop is checked before every put: close() drains the queue,
                # which would otherwise let this thread refill it and then
                # sleep in put()'s timeout before noticing (a 50 ms stall of
                # every batch-size change)
                if self.stop.is_set() or not self._put(item):
                    break
            else:
                self._put(STOP)
        except BaseException as exc:  # handed to the consumer, re-raised there
            self._put(exc)
        finally:
            # lets a collective generator finish its remaining calls empty
            gen.close()

    def get(self) -> Any:
        try:
            return self.q.get(timeout=self.timeout)
        except queue.Empty:
            raise TimeoutError(
                f"data loader: no batch from the reader thread within "
                f"{self.timeout:g} s (raise HYBRIDAGG_TIMEOUT if reads are this slow)"
            ) from None

    def close(self, join_timeout: float = 60.0) -> None:
        self.stop.set()
        while True:
            try:
                self.q.get_nowait()
            except queue.Empty:
                break
        if self.thread is not threading.current_thread():
            self.thread.join(join_timeout)


def close_prefetcher(state: dict) -> None:
    """Stop the prefetcher kept in a loader's state dict, if any."""
    pf = state.pop("prefetcher", None)
    if pf is not None:
        pf.close()


@dataclass
class Job:
    """What the reader needs for one epoch; deliberately no loader reference."""

    plan: EpochPlan
    reader: SplitReader
    stats: LoaderStats
    labels: list[np.ndarray]
    pieces: Any
    steps: int | None
    collective_calls: int
    batch: list[int]
    capacity: int
    sample_shape: tuple[int, ...]
    dtype: np.dtype
    pinned: bool
    norm: tuple[np.ndarray, np.ndarray] | None


def _read_windows(job: Job, pool: queue.Queue | None) -> Iterator[tuple]:
    """Read the windows the pieces touch; yield ``(xbuf, xt, ybuf, perm, lo, hi)``.

    With a buffer ``pool`` each window is read into a free buffer taken from
    it (the consumer gives buffers back), so windows can be read ahead;
    without one a single buffer is reused.
    """
    plan, reader, stats = job.plan, job.reader, job.stats
    calls, current, xbuf = 0, -1, None
    single = None if pool is not None else _window_buffer(job)
    try:
        for g, lo, hi in job.pieces:
            if g != current:
                xbuf = pool.get() if pool is not None else single
                if xbuf is None:  # the consumer stopped
                    return
                blocks = plan.window_blocks(g)
                t0 = time.perf_counter()
                stats.bytes_read += reader.read_window(blocks, xbuf)
                stats.read_seconds += time.perf_counter() - t0
                stats.windows += 1
                calls += 1
                ybuf = np.concatenate([job.labels[f][s:c] for f, s, c in blocks])
                perm = torch.from_numpy(plan.window_perm(g))
                current = g
            yield xbuf, ybuf, perm, lo, hi
    finally:
        # collective reads: every worker makes the same number of calls, also
        # when stopped early; the missing ones join with an empty selection
        spare = single if single is not None else _window_buffer(job, rows=1)
        while calls < job.collective_calls:
            reader.read_window(None, spare)
            calls += 1


def _window_buffer(job: Job, rows: int | None = None) -> np.ndarray:
    return np.empty((rows or job.capacity, *job.sample_shape), dtype=job.dtype)


def _read_ahead(job: Job, depth: int = 2) -> Iterator[tuple]:
    """:func:`_read_windows` in a thread of its own, ``depth`` windows ahead.

    h5py releases the GIL while HDF5 reads, and the batch gather below is a
    torch op that releases it too, so on two cores the read of the next
    window overlaps the cutting of batches from this one.
    """
    pool: queue.Queue = queue.Queue()
    for _ in range(depth + 1):
        pool.put(_window_buffer(job))
    out: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def put(item: Any) -> bool:
        while not stop.is_set():
            try:
                out.put(item, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False

    def run() -> None:
        gen = _read_windows(job, pool)
        try:
            for item in gen:
                if stop.is_set() or not put(item):
                    break
            else:
                put(STOP)
        except BaseException as exc:  # handed to the consumer
            put(exc)
        finally:
            gen.close()

    thread = threading.Thread(target=run, name="hybridagg-data-read", daemon=True)
    thread.start()
    held = None
    try:
        while True:
            item = out.get()
            if item is STOP:
                return
            if isinstance(item, BaseException):
                raise item
            if held is not None and item[0] is not held:
                pool.put(held)  # the previous window is fully cut: reuse it
            held = item[0]
            yield item
    finally:
        stop.set()
        # a reader waiting for a free buffer gets None and stops
        pool.put(None)
        while thread.is_alive():
            with contextlib.suppress(queue.Empty):
                while True:
                    out.get_nowait()
            thread.join(0.002)
        thread.join()


def generate(job: Job, *, read_ahead: bool = False) -> Iterator[Any]:
    """Read windows, shuffle within them, and cut batches (the reader's loop).

    Args:
        job: The epoch's work.
        read_ahead: Read windows in a second thread (see :func:`_read_ahead`);
            only when MPI may be called from any thread.
    """
    b = job.batch[0]
    x, y, fill, done = _new_batch(job, b), np.empty(b, np.int64), 0, 0
    windows = _read_ahead(job) if read_ahead else _read_windows(job, None)
    xt_cache: tuple[Any, torch.Tensor] | None = None
    try:
        for xbuf, ybuf, perm, lo, hi in windows:
            if xt_cache is None or xt_cache[0] is not xbuf:
                xt_cache = (xbuf, torch.from_numpy(xbuf))
            xt = xt_cache[1]
            idx = perm[lo:hi]
            while len(idx):
                k = min(b - fill, len(idx))
                torch.index_select(
                    xt, 0, idx[:k], out=torch.from_numpy(x[fill : fill + k])
                )
                y[fill : fill + k] = ybuf[idx[:k].numpy()]
                fill, idx = fill + k, idx[k:]
                if fill == b:
                    yield _finish(job, x, y, fill)
                    done += 1
                    b = job.batch[0]
                    x, y, fill = _new_batch(job, b), np.empty(b, np.int64), 0
        # static shares: every worker takes the same number of steps, so a
        # worker whose share ran out early returns a short or empty batch
        if fill or (job.steps is not None and done < job.steps):
            yield _finish(job, x, y, fill)
            done += 1
        while job.steps is not None and done < job.steps:
            yield _finish(job, x, y, 0)
            done += 1
    finally:
        windows.close()


def _new_batch(job: Job, b: int) -> np.ndarray:
    shape = (b, *job.sample_shape)
    if job.pinned:
        return torch.empty(
            shape, dtype=_torch_dtype(job.dtype), pin_memory=True
        ).numpy()
    return np.empty(shape, dtype=job.dtype)


def _finish(
    job: Job, x: np.ndarray, y: np.ndarray, n: int
) -> tuple[torch.Tensor, torch.Tensor]:
    xt, yt = torch.from_numpy(x[:n]), torch.from_numpy(y[:n].copy())
    if job.norm is not None:
        mean, std = job.norm
        if mean.size > 1:
            view = (1, -1) + (1,) * (len(job.sample_shape) - 1)
            xt = (
                xt.to(torch.float32) - torch.from_numpy(mean).reshape(view)
            ) / torch.from_numpy(std).reshape(view)
        else:
            xt = (xt.to(torch.float32) - float(mean[0])) / float(std[0])
    return xt, yt


def _torch_dtype(dtype: np.dtype) -> torch.dtype:
    return torch.from_numpy(np.empty(0, dtype=dtype)).dtype
