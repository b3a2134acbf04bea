"""BatchNorm under data parallelism: per-rank statistics against synchronised ones (chapter 07).

    torchrun --nproc-per-node 2 -m course_lib.workers.ddp_batchnorm --batch 4

With plain BatchNorm each rank normalises with the mean and variance of *its*
slice of the batch: with N ranks of b samples, the statistics come from b
samples, not N*b (chapter 04: small-batch statistics are noisy). SyncBatchNorm
all-reduces the per-channel sums, so every rank normalises with the whole
batch's statistics and the gradients equal a single process on the whole
batch. ``torch.nn.SyncBatchNorm`` runs only on GPUs; on CPU ranks we use the
few lines below, which do the same computation.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from course_lib.distributed import launch
from course_lib.distributed.ddp import NaiveDDP
from course_lib.distributed.results import WorkerResult


class _AllReduceSum(torch.autograd.Function):
    """Sum over ranks; the gradient of a sum over ranks is again a sum over ranks."""

    @staticmethod
    def forward(ctx, t: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        t = t.clone()
        dist.all_reduce(t)
        return t

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        g = g.clone()
        dist.all_reduce(g)
        return g


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


def small_convnet(norm: type[nn.Module], channels: int = 8, classes: int = 10) -> nn.Sequential:
    """conv - BN - ReLU - conv - BN - ReLU - pool - linear: two BatchNorms, nothing else with state."""
    return nn.Sequential(
        nn.Conv2d(3, channels, 3, padding=1, bias=False), norm(channels), nn.ReLU(),
        nn.Conv2d(channels, channels, 3, padding=1, bias=False), norm(channels), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, classes),
    )


def _grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.detach().clone() for p in model.parameters()]


@dataclass
class BatchNormResult(WorkerResult):
    """Per variant ("per_rank_bn", "sync_bn_by_hand", on GPUs "torch_sync_bn"): gradient and buffer differences."""

    world: int
    batch_per_rank: int
    grad_diff: dict[str, float]             # max |gradient - one process on the whole batch|
    running_mean_spread: dict[str, float]   # how far apart the ranks' running means drifted
    reference_grad_norm: float


def batchnorm_checks(rank: int, world: int, device: torch.device, batch: int, seed: int = 0) -> BatchNormResult:
    """Gradient differences to one process on the whole batch: per-rank BN, SyncBN by hand (and torch's on GPU)."""
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(world * batch, 3, 16, 16, generator=g).to(device)
    Y = torch.randint(0, 10, (world * batch,), generator=g).to(device)
    x, y = X[rank * batch:(rank + 1) * batch], Y[rank * batch:(rank + 1) * batch]

    torch.manual_seed(seed)
    reference = small_convnet(nn.BatchNorm2d).to(device)
    F.cross_entropy(reference(X), Y).backward()
    ref = _grads(reference)

    variants = {"per_rank_bn": nn.BatchNorm2d, "sync_bn_by_hand": SyncBatchNorm2dByHand}
    if device.type == "cuda":
        variants["torch_sync_bn"] = nn.SyncBatchNorm
    out = BatchNormResult(world, batch, {}, {}, torch.cat([r.flatten() for r in ref]).norm().item())
    for name, norm in variants.items():
        torch.manual_seed(seed)
        model = NaiveDDP(small_convnet(norm).to(device))
        F.cross_entropy(model(x), y).backward()
        model.finish_gradient_synchronization()
        out.grad_diff[name] = max((a - b).abs().max().item() for a, b in zip(_grads(model), ref))
        # how far apart the ranks' running means drifted (NaiveDDP does not broadcast buffers)
        rm = model.module[1].running_mean.detach().clone()
        spread = rm.clone()
        dist.all_reduce(spread, op=dist.ReduceOp.MAX)
        low = rm.clone()
        dist.all_reduce(low, op=dist.ReduceOp.MIN)
        out.running_mean_spread[name] = (spread - low).max().item()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=4, help="samples per rank")
    parser.add_argument("--seed", type=int, default=0)
    launch.serve(parser, lambda a, rank, world, device: batchnorm_checks(rank, world, device, a.batch, a.seed))


if __name__ == "__main__":
    main()
