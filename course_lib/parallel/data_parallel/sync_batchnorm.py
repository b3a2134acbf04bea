"""BatchNorm whose statistics come from the batch on every rank, written by hand (chapter 07).

With plain BatchNorm each rank normalises with the mean and variance of *its* slice of the batch: with N ranks of b
samples, the statistics come from b samples, not N*b (chapter 04: small-batch statistics are noisy). SyncBatchNorm
all-reduces the per-channel sums, so every rank normalises with the whole batch's statistics and the gradients equal a
single process on the whole batch. ``torch.nn.SyncBatchNorm`` runs only on GPUs; on CPU ranks we use the few lines
below, which do the same computation (``ddp_checks.batchnorm_checks`` compares both with one process).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


class _AllReduceSum(torch.autograd.Function):
    """Sum over ranks; the gradient of a sum over ranks is again a sum over ranks."""

    @staticmethod
    def forward(ctx, t: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        t = t.clone()
        dist.all_reduce(t)
        return t

    backward = forward  # the same all-reduce, of the gradient


class SyncBatchNorm2dByHand(nn.BatchNorm2d):
    """BatchNorm2d whose training statistics are those of the batch on *all* ranks (one all-reduce of 2C+1 numbers)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or not dist.is_initialized():
            return super().forward(x)
        C = x.shape[1]
        local_n = torch.tensor([x.numel() / C], dtype=x.dtype, device=x.device)
        # per-channel sum and sum of squares, summed over ranks: (2C + 1,)
        stats = _AllReduceSum.apply(torch.cat([x.sum((0, 2, 3)), (x * x).sum((0, 2, 3)), local_n]))
        n = stats[-1].detach()
        mean, var = stats[:C] / n, stats[C:2 * C] / n - (stats[:C] / n) ** 2  # biased variance, as BN uses
        with torch.no_grad():  # running statistics: unbiased variance, like nn.BatchNorm2d
            self.running_mean.lerp_(mean, self.momentum)
            self.running_var.lerp_(var * n / (n - 1), self.momentum)
            self.num_batches_tracked.add_(1)
        xhat = (x - mean.view(1, C, 1, 1)) * torch.rsqrt(var.view(1, C, 1, 1) + self.eps)
        return xhat * self.weight.view(1, C, 1, 1) + self.bias.view(1, C, 1, 1)
