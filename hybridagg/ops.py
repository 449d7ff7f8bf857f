"""Horovod-style collective primitives on tensors, over a hybridagg communicator.

``allreduce``, ``allreduce_async_`` + ``synchronize``, ``broadcast``: the names
Horovod users know, working in place on CPU tensors without copies and
waiting through the polled :func:`hybridagg.comm.wait`. The communicator is
passed in: a :class:`hybridagg.comm.Comm`, or a topology (whose workers
communicator is used).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from mpi4py import MPI

from .comm import Comm

__all__ = [
    "Handle",
    "allreduce",
    "allreduce_async_",
    "broadcast",
    "poll",
    "synchronize",
]

_OPS = {"sum": MPI.SUM, "average": MPI.SUM, "min": MPI.MIN, "max": MPI.MAX}


def _comm_of(comm) -> Comm:
    if isinstance(comm, Comm):
        return comm
    workers = getattr(getattr(comm, "comms", None), "workers", None)
    if isinstance(workers, Comm):
        return workers
    raise TypeError(
        f"comm must be a hybridagg Comm or Topology, got {type(comm).__name__}"
    )


@dataclass
class Handle:
    """A pending in-place all-reduce; finish it with :func:`synchronize`."""

    tensor: torch.Tensor
    request: MPI.Request
    comm: Comm
    average: bool
    done: bool = False


def allreduce_async_(tensor: torch.Tensor, comm, op: str = "average") -> Handle:
    """Start an in-place all-reduce of a contiguous CPU tensor.

    Args:
        tensor: Reduced in place.
        comm: A :class:`~hybridagg.comm.Comm` or a topology.
        op: ``"average"`` (default), ``"sum"``, ``"min"`` or ``"max"``.

    Raises:
        ValueError: Unknown ``op``.
    """
    if op not in _OPS:
        raise ValueError(f"op must be one of {sorted(_OPS)}, got {op!r}")
    c = _comm_of(comm)
    return Handle(tensor, c.Iallreduce(tensor, _OPS[op]), c, op == "average")


def poll(handle: Handle) -> bool:
    """Whether the all-reduce finished (drives its progress); does not wait."""
    return handle.done or handle.request.Test()


def synchronize(handle: Handle) -> torch.Tensor:
    """Wait for an all-reduce (polled, with the communicator's timeout)."""
    if not handle.done:
        handle.comm.wait(handle.request, "allreduce_async_")
        if handle.average:
            handle.tensor.div_(handle.comm.size)
        handle.done = True
    return handle.tensor


def allreduce(tensor: torch.Tensor, comm, op: str = "average") -> torch.Tensor:
    """All-reduce a tensor in place and return it."""
    return synchronize(allreduce_async_(tensor, comm, op))


def broadcast(tensor: torch.Tensor, root_rank: int, comm) -> torch.Tensor:
    """Broadcast a tensor in place from ``root_rank`` (a rank of ``comm``)."""
    return _comm_of(comm).Bcast(tensor, root_rank, what=f"broadcast from {root_rank}")
