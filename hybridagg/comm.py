"""The communicator wrapper every hybridagg module talks to MPI through.

Three rules live here so no other module has to remember them:

* **Never block inside MPI.** A rank blocked in ``MPI_Recv`` or
  ``MPI_Allreduce`` on a peer that is busy spins a full core for the whole
  wait (Open MPI, with or without oversubscription). Every operation is
  posted non-blocking and completed through :func:`poll`, which tests with a
  short spin, then sleeps with a back-off proportional to the time already
  waited (so the overshoot stays a few percent of the operation's own time),
  capped at ``HYBRIDAGG_POLL_MAX_SLEEP_US``. Every wait has a timeout and
  raises :class:`CommTimeoutError` naming the operation and peer.
* **No copies.** Contiguous CPU tensors and numpy arrays are handed to MPI as
  buffers over their own memory (:func:`as_buffer`).
* **No hangs on errors.** :meth:`Comm.check` turns an error on one rank into
  the same error on every rank; :func:`install_abort_hook` turns an unhandled
  exception into ``MPI_Abort`` with the rank and reason.
"""

from __future__ import annotations

import builtins
import pickle
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from mpi4py import MPI

from .runtime import envvars

__all__ = [
    "Comm",
    "CommTimeoutError",
    "RemoteError",
    "alloc",
    "as_buffer",
    "configure_threads",
    "default_timeout",
    "install_abort_hook",
    "mpi_dtype",
    "poll",
    "ring_min_bytes",
    "settled_max_bytes",
    "wait",
]


class CommTimeoutError(TimeoutError):
    """A wait on MPI did not complete within its timeout."""


class RemoteError(RuntimeError):
    """An error raised on another rank, re-raised here by :meth:`Comm.check`."""


_TORCH_TO_MPI = {
    torch.float32: MPI.FLOAT,
    torch.float64: MPI.DOUBLE,
    torch.int8: MPI.INT8_T,
    torch.uint8: MPI.UINT8_T,
    torch.int16: MPI.INT16_T,
    torch.int32: MPI.INT32_T,
    torch.int64: MPI.INT64_T,
    torch.bool: MPI.C_BOOL,
    torch.complex64: MPI.C_FLOAT_COMPLEX,
    torch.complex128: MPI.C_DOUBLE_COMPLEX,
}
_NUMPY_TO_MPI = {
    np.dtype(np.float32): MPI.FLOAT,
    np.dtype(np.float64): MPI.DOUBLE,
    np.dtype(np.int8): MPI.INT8_T,
    np.dtype(np.uint8): MPI.UINT8_T,
    np.dtype(np.int16): MPI.INT16_T,
    np.dtype(np.int32): MPI.INT32_T,
    np.dtype(np.int64): MPI.INT64_T,
    np.dtype(np.bool_): MPI.C_BOOL,
    np.dtype(np.complex64): MPI.C_FLOAT_COMPLEX,
    np.dtype(np.complex128): MPI.C_DOUBLE_COMPLEX,
}


def default_timeout() -> float:
    """Return ``HYBRIDAGG_TIMEOUT`` in seconds (600 unless set)."""
    value = envvars.get_float("HYBRIDAGG_TIMEOUT")
    if value is None or value <= 0:
        raise ValueError(f"HYBRIDAGG_TIMEOUT must be a positive number, got {value}")
    return value


def mpi_dtype(dtype: torch.dtype | np.dtype) -> MPI.Datatype:
    """Return the MPI datatype for a torch or numpy dtype.

    Raises:
        TypeError: MPI has no reducible type for it (float16, bfloat16, ...).
    """
    if isinstance(dtype, torch.dtype):
        table, key = _TORCH_TO_MPI, dtype
    else:
        table, key = _NUMPY_TO_MPI, np.dtype(dtype)
    try:
        return table[key]
    except KeyError:
        raise TypeError(
            f"dtype {dtype} has no MPI datatype; convert to float32 first"
        ) from None


def as_buffer(x: torch.Tensor | np.ndarray) -> list:
    """Describe a tensor's or array's own memory as an MPI buffer, without a copy.

    The caller keeps ``x`` alive until any request using the buffer completes.

    Args:
        x: A contiguous CPU ``torch.Tensor`` or C-contiguous ``numpy.ndarray``.

    Returns:
        ``[buffer, count, datatype]`` as mpi4py's buffer arguments take it.

    Raises:
        TypeError: ``x`` is neither, lives on a GPU, or has no MPI dtype.
        ValueError: ``x`` is not contiguous.
    """
    if isinstance(x, torch.Tensor):
        if x.device.type != "cpu":
            raise TypeError(
                f"as_buffer needs a CPU tensor, got one on {x.device}; GPU "
                "tensors are reduced through torch.distributed (NCCL)"
            )
        if not x.is_contiguous():
            raise ValueError("as_buffer needs a contiguous tensor (call .contiguous())")
        dtype = mpi_dtype(x.dtype)
        mem = MPI.buffer.fromaddress(x.data_ptr(), x.numel() * x.element_size())
        return [mem, x.numel(), dtype]
    if isinstance(x, np.ndarray):
        if not x.flags.c_contiguous:
            raise ValueError("as_buffer needs a C-contiguous array")
        return [x, x.size, mpi_dtype(x.dtype)]
    raise TypeError(f"as_buffer takes a torch.Tensor or numpy.ndarray, got {type(x)}")


def alloc(
    numel: int, dtype: torch.dtype = torch.float32, *, zero: bool = True
) -> torch.Tensor:
    """A 1-D CPU tensor for communication, in memory that may use huge pages.

    Measured here (Linux with transparent huge pages in ``madvise`` mode),
    moving 64 MiB between two ranks took ~50% longer from torch-allocated
    memory than from numpy-allocated memory: numpy advises the kernel to back
    large arrays with huge pages, torch's allocator does not, and the
    single-copy shared-memory transport walks every 4 KiB page. hybridagg's
    own buffers (buckets, shards, parameter-server messages, the ring's
    scratch space) therefore come from here. Dtypes numpy lacks fall back to
    torch's allocator.
    """
    try:
        np_dtype = torch.empty(0, dtype=dtype).numpy().dtype
    except TypeError:
        return (torch.zeros if zero else torch.empty)(numel, dtype=dtype)
    array = (np.zeros if zero else np.empty)(numel, dtype=np_dtype)
    return torch.from_numpy(array)


def _poll_params() -> tuple[float, float]:
    spin = envvars.get_float("HYBRIDAGG_POLL_SPIN_US") or 0.0
    cap = envvars.get_float("HYBRIDAGG_POLL_MAX_SLEEP_US") or 2000.0
    return spin * 1e-6, max(cap, 1.0) * 1e-6


def _reduce_timer_slack() -> None:
    """Ask Linux for 1 us timer slack (default 50 us) so short sleeps stay short.

    A polled wait sleeps for tens of microseconds between tests; with the
    default slack each such sleep lasts at least ~60 us, which adds straight
    to the latency of small messages. Best effort: ignored where unsupported.
    """
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(29, 1000, 0, 0, 0)  # PR_SET_TIMERSLACK, nanoseconds
    except (OSError, AttributeError):
        pass


_reduce_timer_slack()


def ring_min_bytes() -> int:
    """``HYBRIDAGG_RING_MIN_BYTES``: the smallest sum all-reduce that takes the ring."""
    value = envvars.get_int("HYBRIDAGG_RING_MIN_BYTES")
    return 2**20 if value is None else value


def _ring_chunk_bytes() -> int:
    value = envvars.get_int("HYBRIDAGG_RING_CHUNK_BYTES")
    if value is not None and value < 1:
        raise ValueError(f"HYBRIDAGG_RING_CHUNK_BYTES must be positive, got {value}")
    return 4 * 2**20 if value is None else value


def settled_max_bytes() -> int:
    """``HYBRIDAGG_SETTLED_MAX_BYTES``: the largest settled all-reduce done by blocking calls."""
    value = envvars.get_int("HYBRIDAGG_SETTLED_MAX_BYTES")
    return 32 * 2**20 if value is None else value


# The sleep after t seconds of waiting is t * _BACKOFF_FRACTION (capped), so
# the time a wait overshoots completion stays within a few percent of t.
_BACKOFF_FRACTION = 1.0 / 32.0
_MIN_SLEEP_S = 10e-6


def poll(
    done: Callable[[], bool],
    *,
    what: str,
    timeout: float | None = None,
    activity: Callable[[], int] | None = None,
    spin: float | None = None,
    max_sleep: float | None = None,
) -> float:
    """Wait until ``done()`` is true without burning a core.

    Calls ``done`` in a tight loop for ``HYBRIDAGG_POLL_SPIN_US``, then sleeps
    between calls for ``idle / 32`` (at least 10 us, at most
    ``HYBRIDAGG_POLL_MAX_SLEEP_US``), where ``idle`` is the time since the
    wait began or since ``activity()`` last changed. ``done`` is expected to
    drive MPI progress (``MPI_Test``), which it does on every call. A
    multi-stage operation (the ring all-reduce) reports each completed stage
    through ``activity``, so it is tested at full speed while data moves and
    backs off only while it waits for a peer.

    Args:
        done: Returns true when the awaited thing has happened.
        what: Names the operation and peer for the timeout message.
        timeout: Seconds before giving up (default ``HYBRIDAGG_TIMEOUT``).
        activity: A counter that grows whenever the operation advances.
        spin: Seconds to spin before sleeping, instead of
            ``HYBRIDAGG_POLL_SPIN_US``: for waits known to be short (every
            peer has arrived), where a sleep woken late would cost more
            than the wait.
        max_sleep: Seconds, a lower back-off cap than
            ``HYBRIDAGG_POLL_MAX_SLEEP_US`` (never a higher one): for a
            service whose reaction time adds to its clients' latency (a
            parameter server waiting for the next push).

    Returns:
        Seconds waited.

    Raises:
        CommTimeoutError: ``done`` stayed false for ``timeout`` seconds.
    """
    start = time.perf_counter()
    if done():
        return 0.0
    if timeout is None:
        timeout = default_timeout()
    default_spin, cap = _poll_params()
    spin = default_spin if spin is None else spin
    if max_sleep is not None:
        cap = min(cap, max(_MIN_SLEEP_S, max_sleep))
    since, seen = start, activity() if activity is not None else 0
    while True:
        if done():
            return time.perf_counter() - start
        now = time.perf_counter()
        if activity is not None:
            current = activity()
            if current != seen:
                since, seen = now, current
        idle = now - since
        if idle >= spin:
            if now - start >= timeout:
                rank = MPI.COMM_WORLD.Get_rank() if MPI.Is_initialized() else -1
                raise CommTimeoutError(
                    f"rank {rank}: {what} did not complete within {timeout:g} s "
                    "(raise HYBRIDAGG_TIMEOUT if the peer is legitimately slow)"
                )
            time.sleep(min(cap, max(_MIN_SLEEP_S, idle * _BACKOFF_FRACTION)))


def wait(
    requests: MPI.Request | Sequence[MPI.Request],
    *,
    what: str,
    timeout: float | None = None,
) -> float:
    """Complete one or several MPI requests through :func:`poll`.

    With several requests, each one that completes counts as activity, so a
    train of messages that arrive one after another (the parts of a
    parameter-server reply) is received at full speed, not one per back-off
    sleep: MPI moves a large message only inside the receiver's test calls.

    Args:
        requests: A request or a sequence of requests.
        what: Operation and peer or group, for the timeout message.
        timeout: Seconds (default ``HYBRIDAGG_TIMEOUT``).

    Returns:
        Seconds waited.
    """
    if isinstance(requests, MPI.Request):
        req = requests
        return poll(req.Test, what=what, timeout=timeout)
    reqs = list(requests)
    if not reqs:
        return 0.0
    if len(reqs) == 1:
        return poll(reqs[0].Test, what=what, timeout=timeout)
    completed = [0]

    def done() -> bool:
        index = MPI.Request.Testsome(reqs)
        if index:
            completed[0] += len(index)
        return all(r == MPI.REQUEST_NULL for r in reqs)

    return poll(done, what=what, timeout=timeout, activity=lambda: completed[0])


class Comm:
    """A communicator with cached rank/size and polled, timed operations.

    Construct it once from the user's communicator (which is duplicated, so
    hybridagg's traffic never mixes with the user's); derive others with
    :meth:`split`, which does not duplicate again.

    Args:
        comm: The user's mpi4py communicator (default ``MPI.COMM_WORLD``).
        name: Names this communicator in error messages.
        dup: Duplicate ``comm`` (default). Pass ``False`` only for a
            communicator hybridagg created itself.
        timeout: Default timeout of its waits (``HYBRIDAGG_TIMEOUT``).
    """

    def __init__(
        self,
        comm: MPI.Comm | None = None,
        *,
        name: str = "world",
        dup: bool = True,
        timeout: float | None = None,
    ) -> None:
        base = MPI.COMM_WORLD if comm is None else comm
        if not isinstance(base, MPI.Comm):
            raise TypeError(f"comm must be an mpi4py MPI.Comm, got {type(base)}")
        if base == MPI.COMM_NULL:
            raise ValueError("comm is MPI.COMM_NULL")
        self.name = name
        self.timeout = default_timeout() if timeout is None else float(timeout)
        if dup:
            self.mpi, req = base.Idup()
            wait(
                req,
                what=f"duplicating the communicator for {name}",
                timeout=self.timeout,
            )
        else:
            self.mpi = base
        self.rank: int = self.mpi.Get_rank()
        self.size: int = self.mpi.Get_size()
        self.events = 0  # stages completed by multi-stage operations (ring)
        self._rings = 0
        self._world_rank = MPI.COMM_WORLD.Get_rank()

    def __repr__(self) -> str:
        return f"Comm({self.name!r}, rank={self.rank}, size={self.size})"

    # --- construction ------------------------------------------------------
    def split(self, color: int | None, key: int = 0, *, name: str) -> Comm | None:
        """Split into sub-communicators; ranks passing ``color=None`` get ``None``.

        This is collective over this communicator.
        """
        self.barrier(what=f"split of {self.name} into {name}")
        sub = self.mpi.Split(MPI.UNDEFINED if color is None else int(color), key)
        if sub == MPI.COMM_NULL:
            return None
        return Comm(sub, name=name, dup=False, timeout=self.timeout)

    def split_shared(self, *, name: str = "node") -> Comm:
        """Split into node-local communicators (``MPI_COMM_TYPE_SHARED``)."""
        self.barrier(what=f"split of {self.name} into {name}")
        sub = self.mpi.Split_type(MPI.COMM_TYPE_SHARED, key=self.rank)
        return Comm(sub, name=name, dup=False, timeout=self.timeout)

    def dup(self, name: str) -> Comm:
        """A new communicator over the same ranks, for traffic of its own (collective)."""
        return Comm(self.mpi, name=name, dup=True, timeout=self.timeout)

    def free(self) -> None:
        """Free the underlying communicator (not ``COMM_WORLD``/``COMM_SELF``)."""
        if self.mpi not in (MPI.COMM_WORLD, MPI.COMM_SELF, MPI.COMM_NULL):
            self.mpi.Free()

    # --- waiting -----------------------------------------------------------
    def wait(
        self,
        requests: MPI.Request | Sequence[MPI.Request],
        what: str,
        timeout: float | None = None,
    ) -> float:
        """:func:`wait` with this communicator's timeout and name in the message."""
        return wait(
            requests,
            what=f"{what} on {self.name} (rank {self.rank}/{self.size})",
            timeout=self.timeout if timeout is None else timeout,
        )

    # --- tensor collectives (in place) --------------------------------------
    def iallreduce(
        self, x: torch.Tensor | np.ndarray, op: MPI.Op = MPI.SUM
    ) -> MPI.Request:
        """Post an in-place all-reduce of ``x``; complete it with :meth:`wait`."""
        return self.mpi.Iallreduce(MPI.IN_PLACE, as_buffer(x), op)

    def start_allreduce(
        self,
        x: torch.Tensor,
        *,
        settled: bool = False,
    ) -> Callable[[], bool]:
        """Post an in-place sum all-reduce of a CPU tensor; returns its ``test()``.

        Buffers of at least ``HYBRIDAGG_RING_MIN_BYTES`` go through the
        pipelined ring (:mod:`hybridagg.ring`), smaller ones through
        ``MPI_Iallreduce``. Every rank must pass the same size and
        ``settled``.

        Args:
            x: A contiguous CPU tensor, reduced in place.
            settled: Every rank has nothing left to overlap and is known to
                have arrived (the caller saw a collective complete that each
                rank posted just before this call, e.g. the last gradient
                bucket after ``synchronize()``'s control all-reduce).
                Buffers below ``HYBRIDAGG_SETTLED_MAX_BYTES`` are then
                reduced right away by blocking calls
                (:func:`hybridagg.ring.settled_allreduce`), the fastest choice
                up to mid sizes here; they cannot spin long since nobody is
                late.
        """
        nbytes = x.numel() * x.element_size()
        if settled and nbytes < settled_max_bytes():
            from .ring import settled_allreduce

            settled_allreduce(self, x)
            return lambda: True
        if self.size > 1 and nbytes >= ring_min_bytes():
            from .ring import RingAllreduce

            ring = RingAllreduce(self, x, self._rings, _ring_chunk_bytes())
            self._rings += 1
            return ring.test
        return self.iallreduce(x).Test

    def allreduce(
        self, x: torch.Tensor | np.ndarray, op: MPI.Op = MPI.SUM, *, what: str = ""
    ) -> torch.Tensor | np.ndarray:
        """All-reduce ``x`` in place (polled); returns ``x``.

        Sums of CPU tensors of at least ``HYBRIDAGG_RING_MIN_BYTES`` and
        below ``HYBRIDAGG_SETTLED_MAX_BYTES`` wait in a polled barrier and
        then take a ring of blocking ``MPI_Sendrecv`` calls
        (:func:`hybridagg.ring.settled_allreduce`: this call has nothing to
        overlap, and once everyone is there blocking calls are the fastest);
        larger ones take the pipelined ring (see :meth:`start_allreduce`).
        """
        if self.size == 1:
            return x
        if op == MPI.SUM and isinstance(x, torch.Tensor) and x.is_contiguous():
            nbytes = x.numel() * x.element_size()
            settled = ring_min_bytes() <= nbytes < settled_max_bytes()
            if settled:
                self.barrier(what=what or "allreduce")
            test = self.start_allreduce(x, settled=settled)
            self.wait_for(test, what or "allreduce", activity=lambda: self.events)
        else:
            self.wait(self.iallreduce(x, op), what or "allreduce")
        return x

    def ibcast(self, x: torch.Tensor | np.ndarray, root: int = 0) -> MPI.Request:
        """Post a broadcast of ``x`` from ``root`` into every rank's ``x``."""
        return self.mpi.Ibcast(as_buffer(x), root=root)

    def bcast(
        self, x: torch.Tensor | np.ndarray, root: int = 0, *, what: str = ""
    ) -> torch.Tensor | np.ndarray:
        """Broadcast ``x`` in place from ``root`` (polled); returns ``x``."""
        if self.size > 1:
            self.wait(self.ibcast(x, root), what or f"bcast from {root}")
        return x

    def barrier(self, *, what: str = "barrier", timeout: float | None = None) -> None:
        """A polled barrier."""
        if self.size > 1:
            self.wait(self.mpi.Ibarrier(), what, timeout)

    # --- point to point ------------------------------------------------------
    def isend(
        self, x: torch.Tensor | np.ndarray, dest: int, tag: int = 0
    ) -> MPI.Request:
        """Post a send of ``x`` to ``dest``."""
        return self.mpi.Isend(as_buffer(x), dest, tag)

    def irecv(
        self, x: torch.Tensor | np.ndarray, source: int = MPI.ANY_SOURCE, tag: int = 0
    ) -> MPI.Request:
        """Post a receive into ``x`` from ``source``."""
        return self.mpi.Irecv(as_buffer(x), source, tag)

    def isend_obj(self, obj: Any, dest: int, tag: int = 0) -> tuple[MPI.Request, Any]:
        """Post a send of a picklable object; keep the returned buffer until done."""
        payload = np.frombuffer(pickle.dumps(obj, protocol=5), dtype=np.uint8)
        return self.mpi.Isend([payload, MPI.UINT8_T], dest, tag), payload

    def recv_obj(self, source: int, tag: int = 0, *, what: str = "") -> Any:
        """Receive a picklable object sent with :meth:`isend_obj` (polled)."""
        status = MPI.Status()
        self.wait_for(
            lambda: self.mpi.Iprobe(source, tag, status),
            what or f"object from rank {source} (tag {tag})",
        )
        payload = np.empty(status.Get_count(MPI.UINT8_T), dtype=np.uint8)
        req = self.mpi.Irecv([payload, MPI.UINT8_T], status.Get_source(), tag)
        self.wait(req, what or f"object from rank {source}")
        return pickle.loads(payload.tobytes())

    def wait_for(
        self,
        done: Callable[[], bool],
        what: str,
        timeout: float | None = None,
        activity: Callable[[], int] | None = None,
        spin: float | None = None,
        max_sleep: float | None = None,
    ) -> float:
        """:func:`poll` on an arbitrary condition, with this communicator's timeout.

        ``activity``, ``spin`` and ``max_sleep`` are passed to :func:`poll`
        as they are.
        """
        return poll(
            done,
            what=f"{what} on {self.name} (rank {self.rank}/{self.size})",
            timeout=self.timeout if timeout is None else timeout,
            activity=activity,
            spin=spin,
            max_sleep=max_sleep,
        )

    # --- small Python objects -------------------------------------------------
    def allgather_obj(self, obj: Any, *, what: str = "allgather of objects") -> list:
        """Gather a picklable object from every rank to every rank (polled)."""
        if self.size == 1:
            return [obj]
        data = np.frombuffer(pickle.dumps(obj, protocol=5), dtype=np.uint8)
        sizes = np.zeros(self.size, dtype=np.int64)
        sizes[self.rank] = data.size
        self.wait(self.mpi.Iallgather(MPI.IN_PLACE, sizes), what)
        offsets = np.concatenate(([0], np.cumsum(sizes)[:-1]))
        out = np.empty(int(sizes.sum()), dtype=np.uint8)
        req = self.mpi.Iallgatherv(data, [out, sizes, offsets, MPI.UINT8_T])
        self.wait(req, what)
        return [
            pickle.loads(out[o : o + s].tobytes())
            for o, s in zip(offsets.tolist(), sizes.tolist(), strict=True)
        ]

    def bcast_obj(self, obj: Any, root: int = 0, *, what: str = "") -> Any:
        """Broadcast a picklable object from ``root`` (polled)."""
        if self.size == 1:
            return obj
        what = what or f"bcast of an object from {root}"
        size = np.zeros(1, dtype=np.int64)
        if self.rank == root:
            payload = np.frombuffer(pickle.dumps(obj, protocol=5), dtype=np.uint8)
            size[0] = payload.size
        self.bcast(size, root, what=what)
        if self.rank != root:
            payload = np.empty(int(size[0]), dtype=np.uint8)
        self.bcast(payload, root, what=what)
        return obj if self.rank == root else pickle.loads(payload.tobytes())

    # --- agreement on errors --------------------------------------------------
    def check(self, error: BaseException | None, *, what: str = "") -> None:
        """Raise the same error on every rank if any rank passes one.

        Every rank must call this (it is collective). The error of the lowest
        failing rank is re-raised everywhere with the same message, prefixed
        by that rank; its type is kept for the common built-in exceptions
        (``ValueError``, ``IsADirectoryError``, ...: the most derived built-in
        class) and is a :class:`RemoteError` otherwise.

        Args:
            error: This rank's exception, or ``None`` if it succeeded.
            what: What was being checked, for the message.
        """
        if error is None:
            local = None
        else:
            local = (type(error).__name__, str(error), _builtin_name(error))
        reports = self.allgather_obj(local, what=what or "error agreement")
        for rank, report in enumerate(reports):
            if report is None:
                continue
            tname, msg, builtin = report
            text = f"[rank {self._world_of(rank)}] {msg}"
            cls = getattr(builtins, builtin) if builtin else RemoteError
            try:
                exc = cls(text)
            except TypeError:  # a built-in that takes more than a message
                cls = RemoteError
            if cls is RemoteError:
                exc = RemoteError(f"[rank {self._world_of(rank)}] {tname}: {msg}")
            if error is not None and rank == self.rank:
                raise exc from error
            raise exc

    def _world_of(self, rank: int) -> int:
        if self.mpi == MPI.COMM_WORLD:
            return rank
        try:
            grp, world = self.mpi.Get_group(), MPI.COMM_WORLD.Get_group()
            return int(MPI.Group.Translate_ranks(grp, [rank], world)[0])
        except MPI.Exception:
            return rank


def _builtin_name(error: BaseException) -> str | None:
    """Name of the most derived built-in exception class ``error`` is an instance of."""
    for cls in type(error).__mro__:
        if (
            issubclass(cls, Exception)
            and cls.__module__ == "builtins"
            and getattr(builtins, cls.__name__, None) is cls
            and cls is not Exception
        ):
            return cls.__name__
    return None


_hook_lock = threading.Lock()
_hook_installed = False


def install_abort_hook() -> bool:
    """Make an unhandled exception on any rank abort the whole MPI job.

    Like ``python -m mpi4py``: the traceback is printed, then one line naming
    the rank and reason, then ``MPI_Abort`` so the other ranks do not wait
    forever in a collective. Threads are covered too. Does nothing with a
    single rank or when ``HYBRIDAGG_ABORT_ON_ERROR=0``.

    Returns:
        Whether the hook is installed.
    """
    global _hook_installed
    with _hook_lock:
        if _hook_installed:
            return True
        if not envvars.get_bool("HYBRIDAGG_ABORT_ON_ERROR"):
            return False
        if MPI.COMM_WORLD.Get_size() == 1:
            return False
        previous = sys.excepthook

        def _abort(etype, value) -> None:
            rank = MPI.COMM_WORLD.Get_rank()
            sys.stderr.write(
                f"[hybridagg] rank {rank}: unhandled {etype.__name__}: {value}; "
                "aborting the MPI job\n"
            )
            sys.stderr.flush()
            sys.stdout.flush()
            MPI.COMM_WORLD.Abort(1)

        def excepthook(etype, value, tb) -> None:
            previous(etype, value, tb)
            _abort(etype, value)

        def thread_hook(args) -> None:
            if args.exc_type is SystemExit:
                return
            threading.__excepthook__(args)
            _abort(args.exc_type, args.exc_value)

        sys.excepthook = excepthook
        threading.excepthook = thread_hook
        _hook_installed = True
        return True


def configure_threads(num_threads: int | None = None) -> int:
    """Set the compute threads of this rank (``torch.set_num_threads``).

    Several ranks usually share a node's cores, so the default is one thread
    per rank: ``num_threads``, else ``HYBRIDAGG_NUM_THREADS``, else
    ``OMP_NUM_THREADS``, else 1. ``OMP_NUM_THREADS`` is exported for child
    processes.

    Returns:
        The number of threads set.

    Raises:
        ValueError: The number is not positive.
    """
    n = num_threads
    if n is None:
        n = envvars.get_int("HYBRIDAGG_NUM_THREADS")
    if n is None:
        n = envvars.get_int("OMP_NUM_THREADS")
    if n is None:
        n = 1
    if n < 1:
        raise ValueError(f"number of compute threads must be >= 1, got {n}")
    torch.set_num_threads(n)
    envvars.export("OMP_NUM_THREADS", str(n))
    return n
