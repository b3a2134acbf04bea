"""Normalisation at small batch (chapter 04).

- ``GroupNorm``: the teaching version of ``torch.nn.GroupNorm`` (Wu & He 2018):
  statistics per sample and per group of channels, so no sample depends on its batch.
- ``MABN2d`` and ``CenConv2d``: Moving Average Batch Normalization (Yan et al.,
  ICLR 2020) and the weight-centralised convolution it is paired with;
  ``centralize_convs`` swaps a model's ``nn.Conv2d`` layers for ``CenConv2d``.
- ``make_norm(kind, channels)``: the factory ``models.ResNet`` takes as ``norm_layer``.
- ``fold_norm`` / ``fold_model``: merge an eval-mode BN or MABN into the convolution before it.
"""

from __future__ import annotations

import copy
from typing import Any, Iterable

import torch
from torch import nn

NORM_KINDS = ("bn", "gn", "ln", "in", "mabn", "none")


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


# ----- MABN ---------------------------------------------------------------------------


class MABNFunction(torch.autograd.Function):
    """``y = weight * r * x / s + bias``, ``s = sqrt(psi + eps)`` given; the backward uses a moving-average statistic.

    With ``z = x / s`` and ``g = dL/dz``, the exact backward of ``x / sqrt(mean(x^2) + eps)`` is
    ``dx = (g - z * mean(g * z)) / s``. MABN replaces this batch's ``mean(g * z)`` by its simple
    moving average over the last m batches (``grad_buffer``), and treats ``r`` as a constant.
    With m = 1 and r = 1 this is exactly autograd's gradient. Saves only ``x``, as BN does.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, inv_s: torch.Tensor,
                r: torch.Tensor, grad_buffer: torch.Tensor, slot: int, use_sma: bool) -> torch.Tensor:
        shape = (1, -1) + (1,) * (x.dim() - 2)
        ctx.save_for_backward(x, weight, inv_s, r)
        ctx.grad_buffer, ctx.slot, ctx.use_sma = grad_buffer, slot, use_sma
        # one fused multiply-add: no centring, so the whole layer is a per-channel scale and shift
        return torch.addcmul(bias.view(shape).to(x.dtype), x, (weight * r * inv_s).view(shape).to(x.dtype))

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor):  # type: ignore[override]
        x, weight, inv_s, r = ctx.saved_tensors
        dims = [0] + list(range(2, x.dim()))
        shape = (1, -1) + (1,) * (x.dim() - 2)
        count = x.numel() // x.shape[1]  # values per channel in this batch
        acc = torch.promote_types(x.dtype, torch.float32)  # reduce in at least float32 (bf16 under autocast)
        gx_sum = (grad_out * x).sum(dims, dtype=acc)  # the one reduction over the activations it needs
        scale = weight * r * inv_s  # dy/dx with the statistic held fixed
        grad_weight = gx_sum * r * inv_s  # sum(grad_out * r * z)
        grad_bias = grad_out.sum(dims, dtype=acc)
        psi_g = gx_sum / count * scale  # this batch's mean(g * z), g = grad_out * weight * r
        ctx.grad_buffer[ctx.slot] = psi_g
        psi_g_used = ctx.grad_buffer.mean(0) if ctx.use_sma else psi_g
        # dx = (g - z * psi_g) / s  =  grad_out * scale - x * psi_g / s^2
        grad_x = grad_out * scale.view(shape).to(x.dtype) - x * (psi_g_used * inv_s**2).view(shape).to(x.dtype)
        return grad_x, grad_weight.to(weight.dtype), grad_bias.to(weight.dtype), None, None, None, None, None


class MABN2d(nn.Module):
    """Moving Average Batch Normalization (Yan et al., "Towards Stabilizing Batch Statistics in
    Backward Propagation of Batch Normalization", ICLR 2020), for (N, C, H, W) inputs.

    Training step t, per channel:
      1. no centring: only the second moment ``chi_t = mean(x^2)`` over (N, H, W);
      2. forward statistic: the simple moving average (SMA) of the last ``buffer_size`` chi's;
      3. backward statistic ``mean(g * z)``: likewise averaged over its own buffer (``MABNFunction``);
      4. ``running_var``: an exponential moving average (EMA) of the SMA, used in evaluation;
      5. after ``renorm_warmup`` steps, renormalise: ``r = clip(sqrt(SMA) / sqrt(EMA), 1/clip, clip)``.
    For the first ``warmup_steps`` steps (and until the buffers are full) it uses this batch's
    statistics alone. Pair it with ``CenConv2d`` (see ``centralize_convs``): without centring, the
    second moment equals the variance only if the inputs have mean near zero.
    Defaults (EMA momentum 0.98, clip 5, warm-ups of 100 and 1,000 steps) are those of the authors'
    released layer. Renormalising much earlier hurt in the chapter's short runs: a 50-step EMA lags
    the statistics while the learning rate is high (MABN at batch 32 reached 48-54% error, not 2-7%).
    A training-mode forward must be followed by its backward before the next one (as in ``fit``); like
    BN's running statistics, the buffers advance on every training-mode forward, so a forward re-run by
    activation checkpointing (chapter 05) advances them twice.
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float = 0.98, buffer_size: int = 16,
                 warmup_steps: int = 100, renorm_warmup: int = 1000, clip: float = 5.0):
        super().__init__()
        if num_features <= 0 or buffer_size < 1 or not 0 <= momentum < 1 or clip < 1:
            raise ValueError(f"MABN2d needs num_features > 0 (got {num_features}), buffer_size >= 1 "
                             f"(got {buffer_size}), 0 <= momentum < 1 (got {momentum}), clip >= 1 (got {clip})")
        self.num_features, self.eps, self.momentum, self.clip = num_features, eps, momentum, clip
        self.buffer_size, self.warmup_steps, self.renorm_warmup = buffer_size, warmup_steps, renorm_warmup
        self.weight = nn.Parameter(torch.ones(num_features))
        self.bias = nn.Parameter(torch.zeros(num_features))
        # Buffers, so .to(device) and state_dict carry them; (m, C) each: 2 * m * C floats per layer.
        self.register_buffer("running_var", torch.ones(num_features))
        self.register_buffer("stat_buffer", torch.zeros(buffer_size, num_features))
        self.register_buffer("grad_buffer", torch.zeros(buffer_size, num_features))
        self.step = 0  # a Python int (saved as extra state), so the GPU never syncs to read it

    def get_extra_state(self) -> dict:
        return {"step": self.step}

    def set_extra_state(self, state: dict) -> None:
        self.step = int(state["step"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 4 or x.shape[1] != self.num_features:
            raise ValueError(f"MABN2d expects (N, {self.num_features}, H, W); got {tuple(x.shape)}")
        if not self.training:  # a fixed per-channel scale and shift: foldable into the conv
            scale = self.weight * torch.rsqrt(self.running_var + self.eps)
            return torch.addcmul(self.bias.view(1, -1, 1, 1), x, scale.view(1, -1, 1, 1))
        slot = self.step % self.buffer_size
        use_sma = self.step >= max(self.warmup_steps, self.buffer_size - 1)  # buffer full from step m-1
        with torch.no_grad():
            acc = torch.promote_types(x.dtype, torch.float32)  # at least float32, also under bf16 autocast
            chi = x.detach().pow(2).mean((0, 2, 3), dtype=acc)  # this batch's second moment, per channel
            self.stat_buffer[slot] = chi
            psi = self.stat_buffer.mean(0) if use_sma else chi
            inv_s = torch.rsqrt(psi + self.eps)
            if self.step >= self.renorm_warmup:
                r = torch.sqrt(psi + self.eps) * torch.rsqrt(self.running_var + self.eps)
                r = r.clamp(1 / self.clip, self.clip)
            else:
                r = torch.ones_like(psi)
            self.running_var.mul_(self.momentum).add_(psi, alpha=1 - self.momentum)
        self.step += 1
        return MABNFunction.apply(x, self.weight, self.bias, inv_s, r, self.grad_buffer, slot, use_sma)

    def extra_repr(self) -> str:
        return (f"{self.num_features}, eps={self.eps}, momentum={self.momentum}, buffer_size={self.buffer_size}, "
                f"warmup_steps={self.warmup_steps}, renorm_warmup={self.renorm_warmup}, clip={self.clip}")


class CenConv2d(nn.Conv2d):
    """``nn.Conv2d`` with weight centralisation (Yan et al. 2020): each filter's weights minus their mean.

    A zero-mean filter maps a channel-constant input to zero, so the outputs' mean stays near
    zero and MABN's second moment is close to their variance. Costs one mean over the weights.
    """

    def centered_weight(self) -> torch.Tensor:
        return self.weight - self.weight.mean(dim=(1, 2, 3), keepdim=True)  # per output filter

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._conv_forward(x, self.centered_weight(), self.bias)

    @classmethod
    def from_conv(cls, conv: nn.Conv2d) -> "CenConv2d":
        """A ``CenConv2d`` with the same geometry, device, dtype and (raw) weights as ``conv``."""
        new = cls(conv.in_channels, conv.out_channels, conv.kernel_size, conv.stride, conv.padding,
                  conv.dilation, conv.groups, conv.bias is not None, conv.padding_mode,
                  device=conv.weight.device, dtype=conv.weight.dtype)
        new.load_state_dict(conv.state_dict())
        return new


def centralize_convs(model: nn.Module, skip: Iterable[str] = ()) -> nn.Module:
    """Replace every plain ``nn.Conv2d`` of ``model`` (in place) by a ``CenConv2d``; return ``model``.

    ``skip`` names convolutions to leave plain, as ``named_modules`` spells them (e.g. ``"stem.0"``,
    the convolution that reads the image in ``models.ResNet``).
    """
    skip = set(skip)
    unknown = skip - {name for name, _ in model.named_modules()}
    if unknown:
        raise ValueError(f"centralize_convs: no module named {sorted(unknown)} in the model")
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            full = f"{name}.{child_name}" if name else child_name
            if type(child) is nn.Conv2d and full not in skip:
                setattr(module, child_name, CenConv2d.from_conv(child))
    return model


# ----- the factory ---------------------------------------------------------------------


def gn_groups(channels: int, channels_per_group: int = 4, max_groups: int = 32) -> int:
    """GroupNorm's group count: 32 groups (Wu & He 2018's default) where a layer is wide enough,
    else groups of ``channels_per_group`` channels (a width-16 layer gets 4 groups of 4),
    always a divisor of ``channels``."""
    groups = max(1, min(max_groups, channels // channels_per_group))
    while channels % groups:
        groups -= 1
    return groups


def make_norm(kind: str, channels: int, **options: Any) -> nn.Module:
    """A normalisation layer for ``channels`` channels: ``bn``, ``gn``, ``ln``, ``in``, ``mabn`` or ``none``.

    ``options`` go to the layer (``groups=`` for ``gn``; ``buffer_size=`` etc. for ``mabn``). LN and
    IN are GroupNorm with one group and with one channel per group, as in Wu & He (2018).
    """
    if kind == "bn":
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


# ----- folding for inference -----------------------------------------------------------


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
    with torch.no_grad():
        weight = conv.centered_weight() if isinstance(conv, CenConv2d) else conv.weight
        if isinstance(norm, MABN2d):
            scale = norm.weight * torch.rsqrt(norm.running_var + norm.eps)
            shift = norm.bias.clone()
        else:
            if norm.running_var is None:
                raise ValueError("this BatchNorm2d has track_running_stats=False: it uses batch statistics "
                                 "even in eval mode, so it cannot be folded")
            gamma = norm.weight if norm.affine else torch.ones_like(norm.running_var)
            beta = norm.bias if norm.affine else torch.zeros_like(norm.running_var)
            scale = gamma * torch.rsqrt(norm.running_var + norm.eps)
            shift = beta - norm.running_mean * scale
        conv_bias = conv.bias if conv.bias is not None else torch.zeros_like(shift)
        folded = nn.Conv2d(conv.in_channels, conv.out_channels, conv.kernel_size, conv.stride, conv.padding,
                           conv.dilation, conv.groups, True, conv.padding_mode,
                           device=weight.device, dtype=weight.dtype)
        folded.weight.copy_(weight * scale.view(-1, 1, 1, 1))
        folded.bias.copy_(conv_bias * scale + shift)
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
