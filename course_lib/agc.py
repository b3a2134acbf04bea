"""Adaptive gradient clipping, AGC (chapter 04).

Brock et al. 2021, "High-Performance Large-Scale Image Recognition Without Normalization" (NFNets), clip
each *unit* of a weight (one output unit: a row of a linear weight, one output channel of a conv) by the
size of its gradient relative to the size of the weights it updates:

    ratio_i = ||G_i|| / max(||W_i||, eps)
    G_i <- clipping * max(||W_i||, eps) / ||G_i|| * G_i      where ratio_i > clipping

so no step of SGD moves a unit by more than ``lr * clipping`` of its own norm (plus momentum's memory).
``eps`` keeps units whose weights start at zero (biases, zero-initialised gains) able to move. The paper
does not clip the final classifier layer (the authors found it best left unclipped); ``clippable_parameters``
leaves it out by name.

A parameter of one dimension (a bias, a vector of gains) counts as a single unit, its norm that of the
whole vector, as in the authors' reference code (``unitwise_norm`` in deepmind-research/nfnets).
"""

from __future__ import annotations

from typing import Iterable, Sequence

import torch
from torch import nn

# The authors' default for the floor on a unit's weight norm (their agc_optax.py).
EPS = 1e-3


def unitwise_norm(x: torch.Tensor) -> torch.Tensor:
    """The L2 norm of each output unit of ``x``, shaped to broadcast against it, in at least float32.

    ``x`` of shape (out, ...): one norm per index of dim 0 over the other dims, shape (out, 1, ...).
    One or zero dims: the norm of the whole tensor (one unit), shape ``x.shape``-broadcastable (a 0-dim tensor).
    """
    acc = torch.promote_types(x.dtype, torch.float32)
    if x.dim() <= 1:
        return torch.linalg.vector_norm(x, dtype=acc)
    return torch.linalg.vector_norm(x, dim=tuple(range(1, x.dim())), keepdim=True, dtype=acc)


@torch.no_grad()
def adaptive_clip_(parameters: Iterable[torch.Tensor], clipping: float = 0.01, eps: float = EPS) -> torch.Tensor:
    """Clip the ``.grad`` of every parameter in place, unit by unit (the formula in the module's docstring).

    ``clipping`` is the paper's lambda: 0.01 for their batch of 4,096 images, larger for smaller batches
    (their Figure 3). Parameters without a gradient are skipped. Returns the share of units clipped, as a
    0-dim tensor (not a Python float: reading it would wait for a GPU every step). Costs two norms and one
    multiply per parameter: a pass over the weights and one over the gradients, nothing per activation.
    """
    if not clipping > 0:
        raise ValueError(f"clipping must be positive, got {clipping}")
    if not eps >= 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    clipped, units = None, 0
    for p in parameters:
        if p.grad is None:
            continue
        w_norm = unitwise_norm(p).clamp(min=eps)
        g_norm = unitwise_norm(p.grad)
        max_norm = clipping * w_norm
        over = g_norm > max_norm
        # where over, g_norm > max_norm >= clipping * eps, so the division is safe unless eps = 0 and W_i = 0;
        # the floor keeps a zero gradient at zero (its unit is never over)
        scale = torch.where(over, max_norm / g_norm.clamp(min=torch.finfo(g_norm.dtype).tiny), 1.0)
        p.grad.mul_(scale.to(p.grad.dtype))
        count = over.sum()
        clipped = count if clipped is None else clipped + count
        units += over.numel()
    if clipped is None:
        return torch.zeros(())  # host: no parameter to clip, nothing on any device
    return clipped / units


def clippable_parameters(model: nn.Module, skip: Sequence[str] = ("fc",)) -> list[nn.Parameter]:
    """``model``'s trainable parameters except those of the modules named in ``skip`` (as ``named_modules``
    spells them): by default the final classifier ``fc`` of ``models.ResNet`` and ``models.NFResNet``,
    which the paper does not clip."""
    names = {name for name, _ in model.named_modules()}
    unknown = set(skip) - names
    if unknown:
        raise ValueError(f"clippable_parameters: no module named {sorted(unknown)} in the model")
    prefixes = tuple(f"{s}." for s in skip)
    return [p for name, p in model.named_parameters() if p.requires_grad and not name.startswith(prefixes)]


class AdaptiveClip:
    """Clip ``parameters`` before every ``optimizer.step()`` (a step pre-hook), keeping the share clipped.

    ``AdaptiveClip(opt, clippable_parameters(model), clipping=0.04)`` leaves the training loop untouched;
    ``shares`` holds one 0-dim tensor a step, ``remove()`` detaches the hook.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, parameters: Iterable[torch.Tensor],
                 clipping: float = 0.01, eps: float = EPS):
        self.parameters, self.clipping, self.eps = list(parameters), clipping, eps
        adaptive_clip_([], clipping, eps)  # checks the arguments now, not at the first step
        self.shares: list[torch.Tensor] = []
        self._handle = optimizer.register_step_pre_hook(self._hook)

    def _hook(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        self.shares.append(adaptive_clip_(self.parameters, self.clipping, self.eps))

    def mean_share(self) -> float:
        """The share of units clipped, averaged over the steps so far (0.0 before the first)."""
        return torch.stack(self.shares).mean().item() if self.shares else 0.0

    def remove(self) -> None:
        self._handle.remove()
