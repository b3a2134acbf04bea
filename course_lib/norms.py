"""Normalisation at small batch (chapter 04): the pluggable norm factory and BatchNorm over device groups.

- ``make_norm(kind, channels)``: the factory ``models.ResNet`` takes as ``norm_layer``
  (``group_size=g`` gives BN and MABN per-device statistics over groups of g images).
- ``GhostBatchNorm2d``: BatchNorm whose statistics come from groups of ``group_size``
  images of the batch, as on devices that each hold that many images ("ghost
  batches", Hoffer et al. 2017); ``MABN2d(group_size=...)`` likewise.

The chapter's other layers each have a module, and are importable from here too:
``groupnorm`` (``GroupNorm`` by hand), ``mabn`` (``MABN2d``, ``MABNFunction``, ``CenConv2d``,
``centralize_convs``) and ``fold`` (``fold_norm``, ``fold_model``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from course_lib.fold import fold_model, fold_norm
from course_lib.groupnorm import GroupNorm
from course_lib.mabn import CenConv2d, MABN2d, MABNFunction, centralize_convs, split_groups

__all__ = ["NORM_KINDS", "GhostBatchNorm2d", "gn_groups", "make_norm",  # this module's own
           "GroupNorm", "MABN2d", "MABNFunction", "CenConv2d", "centralize_convs", "fold_norm", "fold_model"]

NORM_KINDS = ("bn", "gn", "ln", "in", "mabn", "none")


class GhostBatchNorm2d(nn.BatchNorm2d):
    """``nn.BatchNorm2d`` whose training statistics come from groups of ``group_size`` consecutive images.

    This is what data parallelism without synchronised BN computes (Goyal et al. 2017, Wu & He
    2018): each of the N / g devices normalises its g images by their own mean and variance.
    The running statistics follow device 0 (the first group), as a replica under
    ``DistributedDataParallel`` does (it broadcasts device 0's buffers every step). Evaluation
    uses them, so it folds like BN. The cost: two copies of the activations (a transpose puts the
    groups into the channel axis, where PyTorch's fused ``batch_norm`` takes them, and back).
    """

    def __init__(self, num_features: int, group_size: int, **options: Any):
        super().__init__(num_features, **options)
        if group_size < 1:
            raise ValueError(f"group_size must be at least 1 image, got {group_size}")
        self.group_size = group_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 4 or x.shape[1] != self.num_features:
            raise ValueError(f"GhostBatchNorm2d expects (N, {self.num_features}, H, W); got {tuple(x.shape)}")
        n, c, h, w = x.shape
        groups = split_groups(n, self.group_size, "GhostBatchNorm2d") if self.training else 1
        if groups == 1:
            return super().forward(x)
        g = n // groups
        factor = 0.0
        if self.track_running_stats:
            self.num_batches_tracked.add_(1)
            factor = self.momentum if self.momentum is not None else 1.0 / float(self.num_batches_tracked)
        # (N, C, H, W) -> (g, G*C, H, W): channel k of group j becomes channel j*C + k, so one fused
        # batch_norm computes every group's statistics over its g images and H*W positions.
        xt = x.view(groups, g, c, h, w).transpose(0, 1).reshape(g, groups * c, h, w)
        rm = self.running_mean.repeat(groups) if self.track_running_stats else None
        rv = self.running_var.repeat(groups) if self.track_running_stats else None
        weight = self.weight.repeat(groups) if self.affine else None
        bias = self.bias.repeat(groups) if self.affine else None
        y = F.batch_norm(xt, rm, rv, weight, bias, True, factor, self.eps)
        if self.track_running_stats:
            with torch.no_grad():  # keep device 0's update; the other groups' are dropped
                self.running_mean.copy_(rm[:c])
                self.running_var.copy_(rv[:c])
        return y.view(g, groups, c, h, w).transpose(0, 1).reshape(n, c, h, w)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", group_size={self.group_size}"


def gn_groups(channels: int, channels_per_group: int = 2, max_groups: int = 32) -> int:
    """GroupNorm's group count: 32 groups (Wu & He 2018's default) where a layer is wide enough,
    else groups of ``channels_per_group`` channels (a width-16 layer gets 8 groups of 2), always a
    divisor of ``channels``. Two per group is the paper's 32 groups at 64 channels; on the course's
    narrow ResNets groups of 4 trained far worse (chapter 04 measures it)."""
    groups = max(1, min(max_groups, channels // channels_per_group))
    while channels % groups:
        groups -= 1
    return groups


def make_norm(kind: str, channels: int, **options: Any) -> nn.Module:
    """A normalisation layer for ``channels`` channels: ``bn``, ``gn``, ``ln``, ``in``, ``mabn`` or ``none``.

    ``options`` go to the layer (``groups=`` for ``gn``; ``buffer_size=`` etc. for ``mabn``;
    ``group_size=`` for ``bn``, a ``GhostBatchNorm2d``, and ``mabn``). LN and IN are GroupNorm
    with one group and with one channel per group, as in Wu & He (2018).
    """
    if kind == "bn":
        group_size = options.pop("group_size", None)
        if group_size is not None:
            return GhostBatchNorm2d(channels, group_size, **options)
        return nn.BatchNorm2d(channels, **options)
    if kind == "gn":
        return nn.GroupNorm(options.pop("groups", gn_groups(channels)), channels, **options)
    if kind == "ln":
        return nn.GroupNorm(1, channels, **options)
    if kind == "in":
        return nn.GroupNorm(channels, channels, **options)
    if kind == "mabn":
        return MABN2d(channels, **options)
    if kind == "none":
        return nn.Identity()
    raise ValueError(f"unknown norm kind {kind!r}: choose one of {', '.join(NORM_KINDS)}")
