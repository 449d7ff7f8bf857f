"""The read-ahead: batches of the pass being iterated, cut ahead in a thread.

:class:`ReadAhead` is the loader's handle on it: it runs a pass's batch
generator either in a :class:`Prefetcher` thread behind a bounded queue or
inline on the caller's thread, and stops it. Whether a thread may be used at
all is :func:`read_ahead_threads`. Nothing here holds a reference to the
loader, so a dropped loader is collected and the finaliser stops the thread.
"""

from __future__ import annotations

import queue
import threading
import weakref
from collections.abc import Iterator
from typing import Any

__all__ = [
    "STOP",
    "Prefetcher",
    "ReadAhead",
    "close_prefetcher",
    "read_ahead_threads",
]

# The end of a pass, put by a producer thread after its last item.
STOP = object()


def read_ahead_threads(
    prefetch: int, *, thread_multiple: bool, reader_calls_mpi: bool
) -> bool:
    """Whether batches may be read and cut in threads of their own.

    Args:
        prefetch: Batches to keep ready (0: no thread).
        thread_multiple: MPI may be called from any thread
            (``MPI_THREAD_MULTIPLE``); ``True`` without MPI.
        reader_calls_mpi: The reader threads would call MPI (mpio reads, the
            dynamic chunk counter).

    Returns:
        ``False`` where a thread would call MPI that is not thread-multiple:
        those calls then stay on the main thread, without read-ahead.
    """
    return prefetch > 0 and (thread_multiple or not reader_calls_mpi)


class Prefetcher:
    """Runs a batch generator in a daemon thread behind a bounded queue.

    It holds no reference to the loader, so a loader that is dropped is
    collected and its finaliser stops the thread.

    Args:
        gen: The generator (closed by the thread when it stops).
        depth: Items kept ready in the queue.
        timeout: Longest wait of :meth:`get` for an item, in seconds.
        name: The thread's name.
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
                # sleep in put()'s timeout before noticing (a stall of every
                # batch-size change)
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
        """The next item: a batch, an exception of the thread, or :data:`STOP`.

        Raises:
            TimeoutError: Nothing came within ``timeout`` seconds.
        """
        try:
            return self.q.get(timeout=self.timeout)
        except queue.Empty:
            raise TimeoutError(
                f"data loader: no batch from the reader thread within "
                f"{self.timeout:g} s (raise HYBRIDAGG_TIMEOUT if reads are this slow)"
            ) from None

    def close(self, join_timeout: float = 60.0) -> None:
        """Stop the thread: drop what is queued and wait for it to end."""
        self.stop.set()
        while True:
            try:
                self.q.get_nowait()
            except queue.Empty:
                break
        if self.thread is not threading.current_thread():
            self.thread.join(join_timeout)


def close_prefetcher(state: dict) -> None:
    """Stop the prefetcher kept in a read-ahead's state dict, if any."""
    pf = state.pop("prefetcher", None)
    if pf is not None:
        pf.close()


class ReadAhead:
    """Owns the running batch generator of one pass, threaded or inline.

    The generator lives in a plain dict that the finaliser also holds, not in
    an attribute of an object the thread could reach, so dropping the loader
    (and with it this object) stops the thread.

    Args:
        threaded: Run generators in a :class:`Prefetcher` thread (see
            :func:`read_ahead_threads`); otherwise on the caller's thread.
        depth: Batches the thread keeps ready.
        timeout: Longest wait for a batch, in seconds.
        name: The thread's name.
    """

    def __init__(
        self, *, threaded: bool, depth: int, timeout: float, name: str
    ) -> None:
        self.threaded = bool(threaded)
        self.depth, self.timeout, self.name = depth, timeout, name
        self._state: dict = {}
        self._finalizer = weakref.finalize(self, close_prefetcher, self._state)

    def start(self, gen: Iterator) -> None:
        """Begin handing out the items of ``gen``."""
        if self.threaded:
            self._state["prefetcher"] = Prefetcher(
                gen, self.depth, self.timeout, self.name
            )
        else:
            self._state["inline"] = gen

    def next(self) -> Any:
        """The next item of the running generator, or :data:`STOP` at its end.

        Raises:
            BaseException: What the generator raised.
            TimeoutError: The thread gave nothing within ``timeout`` seconds.
        """
        pf = self._state.get("prefetcher")
        if pf is not None:
            item = pf.get()
        else:
            item = next(self._state["inline"], STOP)
        if isinstance(item, BaseException):
            raise item
        return item

    def stop(self) -> None:
        """Stop the running generator (a no-op when none runs)."""
        close_prefetcher(self._state)
        gen = self._state.pop("inline", None)
        if gen is not None:
            gen.close()
