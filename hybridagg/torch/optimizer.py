"""Horovod's ``DistributedOptimizer``, ``Compression`` and reduction ops over hybridagg.

``hvd.DistributedOptimizer(optimizer, named_parameters=...)`` returns
hybridagg's optimizer for the job's mode (``HYBRIDAGG_MODE``): in sync mode
every worker's gradients are averaged before each update, as Horovod does;
in hybrid and async mode the groups reduce inside and their leaders meet
the parameter servers. Horovod's options map onto hybridagg's:

* ``compression=Compression.fp16``: the fp16 wire (``wire="fp16"``): half
  the bytes, sums in float32, rounding errors fed back into the next step.
* ``op=Average`` (default) or ``Sum``; ``Adasum`` is refused.
* ``backward_passes_per_step=N``: gradients accumulate locally over N
  backward passes; each is reduced once per N (the reducer counts them).
* ``gradient_predivide_factor``: accepted with ``Average`` (the result is
  the average either way: hybridagg sums in float32 or wider).
* ``synchronize()`` / ``skip_synchronize()``: as Horovod's, for gradient
  clipping.
* ``groups``/``num_groups``, ``sparse_as_dense``: accepted and without
  effect (hybridagg fuses gradients into buckets of its own).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from ..optimizer import DistributedOptimizer as _Factory
from ..optimizer.server import ServerOptimizer
from ..optimizer.sync import SyncOptimizer
from ..runtime.outcomes import NonFiniteError
from .context import current_job

__all__ = [
    "Adasum",
    "Average",
    "Compression",
    "Compressor",
    "DistributedOptimizer",
    "FP16Compressor",
    "Max",
    "Min",
    "NoneCompressor",
    "Product",
    "Sum",
    "check_process_set",
    "global_process_set",
]

Average = "average"
"""Reduce by the mean over the ranks (the default)."""
Sum = "sum"
"""Reduce by the sum over the ranks."""
Adasum = "adasum"
"""Horovod's Adasum: not supported by hybridagg (a ``ValueError``)."""
Min = "min"
"""Element-wise minimum (collectives only)."""
Max = "max"
"""Element-wise maximum (collectives only)."""
Product = "product"
"""Element-wise product (collectives only)."""


class _GlobalProcessSet:
    """Horovod's ``global_process_set``: every worker (the only set supported)."""

    def __repr__(self) -> str:
        return "global_process_set"


global_process_set = _GlobalProcessSet()


def check_process_set(process_set) -> None:
    """Refuse any process set but the global one (hybridagg's groups come from
    ``HYBRIDAGG_GROUPS``)."""
    if process_set is not None and process_set is not global_process_set:
        raise ValueError(
            "hybridagg.torch supports only the global process set; groups of "
            "workers come from HYBRIDAGG_GROUPS"
        )


class Compressor:
    """Horovod's compressor interface: ``compress`` before a collective,
    ``decompress`` after; ``wire`` is the format hybridagg's optimizer uses."""

    wire = "fp32"

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, object]:
        """Return the tensor to send and what :meth:`decompress` needs."""
        return tensor, None

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: object) -> torch.Tensor:
        """Undo :meth:`compress`."""
        return tensor


class NoneCompressor(Compressor):
    """No compression."""


class FP16Compressor(Compressor):
    """Floating tensors travel as float16 (the optimizer: hybridagg's fp16 wire)."""

    wire = "fp16"

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, object]:
        if tensor.dtype.is_floating_point:
            return tensor.to(torch.float16), tensor.dtype
        return tensor, None

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: object) -> torch.Tensor:
        return tensor if ctx is None else tensor.to(ctx)


class Compression:
    """Horovod's ``Compression.none`` and ``Compression.fp16``."""

    none = NoneCompressor
    fp16 = FP16Compressor


def check_op(op, *, what: str, allowed: tuple[str, ...]) -> str:
    """``op`` as one of ``allowed`` (``None``: Average), or a clear ``ValueError``."""
    if op is None:
        return Average
    if op == Adasum:
        raise ValueError(
            f"{what}: op=Adasum is not supported by hybridagg; use hvd.Average "
            "or hvd.Sum"
        )
    if op not in allowed:
        raise ValueError(f"{what}: op must be one of {list(allowed)}, got {op!r}")
    return op


class _HorovodSemantics:
    """What Horovod's optimizer does beyond hybridagg's: ``op=Sum`` and
    ``skip_synchronize()``. Mixed into the mode's implementation."""

    def __init__(self, *args, op: str = Average, **kwargs) -> None:
        self._op = op
        self._skip = False
        super().__init__(*args, **kwargs)

    def synchronize(self) -> float:
        """Finish reducing (collective); ``.grad`` then holds the average, or
        with ``op=Sum`` the sum over the ranks of the update."""
        total = super().synchronize()
        if self._op == Sum and total > 0:
            # the reduction is a mean weighted by sample counts (1 per rank
            # unless set_samples() said otherwise): times the total, a sum
            for p in self._reducer.params:
                if p.grad is not None:
                    p.grad.mul_(total)
        return total

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """``step()`` inside does not reduce: after :meth:`synchronize`, as Horovod's."""
        self._skip = True
        try:
            yield
        finally:
            self._skip = False

    def step(self, closure=None):
        """Reduce (unless :meth:`synchronize` did) and update.

        Raises:
            NonFiniteError: The reduced gradient (or, in hybrid and async
                mode, any group's) was NaN or infinite: no update was
                applied, and the same error is raised on every rank of the
                reduction (exit code 3 once unhandled). Horovod would apply
                it; a script cannot see that hybridagg skipped it.
        """
        if self._skip and not self._synced:
            raise ValueError(
                "optimizer.step() inside skip_synchronize() needs "
                "optimizer.synchronize() first: the gradients' reduction is "
                "already under way and must be finished"
            )
        loss = super().step(closure)
        reason = self.nonfinite
        if reason is not None:
            raise NonFiniteError(f"update {self.updates + 1}: {reason}")
        return loss


class HorovodSyncOptimizer(_HorovodSemantics, SyncOptimizer):
    """Sync mode with Horovod's semantics."""


class HorovodServerOptimizer(_HorovodSemantics, ServerOptimizer):
    """Hybrid and async mode with Horovod's semantics."""


def _named(optimizer: torch.optim.Optimizer, named_parameters) -> list:
    """Horovod's checks: names unique, every optimized parameter named."""
    if named_parameters is None:
        return [
            (f"allreduce.noname.{i}.{j}", p)
            for i, group in enumerate(optimizer.param_groups)
            for j, p in enumerate(group["params"])
        ]
    named = list(named_parameters)
    if not all(isinstance(x, tuple) and len(x) == 2 for x in named):
        raise ValueError(
            "named_parameters should be a sequence of tuples (name, parameter), "
            "usually produced by model.named_parameters()"
        )
    names = [n for n, _ in named]
    dups = sorted({n for n in names if names.count(n) > 1})
    if dups:
        raise ValueError(
            f"parameter names in named_parameters must be unique; found {dups}"
        )
    named_ids = {id(p) for _, p in named}
    missing = [
        p
        for group in optimizer.param_groups
        for p in group["params"]
        if id(p) not in named_ids
    ]
    if missing:
        shapes = [tuple(p.shape) for p in missing]
        raise ValueError(
            "named_parameters was given, but the optimizer holds parameters it "
            f"does not name (shapes {shapes}); they would never be reduced"
        )
    return named


def DistributedOptimizer(
    optimizer: torch.optim.Optimizer,
    named_parameters=None,
    compression: type[Compressor] = Compression.none,
    backward_passes_per_step: int = 1,
    op: str = Average,
    gradient_predivide_factor: float = 1.0,
    num_groups: int = 0,
    groups=None,
    sparse_as_dense: bool = False,
    process_set=global_process_set,
) -> _Factory:
    """Wrap ``optimizer`` so each step aggregates across the workers (Horovod's call).

    Returns a :class:`hybridagg.DistributedOptimizer` of the job's mode (see
    the module docstring for how each argument maps).

    Raises:
        ValueError: ``op=Adasum`` or another op, a ``gradient_predivide_factor``
            other than 1 with ``op=Sum`` (Horovod's rule) or not positive, a
            compressor hybridagg has no wire for, a process set, unnamed or
            duplicate parameters, a second optimizer in hybrid or async mode
            (the servers hold one model), or ``backward_passes_per_step``
            below 1.
    """
    job = current_job()
    check_process_set(process_set)
    op = check_op(op, what="DistributedOptimizer", allowed=(Average, Sum))
    factor = gradient_predivide_factor
    if (
        isinstance(factor, bool)
        or not isinstance(factor, (int, float))
        or not factor > 0
    ):
        raise ValueError(
            f"gradient_predivide_factor must be a positive number, got {factor!r}"
        )
    if factor != 1.0 and op != Average:
        raise ValueError("gradient_predivide_factor not supported with op != Average")
    wire = getattr(compression, "wire", None)
    if wire is None:
        raise ValueError(
            "compression must be hvd.Compression.none or hvd.Compression.fp16, "
            f"got {compression!r}"
        )
    del num_groups, groups, sparse_as_dense  # (fusion is hybridagg's own)
    if job.mode != "sync" and job.optimizers:
        raise ValueError(
            f"HYBRIDAGG_MODE={job.mode}: the parameter servers hold one model; "
            "make one DistributedOptimizer per run"
        )
    named = _named(optimizer, named_parameters)
    cls = HorovodSyncOptimizer if job.mode == "sync" else HorovodServerOptimizer
    opt = cls(
        optimizer,
        named,
        job.topology,
        mode=job.mode,
        op=op,
        wire=wire,
        backward_passes_per_step=backward_passes_per_step,
    )
    job.optimizers.append(opt)
    return opt
