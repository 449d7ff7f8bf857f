"""Copy a model's tensors and an optimizer's state from one worker to all."""

from __future__ import annotations

import torch

from ..comm import Comm
from ..topology import Topology, default_topology
from .base import DistributedOptimizer

__all__ = ["broadcast_optimizer_state", "broadcast_parameters"]


def _workers_comm(topology: Topology | None) -> Comm:
    topo = default_topology(topology)
    if topo.comms.workers is None:
        raise ValueError("broadcasts run on workers; this rank is a server")
    return topo.comms.workers


def broadcast_parameters(
    params, root_rank: int = 0, topology: Topology | None = None
) -> None:
    """Copy ``root_rank``'s tensors into every worker's (collective over workers).

    Args:
        params: ``model.state_dict()``, ``model.named_parameters()`` or a list
            of ``(name, tensor)`` pairs; the same names on every rank.
        root_rank: World rank of the source (a worker).
        topology: From :func:`hybridagg.init`.
    """
    comm = _workers_comm(topology)
    items = sorted(params.items()) if isinstance(params, dict) else list(params)
    pending = []
    for _, t in items:
        data = t.data if isinstance(t, torch.nn.Parameter) else t
        if data.device.type == "cpu" and data.is_contiguous():
            pending.append((data, data))
        else:
            pending.append((data, data.detach().cpu().contiguous()))
    reqs = [comm.Ibcast(buf, root_rank) for _, buf in pending]
    comm.wait(reqs, f"broadcast of {len(reqs)} parameters from rank {root_rank}")
    for dst, buf in pending:
        if dst is not buf:
            dst.copy_(buf)


def broadcast_optimizer_state(
    optimizer: torch.optim.Optimizer,
    root_rank: int = 0,
    topology: Topology | None = None,
) -> None:
    """Give every worker ``root_rank``'s optimizer state (collective over workers).

    ``optimizer`` may be a :class:`~hybridagg.DistributedOptimizer`; its
    inner optimizer's state is copied.
    """
    comm = _workers_comm(topology)
    inner = (
        optimizer.optimizer
        if isinstance(optimizer, DistributedOptimizer)
        else optimizer
    )
    state = comm.bcast(
        inner.state_dict() if comm.rank == root_rank else None, root_rank
    )
    if comm.rank != root_rank:
        inner.load_state_dict(state)
