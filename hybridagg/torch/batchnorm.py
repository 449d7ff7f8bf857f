"""``SyncBatchNorm``: batch normalisation over the batch of every rank of an update.

In training, each rank computes its part's per-channel count, mean and sum
of squared deviations; the ranks all-gather them and combine them exactly
(Chan et al.'s parallel variance), so every rank normalises with the
statistics of the union batch, and the running statistics follow the union
batch too. Gradients flow through the gather: its backward all-reduces the
gradients of the statistics, so each rank's input gradient is the one
batch normalisation of the union batch gives. The ranks are those of one
gradient update (every worker in sync mode, the group in hybrid and async:
groups run at their own pace, and a collective across them would make them
wait for each other). Statistics are combined in float64. A GPU tensor's
statistics (a few numbers per channel) travel through host memory.
In evaluation mode, or alone, it is :class:`torch.nn.BatchNorm` exactly.
"""

from __future__ import annotations

import torch
from mpi4py import MPI

from ..comm import Comm
from .context import current_job

__all__ = ["SyncBatchNorm"]


class _GatherRows(torch.autograd.Function):
    """All-gather a small tensor as rows ``(ranks, *shape)``, differentiably.

    Each rank's output depends on every rank's input, so the gradient of a
    rank's input is the sum over ranks of the gradients of its row.
    """

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, comm: Comm) -> torch.Tensor:
        ctx.comm = comm
        ctx.device = tensor.device
        host = tensor.detach().to("cpu", torch.float64).contiguous()
        out = torch.empty((comm.size, *host.shape), dtype=torch.float64)
        comm.Allgather(host, out, what="SyncBatchNorm statistics")
        return out.to(tensor.device)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        comm: Comm = ctx.comm
        host = grad.detach().to("cpu", torch.float64).contiguous()
        comm.Allreduce(host, MPI.SUM, what="SyncBatchNorm statistics' gradient")
        return host[comm.rank].to(ctx.device), None


class SyncBatchNorm(torch.nn.modules.batchnorm._BatchNorm):
    """Horovod's ``hvd.SyncBatchNorm``: statistics of the union batch of every
    rank of an update (see the module docstring). Needs :func:`hvd.init`.

    Args:
        num_features: Channels (dimension 1 of the input).
        eps: Added to the variance.
        momentum: Running statistics' factor (``None``: a cumulative mean).
        affine: Learnable scale and shift.
        track_running_stats: Keep running statistics.
    """

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def _momentum(self) -> float:
        """This step's running-average factor (as ``torch.nn.BatchNorm``)."""
        if not (self.training and self.track_running_stats):
            return 0.0
        self.num_batches_tracked.add_(1)
        if self.momentum is None:
            return 1.0 / float(self.num_batches_tracked)
        return self.momentum

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        comm = current_job().scope() if self.training else None
        if comm is None or comm.size == 1:
            return super().forward(input)
        factor = self._momentum()
        channels = input.shape[1]
        dims = [0, *range(2, input.dim())]
        count = input.numel() // channels if channels else 0
        # local statistics (a rank with no samples contributes zeros)
        local_sum = input.sum(dims)
        local_mean = local_sum / max(count, 1)
        shape = [1, channels] + [1] * (input.dim() - 2)
        deviation = input - local_mean.view(shape)
        local_m2 = (deviation * deviation).sum(dims)
        stats = torch.cat(
            [
                local_mean.double(),
                local_m2.double(),
                torch.tensor([float(count)], dtype=torch.float64, device=input.device),
            ]
        )
        rows = _GatherRows.apply(stats, comm)
        means, m2s, counts = (
            rows[:, :channels],
            rows[:, channels : 2 * channels],
            rows[:, 2 * channels :],
        )
        total = counts.sum()
        if not total > 0:
            raise ValueError("SyncBatchNorm: no rank of the update has any sample")
        mean = (counts * means).sum(0) / total
        m2 = (m2s + counts * (means - mean) ** 2).sum(0)
        var = m2 / total
        if self.training and self.track_running_stats:
            with torch.no_grad():
                unbiased = m2 / max(float(total) - 1.0, 1.0)
                self.running_mean.mul_(1 - factor).add_(
                    mean.to(self.running_mean.dtype), alpha=factor
                )
                self.running_var.mul_(1 - factor).add_(
                    unbiased.to(self.running_var.dtype), alpha=factor
                )
        scale = torch.rsqrt(var + self.eps).to(input.dtype)
        out = (input - mean.to(input.dtype).view(shape)) * scale.view(shape)
        if self.affine:
            out = out * self.weight.view(shape) + self.bias.view(shape)
        return out
