"""The reader's loop for one pass: read windows, permute them, cut batches.

:func:`generate` reads a window of blocks, permutes it and cuts batches of
the worker's size; with ``read_ahead`` the windows are read in a thread of
their own (:func:`_read_ahead`), a window or two ahead of the cutting. A
:class:`Job` carries everything the loop needs and deliberately no loader,
so the threads never keep a dropped loader alive
(:mod:`hybridagg.data.readahead` runs the loop itself in a thread).
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .readahead import STOP
from .reader import SplitReader
from .shares import EpochPlan
from .stats import LoaderStats

__all__ = ["Job", "generate"]


@dataclass
class Job:
    """What the reader needs for one pass; deliberately no loader reference.

    Attributes:
        plan: The epoch's sample order.
        reader: The open files.
        stats: Where the reader counts bytes, read time and windows.
        labels: All labels of each file.
        pieces: ``(window, lo, hi)`` pieces of this worker, in order (a list
            for static shares, a generator drawing chunks for dynamic ones).
        steps: Batches every worker returns (static shares; short or empty
            ones pad a share that ran out), ``None`` for dynamic shares.
        collective_calls: Collective reads every worker makes this pass (0:
            independent reads).
        batch: ``[batch size]``, shared with the loader so that a new size
            applies from the next batch cut.
        capacity: Rows of a window buffer.
        sample_shape: Shape of one sample.
        dtype: Sample dtype.
        pinned: Cut batches into pinned memory (for a CUDA device).
        norm: ``(mean, std)`` to normalise with, or ``None``.
        id_offsets: First sample id of each file: batches then carry the
            ids of their samples as a third item (``None``: they do not).
    """

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
    id_offsets: np.ndarray | None = None


def _read_windows(job: Job, pool: queue.Queue | None) -> Iterator[tuple]:
    """Read the windows the pieces touch; yield ``(xbuf, ybuf, idbuf, perm, lo, hi)``.

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
                idbuf = (
                    None
                    if job.id_offsets is None
                    else np.concatenate(
                        [np.arange(s, c) + job.id_offsets[f] for f, s, c in blocks]
                    )
                )
                perm = torch.from_numpy(plan.window_perm(g))
                current = g
            yield xbuf, ybuf, idbuf, perm, lo, hi
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
    x, y, fill, done = _new_batch(job, b), _new_labels(job, b), 0, 0
    ids = np.empty(b, np.int64) if job.id_offsets is not None else None
    windows = _read_ahead(job) if read_ahead else _read_windows(job, None)
    xt_cache: tuple[Any, torch.Tensor] | None = None
    try:
        for xbuf, ybuf, idbuf, perm, lo, hi in windows:
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
                if ids is not None:
                    ids[fill : fill + k] = idbuf[idx[:k].numpy()]
                fill, idx = fill + k, idx[k:]
                if fill == b:
                    yield _finish(job, x, y, fill, ids)
                    done += 1
                    b = job.batch[0]
                    x, y, fill = _new_batch(job, b), _new_labels(job, b), 0
                    ids = np.empty(b, np.int64) if ids is not None else None
        # static shares: every worker takes the same number of steps, so a
        # worker whose share ran out early returns a short or empty batch
        if fill or (job.steps is not None and done < job.steps):
            yield _finish(job, x, y, fill, ids)
            done += 1
        while job.steps is not None and done < job.steps:
            yield _finish(job, x, y, 0, ids)
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


def _new_labels(job: Job, b: int) -> np.ndarray:
    """A batch's labels: int64 classes ``(b,)``, or float targets ``(b, *target)``."""
    first = job.labels[0] if job.labels else np.zeros(0, np.int64)
    return np.empty((b, *first.shape[1:]), dtype=first.dtype)


def _finish(
    job: Job, x: np.ndarray, y: np.ndarray, n: int, ids: np.ndarray | None = None
) -> tuple:
    """The batch of the first ``n`` rows: ``(x, y)``, with ``ids`` ``(x, y, ids)``."""
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
    if ids is not None:
        return xt, yt, ids[:n].copy()
    return xt, yt


def _torch_dtype(dtype: np.dtype) -> torch.dtype:
    return torch.from_numpy(np.empty(0, dtype=dtype)).dtype
