"""Freezing and LoRA: fine-tuning with fewer trainable bytes (chapter 01).

- **Freezing** (PipeTransformer, He et al. 2021): the first ``k`` blocks keep their weights. They need no gradients
  and no optimizer state, and since nothing in front of the first trainable layer needs a gradient, autograd
  records nothing there: the frozen prefix saves no activations (the first trainable layer still saves its input).
  ``freeze_prefix(model, k)``; ``blocks(model)`` says what a block is.
- **LoRA** (Hu et al. 2021): an adapted layer keeps ``W`` frozen and learns ``(alpha / r) B A``, ``A`` of ``r``
  rows, ``B`` of ``r`` columns, ``B`` starting at zero (training starts at the pretrained function). ``LoRALinear``
  computes ``W x + (alpha / r) B (A x)``, saving ``x`` and ``A x``; ``LoRAConv2d`` (ConvLoRA, Aleem et al. 2024)
  reshapes ``B A`` to the kernel's shape and runs one convolution with ``W + (alpha / r) B A``. ``add_lora`` wraps
  every ``Linear`` and ``Conv2d``; ``merge_lora`` folds each update into a plain layer for inference.

Both cut the gradients and the optimizer state to the trainable part; only freezing removes activations, and only
in front of the first trainable layer. tests/test_lora.py checks the bytes against ``memory``'s measurements.
"""

from __future__ import annotations

import math
from typing import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from course_lib.memory import _storage_key
from course_lib.models import ResNet, TinyTransformer


class LoRALinear(nn.Module):
    """``base(x) + (alpha / r) * x A^T B^T``: a frozen ``nn.Linear`` plus a trainable rank-``r`` update."""

    def __init__(self, base: nn.Linear, r: int, alpha: float):
        super().__init__()
        if r < 1:
            raise ValueError(f"LoRA's rank r must be at least 1, got {r}")
        self.base = base
        self.r, self.alpha, self.scaling = r, alpha, alpha / r
        w = base.weight
        # A: Gaussian with the variance of a default layer's fan-in (A x keeps x's scale); B: zero, so the update
        # B A is zero and the wrapped layer computes exactly what the pretrained one did
        self.lora_A = nn.Parameter(torch.randn(r, base.in_features, dtype=w.dtype, device=w.device)
                                   / math.sqrt(base.in_features))
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, r, dtype=w.dtype, device=w.device))
        base.requires_grad_(False)

    def delta_weight(self) -> torch.Tensor:
        """The update ``(alpha / r) B A``, of the base weight's shape."""
        return (self.lora_B @ self.lora_A) * self.scaling

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Two thin products instead of one (W + BA) x: x A^T has r columns, so the extra tensor saved for
        # backward is r numbers per row, and the (out, in) update is never formed.
        return self.base(x) + F.linear(F.linear(x, self.lora_A), self.lora_B) * self.scaling


class LoRAConv2d(nn.Module):
    """A frozen ``nn.Conv2d`` run with the kernel ``W + (alpha / r) (B A).view(W.shape)``, as ConvLoRA does.

    For a ``k x k`` kernel ``A`` is ``(r k, in k)`` and ``B`` is ``(out k, r k)``: ``r k^2 (in + out)`` trainable
    numbers. Square kernels and ``groups=1`` only (every convolution of the course's ResNet).
    """

    def __init__(self, base: nn.Conv2d, r: int, alpha: float):
        super().__init__()
        if r < 1:
            raise ValueError(f"LoRA's rank r must be at least 1, got {r}")
        kh, kw = base.kernel_size
        if kh != kw or base.groups != 1:
            raise ValueError(f"LoRAConv2d takes square kernels with groups=1; got kernel {base.kernel_size}, "
                             f"groups={base.groups}")
        self.base = base
        self.r, self.alpha, self.scaling = r, alpha, alpha / r
        k, w = kh, base.weight
        self.lora_A = nn.Parameter(torch.randn(r * k, base.in_channels * k, dtype=w.dtype, device=w.device)
                                   / math.sqrt(base.in_channels * k))
        self.lora_B = nn.Parameter(torch.zeros(base.out_channels * k, r * k, dtype=w.dtype, device=w.device))
        base.requires_grad_(False)

    def delta_weight(self) -> torch.Tensor:
        """The update ``(alpha / r) (B A)`` reshaped to the kernel's shape ``(out, in, k, k)``."""
        return (self.lora_B @ self.lora_A).view(self.base.weight.shape) * self.scaling

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # One convolution with the summed kernel: it saves x and that kernel (a tensor of W's size, not a
        # parameter) for backward; the gradient reaches A and B through the sum.
        return self.base._conv_forward(x, self.base.weight + self.delta_weight(), self.base.bias)


LoRALayer = (LoRALinear, LoRAConv2d)


def blocks(model: nn.Module) -> list[nn.Module]:
    """The model's blocks in the order the forward pass runs them: what ``freeze_prefix`` counts.

    ``ResNet``: the stem, each residual block, then the head (pooling, flatten, ``fc``, as one
    ``nn.Sequential`` of those same modules). ``TinyTransformer``: ``as_sequential()`` (embedding, blocks,
    head). An ``nn.Sequential``: its children.
    """
    if isinstance(model, ResNet):
        return [model.stem, *model.layers, nn.Sequential(model.pool, model.flatten, model.fc)]
    if isinstance(model, TinyTransformer):
        return list(model.as_sequential())
    if isinstance(model, nn.Sequential):
        return list(model)
    raise TypeError(f"blocks() knows ResNet, TinyTransformer and nn.Sequential, not {type(model).__name__}")


def freeze_prefix(model: nn.Module, k: int) -> list[nn.Module]:
    """Freeze the parameters of the first ``k`` of ``blocks(model)`` (0 freezes nothing); return those blocks.

    At least one block must stay trainable. BatchNorm layers of a frozen block keep their training mode: they
    still normalise with the batch's statistics and update their running averages (which fine-tuning on a new
    distribution wants: AdaBN); their weights no longer change.
    """
    parts = blocks(model)
    if not 0 <= k < len(parts):
        raise ValueError(f"can freeze 0 to {len(parts) - 1} of the {len(parts)} blocks (one must train), got {k}")
    for part in parts[:k]:
        part.requires_grad_(False)
    return parts[:k]


def _adaptable(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) or (
        isinstance(module, nn.Conv2d) and module.kernel_size[0] == module.kernel_size[1] and module.groups == 1)


def add_lora(model: nn.Module, r: int, alpha: float, skip: Iterable[str] = ()) -> nn.Module:
    """Wrap every ``Linear`` and ``Conv2d`` of ``model`` in LoRA of rank ``r`` (in place); return ``model``.

    Every parameter outside the adapters is frozen, except those of the modules named in ``skip`` (qualified
    names, e.g. ``("fc",)`` for a new classification head), which are neither wrapped nor frozen.
    """
    if r < 1:
        raise ValueError(f"LoRA's rank r must be at least 1, got {r}")
    skip = tuple(skip)
    names = {name for name, _ in model.named_modules()}
    unknown = [s for s in skip if s not in names]
    if unknown:
        raise ValueError(f"skip names modules the model does not have: {unknown}")

    def skipped(name: str) -> bool:
        return any(name == s or name.startswith(s + ".") for s in skip)

    model.requires_grad_(False)
    for name, module in list(model.named_modules()):
        if skipped(name):
            module.requires_grad_(True)
            continue
        for child_name, child in list(module.named_children()):
            full = f"{name}.{child_name}" if name else child_name
            if skipped(full) or isinstance(module, LoRALayer) or not _adaptable(child):
                continue
            wrapper = LoRALinear if isinstance(child, nn.Linear) else LoRAConv2d
            setattr(module, child_name, wrapper(child, r, alpha))
    return model


@torch.no_grad()
def merge_lora(model: nn.Module) -> nn.Module:
    """Replace every LoRA layer of ``model`` (in place) by its base layer with the update added to its weight.

    The merged layer computes the same function (up to float rounding) with no extra parameters or work.
    """
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, LoRALayer):
                child.base.weight += child.delta_weight()
                setattr(module, child_name, child.base)
    return model


def lora_params(module: nn.Linear | nn.Conv2d, r: int) -> int:
    """Trainable numbers LoRA of rank ``r`` adds to one layer: ``r (in + out)``; ``r k^2 (in + out)`` for a conv."""
    if isinstance(module, nn.Linear):
        return r * (module.in_features + module.out_features)
    if isinstance(module, nn.Conv2d):
        k = module.kernel_size[0]
        return r * k * k * (module.in_channels + module.out_channels)
    raise TypeError(f"LoRA adapts nn.Linear and nn.Conv2d, not {type(module).__name__}")


def trainable_params(model: nn.Module) -> list[nn.Parameter]:
    """The parameters that need a gradient: what the optimizer is given."""
    return [p for p in model.parameters() if p.requires_grad]


def saved_bytes_per_block(model: nn.Module, fn: Callable[[], object]) -> list[int]:
    """Bytes autograd saves while ``fn()`` runs, split by which of ``blocks(model)`` was running.

    Counted as ``memory.saved_activation_bytes`` counts (each storage once, the model's parameters left out);
    a tensor saved by two blocks is counted in the first. What is saved outside every block (the loss) is left
    out: add ``memory.saved_activation_bytes`` minus the sum to get it.
    """
    parts = blocks(model)
    excluded = {_storage_key(p) for p in model.parameters()}
    current: list[int] = []  # the index of the block now running (a stack: blocks do not nest, but be safe)
    seen: dict[int, tuple[int, int]] = {}
    keep: list[torch.Tensor] = []  # every saved tensor stays alive while we count, so no storage is reused

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = _storage_key(t)
        if current and key not in excluded and key not in seen:
            seen[key] = (current[-1], t.untyped_storage().nbytes())
            keep.append(t)
        return t

    def leave(module: nn.Module, args: tuple, out: object) -> None:
        current.pop()  # returns None: a forward hook that returns a value replaces the module's output

    handles = []
    for i, part in enumerate(parts):
        # hooks on every module of the block, not only on the block: ResNet's head is a list of modules
        # that its forward calls one by one, never as the nn.Sequential blocks() returns
        for m in part.modules():
            handles.append(m.register_forward_pre_hook(lambda m, a, i=i: current.append(i)))
            handles.append(m.register_forward_hook(leave))
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            fn()
    finally:
        for h in handles:
            h.remove()
    out = [0] * len(parts)
    for index, nbytes in seen.values():
        out[index] += nbytes
    return out
