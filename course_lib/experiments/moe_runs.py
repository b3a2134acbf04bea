"""Chapter 12's training run of the mixture of experts: a teacher task, and the load with and without the
auxiliary loss. Not needed to learn the chapter: the layer it trains is ``course_lib.moe``.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
import torch.nn.functional as F

from course_lib.moe import MoEMLP, route


def teacher_task(seed: int, n_tokens: int, d_model: int, n_clusters: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens from ``n_clusters`` Gaussian clusters and the targets of a random teacher MLP (same seed, same data)."""
    g = torch.Generator().manual_seed(seed)  # on the CPU: the same data on every machine, moved by the caller
    centres = 2.0 * torch.randn(n_clusters, d_model, generator=g)  # host
    cluster = torch.randint(n_clusters, (n_tokens,), generator=g)  # host
    x = centres[cluster] + torch.randn(n_tokens, d_model, generator=g)  # host
    w1, w2 = torch.randn(d_model, 4 * d_model, generator=g), torch.randn(4 * d_model, d_model, generator=g)  # host
    y = torch.tanh(x @ w1 / math.sqrt(d_model)) @ w2 / math.sqrt(4 * d_model)
    return x, y


def imbalance(tokens_per_expert: torch.Tensor) -> float:
    """Most-loaded expert's choices over the mean: 1 is even, ``E`` is every choice at one expert."""
    t = tokens_per_expert.float()
    return (t.max() / t.mean()).item()


def balance_run(seed: int, aux_weight: float, n_experts: int = 8, k: int = 1, d_model: int = 16,
                n_tokens: int = 512, steps: int = 60, lr: float = 1e-2, capacity_factor: float = 1.25,
                factors: Sequence[float] = ()) -> dict:
    """Train a ``MoEMLP`` on ``teacher_task`` with Adam; the load before and after (chapter 12).

    Returns the imbalance (max / mean choices per expert) per step, the tokens
    per expert after training, the drop rate at ``capacity_factor`` (and, after
    training, at each of ``factors``) and the task loss, first and last.
    """
    torch.manual_seed(seed)
    x, y = teacher_task(seed, n_tokens, d_model)
    moe = MoEMLP(d_model, 2 * d_model, n_experts, k, capacity_factor)
    opt = torch.optim.Adam(moe.parameters(), lr=lr)
    loads, losses = [], []
    for _ in range(steps):
        task = F.mse_loss(moe(x), y)
        loads.append(imbalance(moe.routing.tokens_per_expert()))
        losses.append(task.item())
        opt.zero_grad()
        (task + aux_weight * moe.aux_loss).backward()
        opt.step()
    with torch.no_grad():
        logits = moe.router(x)
        moe(x)
    return {"imbalance": loads + [imbalance(moe.routing.tokens_per_expert())],
            "drop_vs_factor": {f: route(logits, k, f).drop_rate() for f in factors},
            "tokens_per_expert": moe.routing.tokens_per_expert().tolist(),
            "drop_rate": moe.routing.drop_rate(), "loss": [losses[0], losses[-1]]}
