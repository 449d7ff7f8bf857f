"""A heartbeat that finds a dead or stuck rank within ``HYBRIDAGG_FAILURE_TIMEOUT``.

Launchers that keep a job alive after a rank dies (Open MPI's
``--with-ft ulfm`` or ``--enable-recovery``, some ``srun`` settings) leave
the other ranks waiting until their own timeout. A :class:`Heartbeat` runs a
daemon thread on a communicator of its own: every rank sends a tiny message
to the next rank of a ring (``r -> r+1``) every period and watches the
previous one. A ring, not a star: each rank sends and checks one message per
period whatever the job's size, and no monitor rank becomes a bottleneck or
a single point whose own death needs another watcher. A watcher that hears
nothing from its predecessor for :func:`~hybridagg.comm.liveness.silence_limit`
(or sees MPI report its failure) *declares* it: it sends a verdict to every
other rank, so each knows within a fraction of a period. The rank that
declared is the *reporter*; one dead rank has one watcher, so the message
is printed once (two reporters only where two ranks fail within a tick of
each other, each then named by its own watcher).

Declared *solo phases* (work one rank does while the others wait for it:
rank 0's validation, a checkpoint commit) are announced to every rank; the
waits of :mod:`hybridagg.comm.waits` do not count their time against
``HYBRIDAGG_TIMEOUT``, and the heartbeat holds the rank doing them to its
own deadline (``HYBRIDAGG_SOLO_WORK_TIMEOUT``).

What happens on a verdict is the owner's choice (``on_failure``): the
training command ends the job (exit 5 on every rank); a library user can
instead let the next wait raise the :class:`PeerFailure`.
"""

from __future__ import annotations

import queue
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress

import numpy as np
from mpi4py import MPI

from ..runtime.outcomes import PeerFailure
from . import liveness
from .failures import failed_world_ranks, is_peer_failure
from .waits import wait, wait_until

__all__ = ["Heartbeat"]

_BEAT = 1  # tag of the ring's beats (one float64: a sequence number, -1: bye)
_NOTICE = 2  # tag of pickled notices to every rank: phases and verdicts
_BYE = -1.0


def _rank_text(rank: int) -> str:
    return f"rank {rank}"


class Heartbeat:
    """A ring heartbeat over a duplicate of ``comm`` (collective construction).

    Inactive (no thread, no traffic) with a single rank or where MPI does
    not provide ``MPI_THREAD_MULTIPLE``; the waits then keep plain timeouts.

    Args:
        comm: The communicator whose ranks watch each other (duplicated).
        timeout: Seconds within which a dead or stuck rank is declared
            (default ``HYBRIDAGG_FAILURE_TIMEOUT``).
        solo_timeout: Longest solo phase (default
            ``HYBRIDAGG_SOLO_WORK_TIMEOUT``); a rank that exceeds it declares
            itself.
        describe: Names a world rank with its role, for messages.
        on_failure: Called once in the heartbeat's thread when the verdict
            is final, with the failure and whether this rank is the reporter
            (the one rank that should print it). It may end the process.
            Default: only record it (:attr:`failure`; waits raise it).

    Raises:
        ValueError: A timeout is not a finite positive number.
    """

    def __init__(
        self,
        comm: MPI.Comm,
        *,
        timeout: float | None = None,
        solo_timeout: float | None = None,
        describe: Callable[[int], str] = _rank_text,
        on_failure: Callable[[PeerFailure, bool], None] | None = None,
    ) -> None:
        self.timeout = liveness.failure_timeout() if timeout is None else timeout
        self.solo_timeout = (
            liveness.solo_work_timeout() if solo_timeout is None else solo_timeout
        )
        self.period = liveness.beat_period(self.timeout)
        liveness.beat_period(self.solo_timeout)  # validates it
        self.limit = liveness.silence_limit(self.timeout)
        self.tick = self.period / 4
        self.describe = describe
        self.on_failure = on_failure
        self.failure: PeerFailure | None = None
        """The declared failure (set by the heartbeat's thread), or ``None``."""
        self.reporter: int | None = None
        """The rank that declared :attr:`failure`."""
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self._world_ranks = _world_ranks(comm)
        self.pred, self.succ = (self.rank - 1) % self.size, (self.rank + 1) % self.size
        self.active = self.size > 1 and MPI.Query_thread() >= MPI.THREAD_MULTIPLE
        self._clock: tuple[float, float | None] = (0.0, None)
        self._own: list[tuple[str, float]] = []  # this rank's open solo phases
        self._changes: queue.SimpleQueue = queue.SimpleQueue()
        self._stop = threading.Event()
        self._ended = threading.Event()
        self._freed = False
        self.comm: MPI.Comm | None = None
        if not self.active:
            return
        self.comm, req = comm.Idup()
        wait(req, what="duplicating the communicator for the heartbeat")
        self._solo: dict[int, list[str]] = {}
        self._beat_buf = np.zeros(1)
        self._bye_buf = np.array([_BYE])
        self._in_buf = np.zeros(1)
        self._beat_req: MPI.Request | None = None
        self._pred_req = self.comm.Irecv(self._in_buf, self.pred, _BEAT)
        self._pred_gone = False  # the predecessor said bye or was declared
        self._succ_gone = False
        self._sends: list[MPI.Request] = []
        self._bye_req: MPI.Request | None = None
        self._seq = 0
        self._last_heard = time.monotonic()
        liveness.install(self)
        self._thread = threading.Thread(
            target=self._run, name="hybridagg-heartbeat", daemon=True
        )
        self._thread.start()

    def __enter__(self) -> Heartbeat:
        return self

    def __exit__(self, etype, value, tb) -> None:
        if etype is None:
            self.free()
        else:
            self.stop()

    # --- what the waits ask ----------------------------------------------------
    def solo_seconds(self) -> float:
        """Seconds (from an arbitrary origin) during which some rank was in a solo phase."""
        spent, since = self._clock  # one tuple, swapped whole by the thread
        return spent + (time.monotonic() - since if since is not None else 0.0)

    @contextmanager
    def solo(self, name: str) -> Iterator[None]:
        """Declare that this rank works alone on ``name`` while others may wait.

        Every rank learns of it within a tick; their waits stop counting time
        against ``HYBRIDAGG_TIMEOUT`` until it ends. If it lasts longer than
        ``solo_timeout``, this rank declares itself failed, naming ``name``.
        """
        if not self.active or self._stop.is_set():
            yield
            return
        entry = (name, time.monotonic())
        self._own.append(entry)
        self._changes.put(("begin", name))
        try:
            yield
        finally:
            self._own.remove(entry)
            self._changes.put(("end", name))

    # --- teardown ----------------------------------------------------------------
    def free(self) -> None:
        """Stop collectively and release the communicator (every rank calls it).

        Every rank must reach it (the end of a run): a polled barrier while
        the thread still runs (a peer's solo phase keeps the wait alive),
        then each thread says bye to its successor, and stale messages are
        drained so that no later communicator can receive them. After a
        declared failure it only stops this rank's thread.
        """
        if not self.active or self._freed:
            return
        self._freed = True
        if self.failure is not None:
            self.stop()
            return
        wait(self.comm.Ibarrier(), what="the heartbeat's end (every rank)")
        self._stop.set()
        self._thread.join()
        if self.failure is not None:
            return
        if not self._pred_gone:  # its bye completes the receive posted for it
            wait_until(self._pred_said_bye, what="the predecessor's last heartbeat")
        last = [r for r in (self._beat_req, self._bye_req) if r is not None]
        wait([*self._sends, *last], what="the heartbeat's last messages")
        wait(self.comm.Ibarrier(), what="the heartbeat's end (messages sent)")
        status = MPI.Status()
        while (
            msg := self.comm.improbe(MPI.ANY_SOURCE, MPI.ANY_TAG, status)
        ) is not None:
            if status.Get_tag() == _BEAT:
                msg.Recv(np.zeros(1))
            else:
                msg.recv()
        liveness.uninstall(self)
        self.comm.Free()

    def stop(self) -> None:
        """Stop this rank's thread without waiting for the others (an error path).

        The successor is told (bye), so it does not declare this rank dead;
        the communicator is left to the process's end.
        """
        if not self.active:
            return
        self._freed = True
        self._stop.set()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=max(1.0, 4 * self.tick))
        liveness.uninstall(self)

    def conclude(self, failure: PeerFailure) -> None:
        """The main thread met ``failure``: let the heartbeat end the job.

        Waits up to the failure timeout for a verdict (the dead rank's
        watcher declares it; under ULFM within a fraction of a second);
        without one, this rank declares ``failure`` itself. Returns when
        ``on_failure`` has run without ending the process, or when the
        heartbeat is inactive.
        """
        if not self.active or self._stop.is_set():
            return
        if not self._ended.wait(self.timeout + 4 * self.tick):
            if self.failure is None:
                self._changes.put(("declare", failure))
            self._ended.wait(self.timeout + 4 * self.tick)

    # --- the thread ----------------------------------------------------------------
    def _run(self) -> None:
        next_beat = time.monotonic()
        while not self._stop.is_set():
            try:
                self._receive_notices()
                self._apply_changes()
                if self.failure is None:
                    self._hear_predecessor()
                    now = time.monotonic()
                    if now >= next_beat:
                        self._beat()
                        next_beat = now + self.period
                    self._reap_sends()
                    self._check(now)
            except MPI.Exception as exc:
                if not is_peer_failure(exc):
                    raise
                # a send to or probe across a failed rank: its own watcher
                # declares it; acknowledge so receives from any source go on
                self._acknowledge()
            if self.failure is not None:
                self._conclude()
                return
            self._stop.wait(self.tick)
        self._say_bye()

    def _acknowledge(self) -> None:
        with suppress(MPI.Exception, NotImplementedError):
            self.comm.Ack_failed()

    def _receive_notices(self) -> None:
        status = MPI.Status()
        while True:
            try:
                msg = self.comm.improbe(MPI.ANY_SOURCE, _NOTICE, status)
            except MPI.Exception as exc:
                if not is_peer_failure(exc):
                    raise
                self._acknowledge()
                continue
            if msg is None:
                return
            self._apply_notice(status.Get_source(), msg.recv())

    def _apply_notice(self, source: int, notice: tuple) -> None:
        kind = notice[0]
        if kind == "verdict":
            _, text, ranks = notice
            if self.failure is None:
                self.failure, self.reporter = PeerFailure(text, tuple(ranks)), source
        elif kind == "begin":
            self._solo_change(source, notice[1], begin=True)
        elif kind == "end":
            self._solo_change(source, notice[1], begin=False)

    def _solo_change(self, rank: int, name: str, *, begin: bool) -> None:
        was = any(self._solo.values())
        names = self._solo.setdefault(rank, [])
        if begin:
            names.append(name)
        elif name in names:
            names.remove(name)
        now_active = any(self._solo.values())
        spent, since = self._clock
        now = time.monotonic()
        if now_active and not was:
            self._clock = (spent, now)
        elif was and not now_active and since is not None:
            self._clock = (spent + now - since, None)

    def _apply_changes(self) -> None:
        while True:
            try:
                change = self._changes.get_nowait()
            except queue.Empty:
                return
            if change[0] == "declare":
                failure = change[1]
                self._declare(str(failure), failure.ranks)
                continue
            kind, name = change
            self._solo_change(self.rank, name, begin=kind == "begin")
            self._notify_all((kind, name))

    def _notify_all(self, notice: tuple) -> None:
        for dest in range(self.size):
            if dest != self.rank:
                try:
                    self._sends.append(self.comm.isend(notice, dest, _NOTICE))
                except MPI.Exception as exc:
                    if not is_peer_failure(exc):
                        raise

    def _hear_predecessor(self) -> None:
        if self._pred_gone:
            return
        try:
            while self._pred_req.Test():
                self._last_heard = time.monotonic()
                if self._in_buf[0] == _BYE:
                    self._pred_gone = True
                    return
                self._pred_req = self.comm.Irecv(self._in_buf, self.pred, _BEAT)
        except MPI.Exception as exc:
            if not is_peer_failure(exc):
                raise
            ranks = failed_world_ranks(self.comm) or (self._world(self.pred),)
            self._pred_gone = True
            who = ", ".join(self.describe(r) for r in ranks)
            self._declare(f"{who} died (MPI reported a process failure)", ranks)

    def _pred_said_bye(self) -> bool:
        self._hear_predecessor()
        return self._pred_gone

    def _beat(self) -> None:
        if self._succ_gone:
            return
        try:
            if self._beat_req is not None and not self._beat_req.Test():
                return  # the previous beat is still in flight: never pile up
            self._seq += 1
            self._beat_buf[0] = self._seq
            self._beat_req = self.comm.Isend(self._beat_buf, self.succ, _BEAT)
        except MPI.Exception as exc:
            if not is_peer_failure(exc):
                raise
            self._succ_gone = True  # the successor's own watcher declares it

    def _reap_sends(self) -> None:
        if not self._sends:
            return
        try:
            MPI.Request.Testsome(self._sends)
        except MPI.Exception as exc:
            if not is_peer_failure(exc):
                raise
        self._sends = [r for r in self._sends if r != MPI.REQUEST_NULL]

    def _check(self, now: float) -> None:
        silence = now - self._last_heard
        if not self._pred_gone and silence > self.limit:
            pred = self._world(self.pred)
            self._declare(
                f"{self.describe(pred)} is dead or stuck: no heartbeat for "
                f"{silence:.1f} s (HYBRIDAGG_FAILURE_TIMEOUT={self.timeout:g} s)",
                (pred,),
            )
            return
        for name, start in list(self._own):
            if now - start > self.solo_timeout:
                me = self._world(self.rank)
                self._declare(
                    f"{self.describe(me)} spent more than "
                    f"HYBRIDAGG_SOLO_WORK_TIMEOUT={self.solo_timeout:g} s in {name}",
                    (me,),
                )
                return

    def _world(self, rank: int) -> int:
        return self._world_ranks[rank]

    def _declare(self, text: str, ranks: tuple[int, ...]) -> None:
        if self.failure is not None:
            return
        self.failure, self.reporter = PeerFailure(text, tuple(ranks)), self.rank
        self._pred_gone = self._pred_gone or self._world(self.pred) in ranks
        # the declared ranks too: one that is stuck but alive learns it
        self._notify_all(("verdict", text, tuple(ranks)))

    def _conclude(self) -> None:
        """The verdict is out: hand over to ``on_failure`` at once.

        At once on the reporter too: a launcher may end the whole job as
        soon as another rank exits on the verdict, and the message must be
        out by then.
        """
        reporter = self.reporter == self.rank
        if not reporter:
            self._say_bye()  # the successor must not take this exit for a death
        if self.on_failure is not None:
            try:
                self.on_failure(self.failure, reporter)
            except BaseException as exc:  # never die silently in a thread
                sys.stderr.write(f"[hybridagg] heartbeat: on_failure raised {exc!r}\n")
        self._ended.set()

    def _say_bye(self) -> None:
        if self._succ_gone or self._bye_req is not None:
            return
        try:
            self._bye_req = req = self.comm.Isend(self._bye_buf, self.succ, _BEAT)
            deadline = time.monotonic() + max(1.0, 4 * self.tick)
            while not req.Test() and time.monotonic() < deadline:
                time.sleep(self.tick / 16)
        except MPI.Exception as exc:
            if not is_peer_failure(exc):
                raise


def _world_ranks(comm: MPI.Comm) -> list[int]:
    """The ``MPI_COMM_WORLD`` rank of every rank of ``comm``."""
    group, world = comm.Get_group(), MPI.COMM_WORLD.Get_group()
    try:
        return [int(r) for r in MPI.Group.Translate_ranks(group, None, world)]
    finally:
        group.Free()
        world.Free()
