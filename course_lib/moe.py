"""A mixture-of-experts MLP in one process, by hand (chapter 12).

A router (one linear layer, ``d_model -> E``) scores every token against ``E`` expert MLPs; each token goes
to its ``k`` best experts and their outputs are summed, weighted by the router's softmax ("gates"). Only ``k``
of the ``E`` MLPs run per token, so the parameters grow ``E``-fold and the compute per token does not
(Shazeer et al. 2017; GShard, Lepikhin et al. 2020; Switch Transformer, Fedus et al. 2021).

Each expert takes at most ``capacity = ceil(capacity_factor * k * T / E)`` tokens of a batch of ``T`` (Switch,
section 2.2): a fixed size, so the buffers that carry tokens to the experts have known shapes (chapter 12's
expert parallelism sends them to other ranks). Tokens past an expert's capacity are *dropped*: the layer
returns zero for that choice and the residual connection carries the token on. Choices are queued slot-major,
every token's first choice before any token's second (GShard), so an overflow drops second choices first.
The router alone would favour a few experts; the auxiliary loss (``load_balancing_loss``) pushes back.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Sequence

import torch
from torch import nn


def check_capacity_factor(capacity_factor: float) -> None:
    if not capacity_factor > 0:
        raise ValueError(f"capacity_factor must be > 0 (1.0: room for an even share of the tokens; larger "
                         f"drops fewer), got {capacity_factor!r}")


def expert_capacity(n_tokens: int, n_experts: int, capacity_factor: float, k: int = 1) -> int:
    """Tokens one expert accepts from a batch of ``n_tokens``: ``ceil(capacity_factor * k * n_tokens / n_experts)``."""
    check_capacity_factor(capacity_factor)
    if n_experts > n_tokens:
        raise ValueError(f"{n_experts} experts for {n_tokens} tokens: some expert could never get one; "
                         "use more tokens per batch (or fewer experts)")
    return math.ceil(capacity_factor * k * n_tokens / n_experts)


def no_drop_factor(n_experts: int, k: int) -> float:
    """The capacity factor at which one expert could take every token's choice: nothing is ever dropped."""
    return n_experts / k


def expert_counts(ids: torch.Tensor, n_experts: int) -> torch.Tensor:
    """Choices per expert among ``ids`` (``torch.bincount``'s numbers, on ``ids``' device).

    ``bincount`` sizes its output by the largest id, so on a GPU it waits for the
    device to read it; a scatter into ``n_experts`` zeros does not (an id out of
    range stops it with a device-side assert instead).
    """
    return torch.zeros(n_experts, dtype=torch.long, device=ids.device).scatter_add_(0, ids, torch.ones_like(ids))


def dispatch_indices(expert: torch.Tensor, n_experts: int,
                     capacity: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Queue the choices ``expert`` (``(T, k)`` expert ids) at their experts: ``(order, position, kept)``.

    Choice ``a = slot * T + token`` (slot-major: all first choices before any
    second). ``order``: the choices sorted by expert, in queue order (a stable
    sort keeps first choices, and earlier tokens, ahead); ``position[a]``: the
    place of choice ``a`` in its expert's queue (0, 1, ...); ``kept[a]``:
    ``position[a] < capacity``.
    """
    flat = expert.t().reshape(-1)
    # the ids are checked where reading them is free; on a GPU the check would wait for the device at every
    # call, and expert_counts' scatter stops on a bad id there
    if flat.device.type == "cpu" and flat.numel() and not (0 <= int(flat.min()) and int(flat.max()) < n_experts):
        raise ValueError(f"expert ids must lie in [0, {n_experts}), got {flat.min().item()}..{flat.max().item()}")
    order = torch.argsort(flat, stable=True)
    counts = expert_counts(flat, n_experts)
    starts = torch.cumsum(counts, 0) - counts  # where each expert's queue begins in ``order``
    position = torch.empty_like(flat)
    position[order] = torch.arange(flat.numel(), device=flat.device) - starts[flat[order]]
    return order, position, position < capacity


def load_balancing_loss(probs: torch.Tensor, first_choice: torch.Tensor) -> torch.Tensor:
    """Switch eq. 4 without its weight alpha: ``E * sum_i f_i * P_i`` (1 when tokens and probabilities are even).

    ``f_i``: the fraction of tokens whose first choice is expert ``i``; ``P_i``: the mean router probability of
    ``i``. The router alone favours a few experts (they train faster, so they score higher); this pushes back.
    GShard's ``l_aux`` (its Algorithm 1) is the *mean* over experts, ``(1/E) sum_i f_i P_i``: the same shape,
    ``E**2`` times smaller, so a weight alpha tuned for one does not carry over to the other.
    """
    n_experts = probs.shape[-1]
    f = expert_counts(first_choice, n_experts).to(probs.dtype) / first_choice.numel()  # no gradient
    p = probs.mean(0)  # the gradient flows through P_i only
    return n_experts * (f * p).sum()


@dataclass
class Routing:
    """One batch's routing: choices, gates, queues and what was dropped (``T`` tokens, ``k`` choices each)."""

    probs: torch.Tensor     # (T, E) router softmax
    expert: torch.Tensor    # (T, k) expert ids, best first
    gate: torch.Tensor      # (T, k) weights of the choices
    order: torch.Tensor     # (T k,) choices sorted by expert (see dispatch_indices)
    position: torch.Tensor  # (T k,) place in the expert's queue
    kept: torch.Tensor      # (T k,) position < capacity
    capacity: int

    @property
    def n_tokens(self) -> int:
        return self.expert.shape[0]

    def tokens_per_expert(self) -> torch.Tensor:
        """Choices each expert received, before the capacity cut."""
        return expert_counts(self.expert.t().reshape(-1), self.probs.shape[1])

    def drop_rate(self) -> float:
        """Fraction of the choices dropped at the capacity."""
        return 1.0 - self.kept.float().mean().item()


def route(logits: torch.Tensor, k: int, capacity_factor: float) -> Routing:
    """Top-``k`` routing of ``T`` tokens from the router's ``(T, E)`` logits.

    Gates: the chosen softmax probabilities, renormalised to sum to 1 when
    ``k > 1`` (GShard's top-2); with ``k = 1`` the probability itself (Switch),
    so that the router gets a gradient from the loss.
    """
    n_tokens, n_experts = logits.shape
    if not 1 <= k <= n_experts:
        raise ValueError(f"k must be between 1 and the number of experts {n_experts}, got {k}")
    capacity = expert_capacity(n_tokens, n_experts, capacity_factor, k)
    probs = logits.softmax(-1)
    gate, expert = probs.topk(k, dim=-1)
    if k > 1:
        gate = gate / gate.sum(-1, keepdim=True)
    order, position, kept = dispatch_indices(expert, n_experts, capacity)
    return Routing(probs, expert, gate, order, position, kept, capacity)


def expert_mlp(d_model: int, d_hidden: int) -> nn.Sequential:
    """One expert: the transformer's MLP (chapter 10's ``mlp``)."""
    return nn.Sequential(nn.Linear(d_model, d_hidden), nn.GELU(), nn.Linear(d_hidden, d_model))


class MoEMLP(nn.Module):
    """``E`` expert MLPs behind a top-``k`` router with a capacity; ``forward`` keeps ``routing`` and ``aux_loss``.

    Chapter 12 builds it by hand: each expert runs on a gathered batch of its
    own tokens (``x[token]``), and ``index_add`` scatters the gated outputs
    back (out of place, so autograd can differentiate it). Dropped choices add nothing.
    """

    def __init__(self, d_model: int, d_hidden: int, n_experts: int, k: int = 1, capacity_factor: float = 1.25):
        super().__init__()
        check_capacity_factor(capacity_factor)
        if not 1 <= k <= n_experts:
            raise ValueError(f"k must be between 1 and n_experts = {n_experts}, got {k}")
        self.k, self.capacity_factor, self.n_experts = k, capacity_factor, n_experts
        self.router = nn.Linear(d_model, n_experts, bias=False)
        self.experts = nn.ModuleList(expert_mlp(d_model, d_hidden) for _ in range(n_experts))
        self.routing: Routing | None = None
        self.aux_loss: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])
        r = route(self.router(tokens), self.k, self.capacity_factor)
        self.routing, self.aux_loss = r, load_balancing_loss(r.probs, r.expert[:, 0])
        return combine(tokens, r, list(self.experts), range(self.n_experts)).reshape(x.shape)


def queue_lengths(r: Routing) -> list[int]:
    """Host integers: the choices each expert received (its queue, before the capacity cut).

    The one wait for the device in a forward of the layer, on purpose: the
    experts' batch sizes must be known on the host to cut ``order`` into their
    batches (a GPU's kernels are launched with their shapes). It costs the time
    the work queued before it takes to finish, as ``.tolist()`` does anywhere.
    """
    return r.tokens_per_expert().tolist()


def expert_batches(r: Routing, lengths: Sequence[int]) -> list[torch.Tensor]:
    """Each expert's kept choices, in queue order: its slice of ``order``, cut at the capacity.

    ``order`` holds expert 0's queue, then expert 1's, ...; ``lengths``
    (``queue_lengths``) says where each one begins.
    """
    starts = itertools.accumulate(lengths, initial=0)
    return [r.order[s:s + min(n, r.capacity)] for s, n in zip(starts, lengths)]


def combine(tokens: torch.Tensor, r: Routing, experts: Sequence[nn.Module], ids: Sequence[int]) -> torch.Tensor:
    """Run experts ``ids`` (modules ``experts``) on their kept tokens; sum the gated outputs per token."""
    n = r.n_tokens
    out = torch.zeros_like(tokens)
    gate = r.gate.t().reshape(-1)  # slot-major, like the choices
    batches = expert_batches(r, queue_lengths(r))
    for module, e in zip(experts, ids):
        a = batches[e]  # expert e's kept choices, in queue order
        if a.numel():
            # in the tokens' dtype: under autocast an expert's output is bf16, and index_add takes one dtype
            out = out.index_add(0, a % n, (module(tokens[a % n]) * gate[a, None]).to(out.dtype))
    return out
