"""Horovod-style collective primitives on tensors, over a hybridagg communicator.

``allreduce`` (a new tensor), ``allreduce_`` (in place), ``allreduce_async_``
+ ``synchronize``, ``allgather``, ``broadcast`` and ``broadcast_``: the names
Horovod users know, waiting through the polled :func:`hybridagg.comm.wait`.
The communicator is passed in: a :class:`hybridagg.comm.Comm`, or a
topology (whose workers communicator is used); without one, the topology
:func:`hybridagg.init` already formed in this process (its workers).

A contiguous CPU tensor of a type MPI reduces is reduced where it lies, with
no copy. Any other tensor (on a GPU, not contiguous, or in float16/bfloat16,
which MPI cannot sum) is *staged*: copied into a host buffer (pinned memory
for a CUDA tensor; float32 for the half types), reduced there, and copied
back. The PyPI Open MPI is built without CUDA support, so host staging is
the path for GPU tensors; a non-contiguous CPU tensor takes the very same
code, which is how it is tested on machines without a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from mpi4py import MPI

from .comm import Comm
from .comm.buffers import as_buffer, mpi_dtype
from .topology import Topology, default_topology

__all__ = [
    "OPS",
    "Handle",
    "allgather",
    "allreduce",
    "allreduce_",
    "allreduce_async_",
    "broadcast",
    "broadcast_",
    "poll",
    "stage",
    "synchronize",
]

_OPS = {
    "average": MPI.SUM,
    "sum": MPI.SUM,
    "min": MPI.MIN,
    "max": MPI.MAX,
    "product": MPI.PROD,
}
OPS = tuple(_OPS)
"""The reductions ``op=`` names (``"average"`` is the default)."""


def _comm_of(comm) -> Comm:
    if isinstance(comm, Comm):
        return comm
    if comm is None or isinstance(comm, Topology):
        topo = default_topology(comm)
        if topo.comms.workers is None:
            raise ValueError(
                f"rank {topo.rank} is a parameter server; collectives over the "
                "workers run on workers"
            )
        return topo.comms.workers
    raise TypeError(
        f"comm must be a hybridagg Comm or Topology, got {type(comm).__name__}"
    )


def _check_op(op: str) -> None:
    if op not in _OPS:
        raise ValueError(f"op must be one of {list(OPS)}, got {op!r}")


def _reducible_here(tensor: torch.Tensor) -> bool:
    """Whether MPI can reduce ``tensor``'s own memory (no staging)."""
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        return False
    try:
        mpi_dtype(tensor.dtype)
    except TypeError:
        return False
    return True


def stage(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous host copy of ``tensor`` that MPI can reduce.

    Pinned memory for a CUDA tensor (the copies to and from the device then
    run at full speed); float32 for float16 and bfloat16.
    """
    dtype = tensor.dtype
    if dtype in (torch.float16, torch.bfloat16):
        dtype = torch.float32
    host = torch.empty(
        tensor.shape,
        dtype=dtype,
        pin_memory=tensor.device.type == "cuda",
    )
    host.copy_(tensor.detach())
    return host


@dataclass
class Handle:
    """A pending in-place all-reduce; finish it with :func:`synchronize`.

    Attributes:
        tensor: The caller's tensor, which receives the result.
        buffer: What MPI reduces: ``tensor`` itself, or its host stage.
    """

    tensor: torch.Tensor
    buffer: torch.Tensor
    request: MPI.Request
    comm: Comm
    average: bool
    postscale: float = 1.0
    done: bool = False


def allreduce_async_(
    tensor: torch.Tensor, comm=None, op: str = "average", *, postscale: float = 1.0
) -> Handle:
    """Start an in-place all-reduce of ``tensor`` (any device, layout or float type).

    Args:
        tensor: Reduced in place (when :func:`synchronize` returns).
        comm: A :class:`~hybridagg.comm.Comm` or a topology (default: the
            workers of the topology already initialised).
        op: One of :data:`OPS`; ``"average"`` (default) divides the sum by
            the number of ranks.
        postscale: Factor the result is multiplied by (Horovod's
            ``postscale_factor``).

    Raises:
        ValueError: Unknown ``op``, or called on a parameter server.
    """
    _check_op(op)
    c = _comm_of(comm)
    buffer = tensor if _reducible_here(tensor) else stage(tensor)
    request = c.Iallreduce(buffer, _OPS[op]) if c.size > 1 else MPI.REQUEST_NULL
    return Handle(tensor, buffer, request, c, op == "average", float(postscale))


def poll(handle: Handle) -> bool:
    """Whether the all-reduce finished (drives its progress); does not wait."""
    return handle.done or handle.request.Test()


def synchronize(handle: Handle) -> torch.Tensor:
    """Wait for an all-reduce (polled, with the communicator's timeout)."""
    if not handle.done:
        handle.comm.wait(handle.request, "allreduce_async_")
        if handle.average:
            if handle.buffer.dtype.is_floating_point or handle.buffer.is_complex():
                handle.buffer.div_(handle.comm.size)
            else:  # (an integer mean stays an integer, rounded down)
                handle.buffer.div_(handle.comm.size, rounding_mode="floor")
        if handle.postscale != 1.0:
            handle.buffer.mul_(handle.postscale)
        if handle.buffer is not handle.tensor:
            handle.tensor.copy_(handle.buffer)
        handle.done = True
    return handle.tensor


def allreduce_(tensor: torch.Tensor, comm=None, op: str = "average") -> torch.Tensor:
    """All-reduce ``tensor`` in place and return it (see :func:`allreduce_async_`)."""
    return synchronize(allreduce_async_(tensor, comm, op))


def allreduce(tensor: torch.Tensor, comm=None, op: str = "average") -> torch.Tensor:
    """The all-reduce of ``tensor`` as a new tensor (``tensor`` is unchanged).

    Same device, shape and dtype as ``tensor``; averaged over the ranks by
    default (``op="sum"``, ``"min"``, ``"max"``, ``"product"``). Autograd
    does not pass through it (as in :func:`allreduce_`).
    """
    _check_op(op)
    out = tensor.detach().clone(memory_format=torch.contiguous_format)
    return allreduce_(out, comm, op)


def broadcast_(tensor: torch.Tensor, root_rank: int, comm=None) -> torch.Tensor:
    """Broadcast ``tensor`` in place from ``root_rank`` (a rank of ``comm``); returns it."""
    c = _comm_of(comm)
    _check_root(root_rank, c)
    buffer = tensor if _reducible_here(tensor) else stage(tensor)
    c.Bcast(buffer, root_rank, what=f"broadcast from {root_rank}")
    if buffer is not tensor:
        tensor.copy_(buffer)
    return tensor


def broadcast(tensor: torch.Tensor, root_rank: int, comm=None) -> torch.Tensor:
    """``root_rank``'s ``tensor`` as a new tensor on every rank (``tensor`` unchanged)."""
    out = tensor.detach().clone(memory_format=torch.contiguous_format)
    return broadcast_(out, root_rank, comm)


def allgather(tensor: torch.Tensor, comm=None) -> torch.Tensor:
    """Every rank's ``tensor`` concatenated along the first dimension, in rank order.

    The first dimension may differ between ranks (as in Horovod); the other
    dimensions and the dtype must agree (a ``ValueError`` on every rank
    otherwise). A zero-dimensional tensor counts as one row.
    """
    c = _comm_of(comm)
    rows = tensor.detach().reshape(1) if tensor.dim() == 0 else tensor.detach()
    mine = (tuple(rows.shape[1:]), str(rows.dtype), int(rows.shape[0]))
    everyone = c.allgather(mine, what="allgather shapes")
    for rank, (shape, dtype, _) in enumerate(everyone):
        if (shape, dtype) != mine[:2]:
            raise ValueError(
                f"allgather needs the same trailing shape and dtype on every rank: "
                f"rank 0 has {everyone[0][0]} {everyone[0][1]}, rank {rank} has "
                f"{shape} {dtype}"
            )
    counts = [n for _, _, n in everyone]
    per_row = int(torch.Size(mine[0]).numel())
    host = rows if _reducible_here(rows) else stage(rows)
    out = torch.empty((sum(counts), *mine[0]), dtype=host.dtype)
    if c.size == 1:
        out.copy_(host)
    else:
        mem, _, dtype = as_buffer(out)
        sizes = [n * per_row for n in counts]
        offsets = [sum(sizes[:r]) for r in range(len(sizes))]
        req = c.mpi.Iallgatherv(as_buffer(host), [mem, sizes, offsets, dtype])
        c.wait(req, "allgather")
    return out.to(device=tensor.device, dtype=tensor.dtype)


def _check_root(root_rank: int, comm: Comm) -> None:
    if isinstance(root_rank, bool) or not isinstance(root_rank, int):
        raise TypeError(f"root_rank must be an int, got {root_rank!r}")
    if not 0 <= root_rank < comm.size:
        raise ValueError(
            f"root_rank {root_rank} is outside the {comm.size} ranks of {comm.name}"
        )
