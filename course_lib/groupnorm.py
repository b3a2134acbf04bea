"""GroupNorm written out (Wu & He 2018; chapter 04): statistics per sample and per group of channels.

No sample depends on its batch, so the layer behaves the same at batch 1 as at batch 256; LayerNorm
(one group) and InstanceNorm (one channel per group) are its two ends.
"""

from __future__ import annotations

import torch
from torch import nn


class GroupNorm(nn.Module):
    """GroupNorm written out: per sample, split the C channels into G groups and standardise each group.

    ``y = (x - mean_g) / sqrt(var_g + eps) * weight_c + bias_c``, with the mean and (biased)
    variance over the group's C/G channels and all positions. ``G = 1`` is LayerNorm over
    (C, H, W) with a per-channel affine; ``G = C`` is InstanceNorm. Equal to
    ``torch.nn.GroupNorm`` in outputs and gradients (autograd differentiates these ops).
    """

    def __init__(self, num_groups: int, num_channels: int, eps: float = 1e-5, affine: bool = True):
        super().__init__()
        if num_groups <= 0 or num_channels <= 0 or num_channels % num_groups:
            raise ValueError(f"num_channels={num_channels} must be a positive multiple of num_groups={num_groups}")
        self.num_groups, self.num_channels, self.eps, self.affine = num_groups, num_channels, eps, affine
        self.weight = nn.Parameter(torch.ones(num_channels)) if affine else None
        self.bias = nn.Parameter(torch.zeros(num_channels)) if affine else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() < 2 or x.shape[1] != self.num_channels:
            raise ValueError(f"expected input of shape (N, {self.num_channels}, ...); got {tuple(x.shape)}")
        g = x.reshape(x.shape[0], self.num_groups, -1)  # (N, G, C/G * H * W): one row per (sample, group)
        mean = g.mean(dim=-1, keepdim=True)
        var = g.var(dim=-1, unbiased=False, keepdim=True)
        y = ((g - mean) / torch.sqrt(var + self.eps)).reshape(x.shape)
        if self.affine:
            shape = (1, -1) + (1,) * (x.dim() - 2)  # the per-channel affine, broadcast over N, H, W
            y = y * self.weight.view(shape) + self.bias.view(shape)
        return y

    def extra_repr(self) -> str:
        return f"{self.num_groups}, {self.num_channels}, eps={self.eps}, affine={self.affine}"
