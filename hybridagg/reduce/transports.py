"""Non-blocking collectives over one group, behind one interface.

A transport posts a collective and returns its ``test()`` (drives progress,
true once complete): ``"mpi"`` (CPU tensors straight to MPI through
:class:`hybridagg.collectives.Collectives`, no copy; GPU tensors through
pinned host memory, or directly with a CUDA-aware MPI), ``"torch"`` (a
``torch.distributed`` subgroup: NCCL on CUDA, gloo on CPU) and ``"horovod"``
(Horovod process sets).

The wire format (``wire``, :mod:`hybridagg.comm.wire`): with ``"bf16"`` or
``"fp16"`` the MPI transport sends gradients in that type and forms sums in
float32 (:mod:`hybridagg.collectives.compact`); the ``torch`` transport
rounds each contribution (with error feedback) into a compact copy that the
library sums in the compact type (NCCL and gloo add bf16/fp16 as bf16/fp16)
and widens the result; Horovod's is not supported.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from mpi4py import MPI

from ..collectives import Collectives, CollectiveSettings
from ..comm import (
    Comm,
    ErrorFeedback,
    HostStage,
    as_buffer,
    check_wire,
    wire_dtype,
)
from ..comm.buffers import device_buffer

__all__ = [
    "HorovodTransport",
    "MPITransport",
    "TorchTransport",
    "Transport",
    "make_transport",
]

Test = Callable[[], bool]


class Transport:
    """Non-blocking collectives over one group; each returns a ``test()`` callable.

    Attributes:
        size: Ranks in the group.
        rank: This rank in the group.
        name: Names the group in messages.
    """

    size: int
    rank: int
    name: str
    wire: str = "fp32"
    """The type gradients travel in (``fp32``, ``bf16``, ``fp16``)."""

    @property
    def events(self) -> int:
        """Grows as multi-stage operations advance (polled waits watch it)."""
        return 0

    def start_allreduce(self, buf: torch.Tensor, settled: bool = False) -> Test:
        """Post an in-place sum all-reduce of ``buf``."""
        raise NotImplementedError

    def start_reduce(self, buf: torch.Tensor, root: int) -> Test:
        """Post a sum reduction of ``buf`` into ``root``'s ``buf``."""
        return self.start_allreduce(buf)

    def start_bcast(self, buf: torch.Tensor, root: int) -> Test:
        """Post a broadcast of ``root``'s ``buf``."""
        raise NotImplementedError


class MPITransport(Transport):
    """Tensors of any device to MPI, through the collectives' dispatch.

    A CPU tensor is reduced in its own memory, with no copy. A GPU tensor
    (and, with ``HYBRIDAGG_HOST_STAGING=always``, a CPU one too: the device
    stand-in of CI) is staged by :class:`~hybridagg.comm.HostStage`: copied
    into its pinned host buffer, reduced there by the same algorithms, and
    copied back when the operation completes; with a CUDA-aware MPI a GPU
    tensor goes to ``MPI_Iallreduce`` directly.

    Args:
        comm: The group's communicator, used by this transport alone.
        settings: The collectives' thresholds (default: the environment's).
        wire: The type gradients travel in.
        stage: The host staging (default: ``HYBRIDAGG_HOST_STAGING``).
    """

    def __init__(
        self,
        comm: Comm,
        settings: CollectiveSettings | None = None,
        wire: str = "fp32",
        stage: HostStage | None = None,
    ) -> None:
        self.comm = comm
        self.wire = check_wire(wire)
        self.collectives = Collectives(comm, settings, wire)
        self.stage = HostStage() if stage is None else stage
        self.size, self.rank, self.name = comm.size, comm.rank, comm.name

    @property
    def events(self) -> int:
        return self.collectives.events

    def _device_direct(self, buf: torch.Tensor) -> bool:
        """A GPU tensor that a CUDA-aware MPI reads in place (fp32 wire only:
        the compact wire rounds and sums on the host)."""
        return buf.device.type != "cpu" and self.stage.mode(buf) == "direct"

    def _staged(self, buf: torch.Tensor, host: torch.Tensor, test: Test) -> Test:
        """``test``, which once true has copied ``host`` back into ``buf``."""
        if host is buf:
            return test
        state = {"done": False}

        def staged_test() -> bool:
            if not state["done"] and test():
                self.stage.to_device(host, buf)
                state["done"] = True
            return state["done"]

        return staged_test

    def start_allreduce(self, buf, settled=False):
        if self._device_direct(buf) and self.wire == "fp32":
            self.stage.to_host(buf)  # (direct: synchronises the stream only)
            return self.comm.mpi.Iallreduce(
                MPI.IN_PLACE, device_buffer(buf), MPI.SUM
            ).Test
        host = self._host(buf)
        return self._staged(
            buf, host, self.collectives.start_allreduce(host, settled=settled)
        )

    def _host(self, buf: torch.Tensor) -> torch.Tensor:
        """``buf``'s memory for MPI: itself, or its filled host buffer (a
        direct GPU tensor on a compact wire is staged too)."""
        if self._device_direct(buf):
            host = self.stage.buffer(buf)
            host.copy_(buf.detach())
            return host
        return self.stage.to_host(buf)

    def start_reduce(self, buf, root):
        host = self._host(buf)
        if self.collectives.compacts(host):
            test = self.collectives.start_reduce(host, root)
        elif self.rank == root:
            test = self.comm.mpi.Ireduce(
                MPI.IN_PLACE, as_buffer(host), MPI.SUM, root
            ).Test
        else:
            test = self.comm.mpi.Ireduce(as_buffer(host), None, MPI.SUM, root).Test
        if self.rank != root:  # (only the root's buffer holds the result)
            return test
        return self._staged(buf, host, test)

    def start_bcast(self, buf, root):
        if self.rank == root:
            host = self._host(buf)
        elif self._device_direct(buf) or self.stage.staged(buf):
            host = self.stage.buffer(buf)  # (a receiver needs only the space)
        else:
            host = buf
        if self.collectives.compacts(host):
            test = self.collectives.start_bcast(host, root)
        else:
            test = self.comm.Ibcast(host, root).Test
        if self.rank == root:  # (the root's values did not change)
            return test
        return self._staged(buf, host, test)

    def free(self) -> None:
        """Drop the host buffers."""
        self.stage.free()


class TorchTransport(Transport):
    """A ``torch.distributed`` process group (NCCL on CUDA, gloo on CPU).

    On a compact wire each operation works on a compact copy of the buffer:
    a contribution is rounded into it with error feedback (keyed by the
    buffer), the library moves and sums the copy, and the result is widened
    back once the operation completes.
    """

    def __init__(
        self, group, ranks: list[int], rank: int, name: str, wire: str = "fp32"
    ) -> None:
        self.group, self.ranks = group, ranks
        self.size, self.rank, self.name = len(ranks), ranks.index(rank), name
        self.wire = check_wire(wire)
        dtype = wire_dtype(wire)
        self.feedback = None if dtype == torch.float32 else ErrorFeedback(dtype)

    def _run(self, buf: torch.Tensor, kind: str, start) -> Test:
        """``start(tensor)`` on ``buf``, or on its rounded compact copy."""
        if self.feedback is None or buf.dtype not in (torch.float32, torch.float64):
            return start(buf).is_completed
        wire = torch.empty_like(buf, dtype=self.feedback.dtype)
        self.feedback.round(buf, wire, (kind, buf.data_ptr(), buf.numel()))
        work = start(wire)

        def test() -> bool:
            if not work.is_completed():
                return False
            buf.copy_(wire)
            return True

        return test

    def start_allreduce(self, buf, settled=False):
        import torch.distributed as dist

        return self._run(
            buf,
            "part",
            lambda t: dist.all_reduce(t, group=self.group, async_op=True),
        )

    def start_reduce(self, buf, root):
        import torch.distributed as dist

        return self._run(
            buf,
            "part",
            lambda t: dist.reduce(
                t, dst=self.ranks[root], group=self.group, async_op=True
            ),
        )

    def start_bcast(self, buf, root):
        import torch.distributed as dist

        return self._run(
            buf,
            "bcast",
            lambda t: dist.broadcast(
                t, src=self.ranks[root], group=self.group, async_op=True
            ),
        )


class HorovodTransport(Transport):
    """A Horovod process set."""

    def __init__(self, process_set, ranks: list[int], rank: int, name: str) -> None:
        self.process_set, self.ranks = process_set, ranks
        self.size, self.rank, self.name = len(ranks), ranks.index(rank), name
        self._count = 0

    def _handle(self, handle) -> Test:
        import horovod.torch as hvd

        def test() -> bool:
            if hvd.poll(handle):
                hvd.synchronize(handle)
                return True
            return False

        return test

    def start_allreduce(self, buf, settled=False):
        import horovod.torch as hvd

        self._count += 1
        return self._handle(
            hvd.allreduce_async_(
                buf,
                op=hvd.Sum,
                process_set=self.process_set,
                name=f"hagg.{self._count}",
            )
        )

    def start_bcast(self, buf, root):
        import horovod.torch as hvd

        self._count += 1
        return self._handle(
            hvd.broadcast_async_(
                buf,
                self.ranks[root],
                process_set=self.process_set,
                name=f"hagg.{self._count}",
            )
        )


def make_transport(
    backend: str,
    comm: Comm,
    ranks: list[int],
    world_rank: int,
    handle=None,
    settings: CollectiveSettings | None = None,
    wire: str = "fp32",
    stage: HostStage | None = None,
) -> Transport:
    """Build the transport of one group.

    Args:
        backend: ``"mpi"``, ``"torch"`` or ``"horovod"``.
        comm: The group's MPI communicator (always needed: it names the group).
        ranks: The group's ranks in the numbering of ``handle``'s backend.
        world_rank: This rank in that numbering.
        handle: The ``torch.distributed`` process group or Horovod process set.
        settings: The MPI collectives' thresholds (``"mpi"`` only).
        wire: The type gradients travel in (``fp32``; ``bf16`` and ``fp16``
            with ``"mpi"`` and ``"torch"``).
        stage: ``"mpi"``: the host staging (default: ``HYBRIDAGG_HOST_STAGING``).

    Raises:
        ValueError: Unknown backend or wire format, or a compact wire with
            Horovod.
    """
    if backend == "mpi":
        return MPITransport(comm, settings, wire, stage)
    if backend == "torch":
        return TorchTransport(handle, ranks, world_rank, comm.name, wire)
    if check_wire(wire) != "fp32" and backend == "horovod":
        raise ValueError(
            f"wire {wire!r} needs the mpi or torch all-reduce backend, not horovod"
        )
    if backend == "horovod":
        return HorovodTransport(handle, ranks, world_rank, comm.name)
    raise ValueError(
        f"allreduce_backend must be 'mpi', 'torch' or 'horovod', got {backend!r}"
    )
