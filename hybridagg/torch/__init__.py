"""Horovod's PyTorch API over hybridagg: ``import hybridagg.torch as hvd``.

A training script written for Horovod (``hvd.init()``, ``hvd.rank()``,
``hvd.size()``, ``DistributedSampler(num_replicas=hvd.size(),
rank=hvd.rank())``, ``hvd.broadcast_parameters(...)``,
``hvd.broadcast_optimizer_state(...)``, ``hvd.DistributedOptimizer(...)``,
``hvd.allreduce(metric)``) runs with this import in place of ``import
horovod.torch as hvd`` and no other change:

* synchronously by default (every worker's gradients averaged before each
  update, as Horovod);
* in hybrid or async mode when the environment says so
  (``HYBRIDAGG_MODE=hybrid HYBRIDAGG_GROUPS=0-1,2-3 HYBRIDAGG_SERVERS=1``,
  or ``hybridagg-run --mode hybrid ...``): the last ranks serve as
  parameter servers inside ``hvd.init()`` and exit when training ends;
  ``size()`` and ``rank()`` count the workers only.

Horovod's process sets, Adasum and its elastic API are not provided.
"""

from __future__ import annotations

import torch
import torch.distributed as _dist

from .batchnorm import SyncBatchNorm
from .collectives import (
    allgather,
    allgather_object,
    allreduce,
    allreduce_,
    allreduce_async,
    allreduce_async_,
    barrier,
    broadcast,
    broadcast_,
    broadcast_object,
    broadcast_optimizer_state,
    broadcast_parameters,
    join,
    poll,
    synchronize,
)
from .context import (
    cross_rank,
    cross_size,
    init,
    is_initialized,
    local_rank,
    local_size,
    rank,
    shutdown,
    size,
)
from .optimizer import (
    Adasum,
    Average,
    Compression,
    DistributedOptimizer,
    Max,
    Min,
    Product,
    Sum,
    global_process_set,
)

__all__ = [
    "Adasum",
    "Average",
    "Compression",
    "DistributedOptimizer",
    "Max",
    "Min",
    "Product",
    "Sum",
    "SyncBatchNorm",
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
    "cross_rank",
    "cross_size",
    "cuda_built",
    "global_process_set",
    "gloo_built",
    "init",
    "is_initialized",
    "join",
    "local_rank",
    "local_size",
    "mpi_built",
    "mpi_enabled",
    "nccl_built",
    "poll",
    "rank",
    "rocm_built",
    "shutdown",
    "size",
    "synchronize",
]


def mpi_built() -> bool:
    """Whether collectives run over MPI: always, in hybridagg."""
    return True


def mpi_enabled() -> bool:
    """Whether MPI is the controller: always, in hybridagg."""
    return True


def gloo_built() -> bool:
    """Whether Horovod's Gloo controller is built: hybridagg has none."""
    return False


def nccl_built() -> bool:
    """Whether gradients of CUDA parameters can be reduced with NCCL (through
    ``torch.distributed``, inside groups whose workers hold their model on GPUs)."""
    return bool(
        _dist.is_available() and _dist.is_nccl_available() and torch.version.cuda
    )


def cuda_built() -> bool:
    """Whether torch was built with CUDA (GPU tensors are staged through host
    memory for MPI, since the PyPI Open MPI is built without CUDA)."""
    return torch.version.cuda is not None


def rocm_built() -> bool:
    """Whether torch was built for ROCm."""
    return getattr(torch.version, "hip", None) is not None
