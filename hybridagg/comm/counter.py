"""A counter held by one rank and served by messages: survives its clients' deaths.

The data loader's dynamic shares draw chunk numbers from a shared counter.
Its usual home is an MPI one-sided window (``hybridagg.data.shares.WindowCounter``):
no rank serves it, but the window spans every worker, freeing it is
collective, and Open MPI does not support its shared-memory windows after a
process failure (a worker killed while it held the window's lock would
leave every other worker spinning inside ``MPI_Fetch_and_op``, beyond any
timeout), and across nodes without RDMA atomics a draw waits until the
window's rank next enters MPI. With ``--on-group-failure continue``, and
for workers on several nodes (:mod:`hybridagg.train.chunks`), the counter
lives instead in parameter server 0 (whose loss ends the job anyway) and is
served by two-sided messages: a dead client can at most leave a request
unanswered, a surviving client's wait is polled and timed, and no draw is
collective (only the end, ``ChunkService.drain``, of a run that loses no
group).

:class:`CounterHost` is the serving side (polled from the host's own loop);
:class:`ServedCounter` is a client, with the interface of the loader's
counters (``fetch_add``, ``read``, ``set``, ``reset``, ``free``).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator, Sequence

import numpy as np
from mpi4py import MPI

from .communicator import Comm
from .ulfm import is_process_failure

__all__ = ["CounterHost", "ServedCounter"]

# request: [op, value]; reply: [value]
_FETCH_ADD, _READ, _SET = 1, 2, 3
_REQUEST, _REPLY = 7101, 7102


class CounterHost:
    """The rank that holds the counter; answers each client's requests.

    Args:
        comm: A communicator of the clients and this rank.
        clients: The clients' ranks on ``comm``.

    Attributes:
        value: The counter.
        dead: Clients found dead (their requests are no longer awaited).
    """

    def __init__(self, comm: Comm, clients: Sequence[int]) -> None:
        self.comm, self.clients = comm, list(clients)
        self.value = 0
        self.dead: set[int] = set()
        self._inbox = {c: np.zeros(2, dtype=np.int64) for c in self.clients}
        self._outbox = {c: np.zeros(1, dtype=np.int64) for c in self.clients}
        self._recv = {c: MPI.REQUEST_NULL for c in self.clients}
        self._sent: dict[int, MPI.Request] = {}
        for c in self.clients:
            self._listen(c)

    def _listen(self, c: int) -> None:
        self._recv[c] = self.comm.mpi.Irecv(self._inbox[c], c, _REQUEST)

    def poll(self) -> int:
        """Answer every request that has arrived; returns how many.

        A client that died is dropped (its receive fails); a reply to a
        client that died is forgotten.
        """
        served = 0
        for c in self.clients:
            if c in self.dead:
                continue
            try:
                if not self._recv[c].Test():
                    continue
                # the previous reply: a client waits for it before asking
                # again, so it has completed (or its client died)
                self._sent.pop(c, MPI.REQUEST_NULL).Test()
            except MPI.Exception as exc:
                if not is_process_failure(exc):
                    raise
                self.dead.add(c)
                continue
            op, arg = int(self._inbox[c][0]), int(self._inbox[c][1])
            self._outbox[c][0] = self.value
            if op == _FETCH_ADD:
                self.value += 1
            elif op == _SET:
                self.value = arg
            self._sent[c] = self.comm.mpi.Isend(self._outbox[c], c, _REPLY)
            self._listen(c)
            served += 1
        return served

    @contextlib.contextmanager
    def background(self, interval: float = 0.0005) -> Iterator[None]:
        """Answer requests from a thread while the block runs.

        For a host's own slow steps that cannot poll: a server's start-up
        builds its optimizer, whose first construction imports for most of
        a second, while workers already draw their first chunks. The block
        must not call :meth:`poll` itself (one poller at a time).

        Args:
            interval: Seconds the thread sleeps between polls.
        """
        stop = threading.Event()
        failed: list[BaseException] = []

        def loop() -> None:
            try:
                while not stop.is_set():
                    if not self.poll():
                        time.sleep(interval)
            except BaseException as exc:  # re-raised by the block's thread
                failed.append(exc)

        thread = threading.Thread(target=loop, name="chunk counter", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join()
        if failed:
            raise failed[0]

    def close(self) -> None:
        """Stop serving: cancel the posted receives, forget the replies in flight."""
        for c in self.clients:
            req = self._recv[c]
            if req != MPI.REQUEST_NULL and c not in self.dead:
                try:
                    req.Cancel()
                    req.Wait()
                except MPI.Exception:
                    pass
        self._recv.clear()
        self._sent.clear()


class ServedCounter:
    """A client of a :class:`CounterHost`, usable from several threads.

    Args:
        comm: The communicator of the clients and the host.
        host: The host's rank on ``comm``.
        clients: A communicator of the clients only (for :meth:`set`, which
            is collective over them), or ``None`` for a single client.
    """

    def __init__(self, comm: Comm, host: int, clients: Comm | None = None) -> None:
        self.comm, self.host, self.clients = comm, host, clients
        self._lock = threading.Lock()
        self._request = np.zeros(2, dtype=np.int64)
        self._reply = np.zeros(1, dtype=np.int64)

    def _ask(self, op: int, arg: int = 0) -> int:
        with self._lock:
            self._request[:] = (op, arg)
            reqs = [
                self.comm.mpi.Irecv(self._reply, self.host, _REPLY),
                self.comm.mpi.Isend(self._request, self.host, _REQUEST),
            ]
            self.comm.wait(reqs, f"chunk counter on rank {self.host}")
            return int(self._reply[0])

    def fetch_add(self) -> int:
        """Take the next number."""
        return self._ask(_FETCH_ADD)

    def read(self) -> int:
        """The next number, without taking it."""
        return self._ask(_READ)

    def set(self, value: int) -> None:
        """Continue from ``value`` once every client gets here (collective over the clients)."""
        if self.clients is not None:
            self.clients.barrier(what="chunk counter set (nobody is taking chunks)")
        if self.clients is None or self.clients.rank == 0:
            self._ask(_SET, int(value))
        if self.clients is not None:
            self.clients.barrier(what="chunk counter set")

    def reset(self) -> None:
        """Start again from 0 (collective over the clients)."""
        self.set(0)

    def free(self) -> None:
        """Nothing to free: the host owns the counter (not collective)."""
