"""Folding an eval-mode BatchNorm or MABN into the convolution before it, for inference (chapter 04).

In eval mode both are a fixed per-channel scale and shift, so the convolution can absorb them and
inference skips a full read and write of the activations; GroupNorm cannot be folded.
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.nn.utils.fusion import fuse_conv_bn_weights

from course_lib.groupnorm import GroupNorm
from course_lib.mabn import CenConv2d, MABN2d


def fold_norm(conv: nn.Conv2d, norm: nn.Module) -> nn.Conv2d:
    """One ``nn.Conv2d`` equal to ``norm(conv(x))`` for an eval-mode ``BatchNorm2d`` or ``MABN2d``.

    In eval mode both are a fixed per-channel ``y = a * x + b``, so ``a`` scales each filter and
    ``b`` becomes the bias: inference then skips a full read and write of the activations.
    """
    if isinstance(norm, (nn.GroupNorm, GroupNorm, nn.LayerNorm, nn.InstanceNorm2d)):
        raise ValueError(
            f"{type(norm).__name__} cannot be folded into a convolution: it normalises each sample by "
            "statistics of that sample's own activations, computed anew at inference, so it is not a "
            "fixed per-channel scale and shift. Only eval-mode BatchNorm2d and MABN2d can be folded.")
    if not isinstance(norm, (nn.BatchNorm2d, MABN2d)):
        raise ValueError(f"fold_norm folds BatchNorm2d or MABN2d, not {type(norm).__name__}")
    if norm.training:
        raise ValueError("call .eval() first: in training mode the layer normalises by this batch's "
                         "statistics, which change with every batch, so there is nothing fixed to fold")
    if conv.out_channels != norm.num_features:
        raise ValueError(f"the conv has {conv.out_channels} output channels but the norm has {norm.num_features}")
    if isinstance(norm, nn.BatchNorm2d) and norm.running_var is None:
        raise ValueError("this BatchNorm2d has track_running_stats=False: it uses batch statistics "
                         "even in eval mode, so it cannot be folded")
    # in eval mode MABN divides by its running variance and subtracts no mean: a BatchNorm whose mean is 0
    mean = norm.running_mean if isinstance(norm, nn.BatchNorm2d) else torch.zeros_like(norm.running_var)
    with torch.no_grad():
        weight = conv.centered_weight() if isinstance(conv, CenConv2d) else conv.weight
        # PyTorch's own fold (public, what fuse_conv_bn_eval calls): a = gamma / sqrt(var + eps) scales
        # each filter, b = (conv bias - mean) * a + beta; no affine or no conv bias count as 1 and 0
        w, b = fuse_conv_bn_weights(weight, conv.bias, mean, norm.running_var, norm.eps, norm.weight, norm.bias)
        folded = nn.Conv2d(conv.in_channels, conv.out_channels, conv.kernel_size, stride=conv.stride,
                           padding=conv.padding, dilation=conv.dilation, groups=conv.groups,
                           padding_mode=conv.padding_mode, device=w.device, dtype=w.dtype)
        folded.weight.copy_(w)
        folded.bias.copy_(b)
    return folded


def fold_model(model: nn.Module) -> nn.Module:
    """An eval-mode copy of ``model`` with each BN/MABN folded into the ``nn.Conv2d`` registered just before it.

    That pairing is the data flow in an ``nn.Sequential`` and in ``models.ResNet`` (each conv is
    registered right before the norm that follows it). Other layers (GroupNorm too) stay as they are.
    """
    folded = copy.deepcopy(model).eval()

    def visit(module: nn.Module) -> None:
        prev_name, prev = None, None
        for name, child in list(module.named_children()):
            if isinstance(child, (nn.BatchNorm2d, MABN2d)) and isinstance(prev, nn.Conv2d):
                setattr(module, prev_name, fold_norm(prev, child))
                setattr(module, name, nn.Identity())
            else:
                visit(child)
            prev_name, prev = name, child

    visit(folded)
    return folded
