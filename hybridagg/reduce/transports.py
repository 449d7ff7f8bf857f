"""Non-blocking collectives over one group, behind one interface.

A transport posts a collective and returns its ``test()`` (drives progress,
true once complete): ``"mpi"`` (CPU tensors straight to MPI through
:class:`hybridagg.collectives.Collectives`, no copy), ``"torch"`` (a
``torch.distributed`` subgroup: NCCL on CUDA, gloo on CPU) and ``"horovod"``
(Horovod process sets).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from mpi4py import MPI

from ..collectives import Collectives, CollectiveSettings
from ..comm import Comm, as_buffer

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
    """CPU tensors straight to MPI, through the collectives' dispatch.

    Args:
        comm: The group's communicator, used by this transport alone.
        settings: The collectives' thresholds (default: the environment's).
    """

    def __init__(self, comm: Comm, settings: CollectiveSettings | None = None) -> None:
        self.comm = comm
        self.collectives = Collectives(comm, settings)
        self.size, self.rank, self.name = comm.size, comm.rank, comm.name

    @property
    def events(self) -> int:
        return self.collectives.events

    def start_allreduce(self, buf, settled=False):
        return self.collectives.start_allreduce(buf, settled=settled)

    def start_reduce(self, buf, root):
        if self.rank == root:
            req = self.comm.mpi.Ireduce(MPI.IN_PLACE, as_buffer(buf), MPI.SUM, root)
        else:
            req = self.comm.mpi.Ireduce(as_buffer(buf), None, MPI.SUM, root)
        return req.Test

    def start_bcast(self, buf, root):
        return self.comm.Ibcast(buf, root).Test


class TorchTransport(Transport):
    """A ``torch.distributed`` process group (NCCL on CUDA, gloo on CPU)."""

    def __init__(self, group, ranks: list[int], rank: int, name: str) -> None:
        self.group, self.ranks = group, ranks
        self.size, self.rank, self.name = len(ranks), ranks.index(rank), name

    def start_allreduce(self, buf, settled=False):
        import torch.distributed as dist

        return dist.all_reduce(buf, group=self.group, async_op=True).is_completed

    def start_reduce(self, buf, root):
        import torch.distributed as dist

        work = dist.reduce(buf, dst=self.ranks[root], group=self.group, async_op=True)
        return work.is_completed

    def start_bcast(self, buf, root):
        import torch.distributed as dist

        work = dist.broadcast(
            buf, src=self.ranks[root], group=self.group, async_op=True
        )
        return work.is_completed


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
) -> Transport:
    """Build the transport of one group.

    Args:
        backend: ``"mpi"``, ``"torch"`` or ``"horovod"``.
        comm: The group's MPI communicator (always needed: it names the group).
        ranks: The group's ranks in the numbering of ``handle``'s backend.
        world_rank: This rank in that numbering.
        handle: The ``torch.distributed`` process group or Horovod process set.
        settings: The MPI collectives' thresholds (``"mpi"`` only).

    Raises:
        ValueError: Unknown backend.
    """
    if backend == "mpi":
        return MPITransport(comm, settings)
    if backend == "torch":
        return TorchTransport(handle, ranks, world_rank, comm.name)
    if backend == "horovod":
        return HorovodTransport(handle, ranks, world_rank, comm.name)
    raise ValueError(
        f"allreduce_backend must be 'mpi', 'torch' or 'horovod', got {backend!r}"
    )
