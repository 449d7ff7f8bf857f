"""Horovod's collectives with Horovod's signatures, over every worker.

Thin: each call checks Horovod's arguments and hands the tensor to
:mod:`hybridagg.ops` (which stages GPU tensors through host memory).
``name=`` is accepted and only names the operation in error messages;
``process_set`` must be the global one.
"""

from __future__ import annotations

from typing import Any

import torch

from .. import ops
from ..optimizer import broadcast_optimizer_state as _broadcast_optimizer_state
from ..optimizer import broadcast_parameters as _broadcast_parameters
from .context import current_job
from .optimizer import (
    Average,
    Compression,
    Compressor,
    Max,
    Min,
    Product,
    Sum,
    check_op,
    check_process_set,
    global_process_set,
)

__all__ = [
    "allgather",
    "allgather_object",
    "allreduce",
    "allreduce_",
    "allreduce_async",
    "allreduce_async_",
    "barrier",
    "broadcast",
    "broadcast_",
    "broadcast_object",
    "broadcast_optimizer_state",
    "broadcast_parameters",
    "join",
    "poll",
    "synchronize",
]

_REDUCE_OPS = (Average, Sum, Min, Max, Product)


def _reduce_op(average: bool | None, op) -> str:
    if average is not None:  # Horovod's deprecated flag
        if op is not None:
            raise ValueError("allreduce: pass op= or average=, not both")
        return Average if average else Sum
    return check_op(op, what="allreduce", allowed=_REDUCE_OPS)


def _scaled(tensor: torch.Tensor, factor: float) -> torch.Tensor:
    return tensor if factor == 1.0 else tensor.mul(factor)


def allreduce_async_(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    op=None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set=global_process_set,
) -> ops.Handle:
    """Start an in-place all-reduce over the workers; :func:`synchronize` finishes it."""
    check_process_set(process_set)
    op = _reduce_op(average, op)
    if prescale_factor != 1.0:
        tensor.mul_(prescale_factor)
    return ops.allreduce_async_(
        tensor, current_job().workers, op, postscale=postscale_factor
    )


def allreduce_async(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    op=None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set=global_process_set,
) -> ops.Handle:
    """Start an all-reduce into a new tensor; :func:`synchronize` returns it."""
    out = tensor.detach().clone(memory_format=torch.contiguous_format)
    return allreduce_async_(
        out, average, name, op, prescale_factor, postscale_factor, process_set
    )


def synchronize(handle: ops.Handle) -> torch.Tensor:
    """Wait for an all-reduce started by ``allreduce_async(_)``; returns its tensor."""
    return ops.synchronize(handle)


def poll(handle: ops.Handle) -> bool:
    """Whether the all-reduce finished (does not wait)."""
    return ops.poll(handle)


def allreduce_(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    op=None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set=global_process_set,
) -> torch.Tensor:
    """All-reduce ``tensor`` in place over the workers (average by default); returns it."""
    return synchronize(
        allreduce_async_(
            tensor, average, name, op, prescale_factor, postscale_factor, process_set
        )
    )


def allreduce(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    compression: type[Compressor] = Compression.none,
    op=None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set=global_process_set,
) -> torch.Tensor:
    """The all-reduce of ``tensor`` over the workers, as a new tensor.

    Averaged by default (``op=hvd.Sum``, ``Min``, ``Max``, ``Product``); on
    the tensor's device (a GPU tensor is reduced through host memory);
    ``compression=hvd.Compression.fp16`` rounds the values to float16 first,
    as Horovod does. Autograd does not pass through it.
    """
    sent, ctx = compression.compress(_scaled(tensor.detach(), prescale_factor))
    out = sent.clone(memory_format=torch.contiguous_format)
    allreduce_(out, average, name, op, 1.0, postscale_factor, process_set)
    return compression.decompress(out, ctx)


def allgather(
    tensor: torch.Tensor, name: str | None = None, process_set=global_process_set
) -> torch.Tensor:
    """Every worker's ``tensor`` concatenated along the first dimension, in rank
    order (the first dimension may differ between workers)."""
    check_process_set(process_set)
    return ops.allgather(tensor, current_job().workers)


def broadcast_(
    tensor: torch.Tensor,
    root_rank: int,
    name: str | None = None,
    process_set=global_process_set,
) -> torch.Tensor:
    """Overwrite ``tensor`` with ``root_rank``'s, on every worker; returns it."""
    check_process_set(process_set)
    return ops.broadcast_(tensor, root_rank, current_job().workers)


def broadcast(
    tensor: torch.Tensor,
    root_rank: int,
    name: str | None = None,
    process_set=global_process_set,
) -> torch.Tensor:
    """``root_rank``'s ``tensor`` as a new tensor on every worker."""
    check_process_set(process_set)
    return ops.broadcast(tensor, root_rank, current_job().workers)


def broadcast_object(
    obj: Any,
    root_rank: int = 0,
    name: str | None = None,
    process_set=global_process_set,
) -> Any:
    """``root_rank``'s picklable object, on every worker."""
    check_process_set(process_set)
    return current_job().workers.bcast(
        obj, root_rank, what=f"broadcast_object from {root_rank}"
    )


def allgather_object(
    obj: Any, name: str | None = None, process_set=global_process_set
) -> list:
    """Every worker's picklable object, in rank order."""
    check_process_set(process_set)
    return current_job().workers.allgather(obj, what="allgather_object")


def barrier(process_set=global_process_set) -> None:
    """Wait until every worker arrives (polled, with the timeout)."""
    check_process_set(process_set)
    current_job().workers.barrier(what="hvd.barrier")


def broadcast_parameters(
    params, root_rank: int, process_set=global_process_set
) -> None:
    """Copy ``root_rank``'s tensors into every worker's (``model.state_dict()``,
    ``model.named_parameters()`` or ``(name, tensor)`` pairs)."""
    check_process_set(process_set)
    _broadcast_parameters(params, root_rank, current_job().topology)


def broadcast_optimizer_state(
    optimizer: torch.optim.Optimizer,
    root_rank: int,
    model: torch.nn.Module | None = None,
    process_set=global_process_set,
) -> None:
    """Give every worker ``root_rank``'s optimizer state and hyper-parameters.

    In hybrid and async mode the servers hold the optimizer state that
    updates use; this keeps the workers' copies alike all the same.
    """
    check_process_set(process_set)
    _broadcast_optimizer_state(optimizer, root_rank, current_job().topology)


JOINED = 1.0
"""The shared value a joined worker sends with each update it takes part in."""


def join(device: int = -1) -> int:
    """This worker ran out of data: take part in the others' updates until all join.

    As Horovod's ``join`` for uneven data: with a DistributedOptimizer made
    here, the worker keeps stepping with no samples (it adds nothing to the
    averages, which are weighted by samples) until every worker of its
    update (all workers in sync mode, its group in hybrid and async) has
    joined, so the others' reductions never wait for it. Only the
    optimizer's reductions are covered: other collectives (``allreduce`` of
    a metric) must be called by every worker. Collective over the workers.

    Args:
        device: Horovod's device argument; unused.

    Returns:
        The rank of the worker that joined last (the fewest updates taken
        while joined; the highest such rank when several joined at the same
        update; in hybrid and async mode counted within each group).
    """
    del device
    job = current_job()
    steps = 0
    opt = job.optimizers[-1] if job.optimizers else None
    if opt is not None:
        samples = opt.samples
        opt.set_samples(0)
        try:
            while True:
                opt.share([JOINED])
                opt.step()
                steps += 1
                if bool((opt.shared[:, 0] == JOINED).all()):
                    break
        finally:
            opt.share([0.0])
            opt.set_samples(samples)
    counts = job.workers.allgather(steps, what="hvd.join")
    fewest = min(counts)
    return max(r for r, n in enumerate(counts) if n == fewest)
