"""Moving Average Batch Normalization (Yan et al., ICLR 2020; chapter 04): BatchNorm for small batches.

- ``MABN2d``: no centring, and moving averages over the last m batches of both the forward statistic
  and the backward one (``MABNFunction``), so a batch of 2 normalises with m batches' worth of statistics;
  ``group_size=g`` gives each simulated device (or micro-batch) its own statistics.
- ``CenConv2d`` and ``centralize_convs``: the weight-centralised convolution MABN is paired with.
- ``split_groups``: how many per-device groups of images a batch holds (also used by ``norms``).
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch
from torch import nn


def split_groups(n: int, group_size: int | None, layer: str) -> int:
    """How many groups of ``group_size`` images a batch of ``n`` holds (1 for ``None`` or ``n <= group_size``)."""
    if group_size is None or n <= group_size:
        return 1
    if n % group_size:
        raise ValueError(f"{layer}: a batch of {n} images does not split into groups of {group_size}; "
                         "use a batch that is a multiple of group_size (drop_last=True in the loader)")
    return n // group_size


Average = Callable[[torch.Tensor], torch.Tensor]  # this step's (G, C) statistic -> the (G, C) one to use


def _sma_per_device(buffer: torch.Tensor, slot: int, use_sma: bool) -> Average:
    """Each group is a device with its own buffer rows: write this step's statistic into ``slot`` of the
    (m, G, C) ring and return the mean over the m steps it holds (or the statistic alone, before ``use_sma``)."""

    def average(stat: torch.Tensor) -> torch.Tensor:
        buffer[slot] = stat
        return buffer.mean(0) if use_sma else stat

    return average


def _sma_in_sequence(buffer: torch.Tensor, use_sma: torch.Tensor) -> Average:
    """The groups are micro-batches that one device runs in order: ``buffer`` (m, 1, C) holds the last m
    micro-batches' statistics, oldest first; group i gets the mean over the m up to itself (its own, the
    groups before it in this step, then the previous steps'), or its own alone where ``use_sma[i]`` is False."""
    m = buffer.shape[0]

    def average(stat: torch.Tensor) -> torch.Tensor:
        sequence = torch.cat([buffer[:, 0], stat])  # (m + G, C) in the order the micro-batches ran
        window = sequence.unfold(0, m, 1)[1:].mean(-1)  # row i: the m statistics ending at group i
        buffer[:, 0] = sequence[-m:]
        return torch.where(use_sma.view(-1, 1), window, stat)

    return average


class MABNFunction(torch.autograd.Function):
    """``y = weight * r * x / s + bias``, ``s = sqrt(psi + eps)`` given; the backward uses a moving-average statistic.

    With ``z = x / s`` and ``g = dL/dz``, the exact backward of ``x / sqrt(mean(x^2) + eps)`` is
    ``dx = (g - z * mean(g * z)) / s``. MABN replaces this batch's ``mean(g * z)`` by its simple
    moving average over the last m batches (``average``, which also records it), and treats ``r`` as a
    constant. With m = 1 and r = 1 this is exactly autograd's gradient. Saves only ``x``, as BN does.
    ``inv_s`` and ``r`` are (G, C): one row per group of N / G consecutive images (one device's, or one
    micro-batch's, share of the batch), each group with its own statistics.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, inv_s: torch.Tensor,
                r: torch.Tensor, average: Average) -> torch.Tensor:
        groups, c = inv_s.shape
        ctx.save_for_backward(x, weight, inv_s, r)
        ctx.average = average
        xg = x.view(groups, -1, *x.shape[1:])  # (G, N/G, C, H, W): a view, no copy
        scale = (weight * r * inv_s).view(groups, 1, c, 1, 1).to(x.dtype)
        # one fused multiply-add: no centring, so the whole layer is a per-channel scale and shift
        return torch.addcmul(bias.view(1, 1, c, 1, 1).to(x.dtype), xg, scale).view(x.shape)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor):  # type: ignore[override]
        x, weight, inv_s, r = ctx.saved_tensors
        groups, c = inv_s.shape
        count = x.numel() // (groups * c)  # values per channel in one group
        acc = torch.promote_types(x.dtype, torch.float32)  # reduce in at least float32 (bf16 under autocast)
        # the one reduction over the activations it needs: per image over (H, W), then per group
        gx_sum = (grad_out * x).sum((2, 3), dtype=acc).view(groups, -1, c).sum(1)  # (G, C)
        scale = weight * r * inv_s  # dy/dx with the statistic held fixed, (G, C)
        grad_weight = (gx_sum * r * inv_s).sum(0)  # sum(grad_out * r * z) over every group
        grad_bias = grad_out.sum((0, 2, 3), dtype=acc)
        psi_g = gx_sum / count * scale  # each group's mean(g * z), g = grad_out * weight * r
        psi_g_used = ctx.average(psi_g)
        # dx = (g - z * psi_g) / s  =  grad_out * scale - x * psi_g / s^2, group by group
        shape = (groups, 1, c, 1, 1)
        go, xg = grad_out.view(groups, -1, *x.shape[1:]), x.view(groups, -1, *x.shape[1:])
        grad_x = go * scale.view(shape).to(x.dtype) - xg * (psi_g_used * inv_s**2).view(shape).to(x.dtype)
        return grad_x.view(x.shape), grad_weight.to(weight.dtype), grad_bias.to(weight.dtype), None, None, None


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

    ``group_size=g`` splits each training batch into groups of g consecutive images, one per
    simulated device: each group keeps its own SMA buffers (its own rows of ``stat_buffer`` and
    ``grad_buffer``, shaped (m, N/g, C) from the first training batch on), as a device that keeps
    its buffers to itself does. ``running_var``, which evaluation uses, follows device 0's SMA, and
    every group renormalises towards it. With ``sequential=True`` the groups are instead the
    micro-batches that one device runs one after another (gradient accumulation, chapter 03), which
    is how the authors simulate a normalisation batch of 2 within an SGD batch of 256 on ImageNet:
    one moving average runs through the groups in order (buffers (m, 1, C)), so with m = N/g it spans
    this step's groups and the previous step's, and ``step``, the warm-ups and the EMA count
    micro-batches. Either way the result equals separate layers run on each group (tests check it).
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float = 0.98, buffer_size: int = 16,
                 warmup_steps: int = 100, renorm_warmup: int = 1000, clip: float = 5.0,
                 group_size: int | None = None, sequential: bool = False):
        super().__init__()
        if num_features <= 0 or buffer_size < 1 or not 0 <= momentum < 1 or clip < 1:
            raise ValueError(f"MABN2d needs num_features > 0 (got {num_features}), buffer_size >= 1 "
                             f"(got {buffer_size}), 0 <= momentum < 1 (got {momentum}), clip >= 1 (got {clip})")
        if group_size is not None and group_size < 1:
            raise ValueError(f"group_size must be None or at least 1 image, got {group_size}")
        self.num_features, self.eps, self.momentum, self.clip = num_features, eps, momentum, clip
        self.buffer_size, self.warmup_steps, self.renorm_warmup = buffer_size, warmup_steps, renorm_warmup
        self.group_size, self.sequential = group_size, sequential
        self.weight = nn.Parameter(torch.ones(num_features))
        self.bias = nn.Parameter(torch.zeros(num_features))
        # Buffers, so .to(device) and state_dict carry them; (m, G, C) each: 2 * m * G * C floats per layer.
        self.register_buffer("running_var", torch.ones(num_features))
        self.register_buffer("stat_buffer", torch.zeros(buffer_size, 1, num_features))
        self.register_buffer("grad_buffer", torch.zeros(buffer_size, 1, num_features))
        self.step = 0  # a Python int (saved as extra state), so the GPU never syncs to read it

    def get_extra_state(self) -> dict:
        return {"step": self.step}

    def set_extra_state(self, state: dict) -> None:
        self.step = int(state["step"])

    def _load_from_state_dict(self, state_dict: dict, prefix: str, *args: Any, **kwargs: Any) -> None:
        # A checkpoint of a model trained with groups carries (m, G, C) buffers: take their shape.
        for name in ("stat_buffer", "grad_buffer"):
            saved, own = state_dict.get(prefix + name), getattr(self, name)
            if saved is not None and saved.shape != own.shape:
                setattr(self, name, own.new_zeros(saved.shape))
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def _groups(self, n: int) -> int:
        """The batch's number of groups; sizes the buffers on the first training batch."""
        groups = split_groups(n, self.group_size, "MABN2d")
        rows = 1 if self.sequential else groups  # one sequence of micro-batches, or a buffer per device
        if self.stat_buffer.shape[1] != rows:
            if self.step:
                raise ValueError(f"MABN2d has buffers for {self.stat_buffer.shape[1]} group(s) of images, but this "
                                 f"batch of {n} makes {groups}: keep the training batch size fixed")
            self.stat_buffer = self.stat_buffer.new_zeros(self.buffer_size, rows, self.num_features)
            self.grad_buffer = self.grad_buffer.new_zeros(self.buffer_size, rows, self.num_features)
        return groups

    def _ema_in_sequence(self, psi: torch.Tensor) -> torch.Tensor:
        """Advance ``running_var`` by one EMA update per micro-batch, in order; return the EMA each one
        found before its own update, (G, C). Closed form (one matmul, not G small updates):
        ``ema_i = mom^(i+1) ema_start + (1 - mom) * sum_{j <= i} mom^(i-j) psi_j``."""
        groups, mom = psi.shape[0], self.momentum
        i = torch.arange(groups, device=psi.device, dtype=psi.dtype)
        lag = i.view(-1, 1) - i.view(1, -1)
        weights = torch.where(lag >= 0, (1 - mom) * mom ** lag.clamp(min=0), torch.zeros_like(lag))
        after = mom ** (i + 1).view(-1, 1) * self.running_var.to(psi.dtype) + weights @ psi  # (G, C)
        before = torch.cat([self.running_var.to(psi.dtype).view(1, -1), after[:-1]])
        self.running_var.copy_(after[-1])
        return before

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 4 or x.shape[1] != self.num_features:
            raise ValueError(f"MABN2d expects (N, {self.num_features}, H, W); got {tuple(x.shape)}")
        if not self.training:  # a fixed per-channel scale and shift: foldable into the conv
            scale = self.weight * torch.rsqrt(self.running_var + self.eps)
            return torch.addcmul(self.bias.view(1, -1, 1, 1), x, scale.view(1, -1, 1, 1))
        groups = self._groups(x.shape[0])
        full = max(self.warmup_steps, self.buffer_size - 1)  # the SMA is used from here on (buffer full at m-1)
        with torch.no_grad():
            acc = torch.promote_types(x.dtype, torch.float32)  # at least float32, also under bf16 autocast
            # this batch's second moment per group and channel: per image over (H, W), then per group
            chi = x.detach().pow(2).mean((2, 3), dtype=acc).view(groups, -1, self.num_features).mean(1)
            if self.sequential:  # micro-batch i of this step is the layer's (step + i)-th
                index = self.step + torch.arange(groups, device=x.device)
                use_sma, renorm = index >= full, (index >= self.renorm_warmup).view(-1, 1)
                stat_average = _sma_in_sequence(self.stat_buffer, use_sma)
                grad_average = _sma_in_sequence(self.grad_buffer, use_sma)
                psi = stat_average(chi)  # (G, C)
                ema_before = self._ema_in_sequence(psi)
                self.step += groups
            else:
                slot = self.step % self.buffer_size
                stat_average = _sma_per_device(self.stat_buffer, slot, self.step >= full)
                grad_average = _sma_per_device(self.grad_buffer, slot, self.step >= full)
                psi = stat_average(chi)  # (G, C)
                renorm, ema_before = self.step >= self.renorm_warmup, self.running_var.clone()  # bools
                self.running_var.mul_(self.momentum).add_(psi[0], alpha=1 - self.momentum)  # device 0's
                self.step += 1
            inv_s = torch.rsqrt(psi + self.eps)
            r = torch.ones_like(psi)
            if renorm is not False:  # a per-micro-batch mask, or True once a device is past the warm-up
                ratio = (torch.sqrt(psi + self.eps) * torch.rsqrt(ema_before + self.eps)).clamp(1 / self.clip, self.clip)
                r = torch.where(renorm, ratio, r) if self.sequential else ratio
        return MABNFunction.apply(x, self.weight, self.bias, inv_s, r, grad_average)

    def extra_repr(self) -> str:
        return (f"{self.num_features}, eps={self.eps}, momentum={self.momentum}, buffer_size={self.buffer_size}, "
                f"warmup_steps={self.warmup_steps}, renorm_warmup={self.renorm_warmup}, clip={self.clip}"
                + (f", group_size={self.group_size}" if self.group_size is not None else "")
                + (", sequential=True" if self.sequential else ""))


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
