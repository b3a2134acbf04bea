"""Expert parallelism: the experts of a mixture-of-experts layer spread over ranks (chapter 12).

``e`` ranks form an expert-parallel (EP) group; each holds ``E/e`` of the ``E`` experts and a copy of everything
else (the router here). Each rank routes its own tokens (``moe.route``); ``ExpertParallelMoE.forward`` then
1. exchanges the per-expert counts (an all-to-all: the splits are uneven, the router decides them),
2. **dispatches** the token rows to their experts' ranks (an all-to-all), 3. runs its experts on what arrived,
4. **combines**: the reverse all-to-all brings every output row home, where it is gated and summed per token as in
one process. The backward of an all-to-all is the all-to-all with the splits swapped (``_AllToAll``). Expert
gradients arrive complete; the replicated router's are partial sums, all-reduced as in data parallelism (with
EP x DP the experts' over their DP group only). The load-balancing loss is the group's (``group_load_balancing_loss``).
Bytes per rank, layer and all-to-all under even routing: ``(e-1)/e * k T_r * d_model * b``.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn

from course_lib.moe import MoEMLP, Routing, expert_batches, expert_counts, queue_lengths, route


class ExpertParallelMoE(nn.Module):
    """This rank's part of a ``MoEMLP`` on an EP group: the router copied, experts ``shard*E/e .. (shard+1)*E/e``.
    ``forward`` keeps ``routing`` and ``aux_loss`` (as ``MoEMLP`` does, but over the whole EP group's tokens:
    ``group_load_balancing_loss``). Each rank adds ``alpha * aux_loss`` to its loss; the router's gradients, summed
    over the ranks, are then the one-process layer's (averaged over ``e`` ranks instead, the aux term's would be
    ``1/e`` of it). ``a2a="torch"``: torch's differentiable all-to-all (``torch.distributed.nn``)."""

    def __init__(self, moe: MoEMLP, group: dist.ProcessGroup | None = None, a2a: str = "by_hand"):
        super().__init__()
        if a2a not in ("by_hand", "torch"):
            raise ValueError(f"a2a must be 'by_hand' (_AllToAll) or 'torch' (torch.distributed.nn), got {a2a!r}")
        self.group, self.a2a = group, a2a
        self.ep, self.shard = dist.get_world_size(group), dist.get_rank(group)
        self.per = experts_per_rank(moe.n_experts, self.ep)
        self.n_experts, self.k, self.capacity_factor = moe.n_experts, moe.k, moe.capacity_factor
        self.router = copy.deepcopy(moe.router)
        first = self.shard * self.per
        self.experts = nn.ModuleList(copy.deepcopy(moe.experts[i]) for i in range(first, first + self.per))
        self.routing: Routing | None = None
        self.aux_loss: torch.Tensor | None = None

    def _send(self, x: torch.Tensor, out_splits: list[int], in_splits: list[int]) -> torch.Tensor:
        if self.a2a == "torch":  # the real API: autograd built in
            from torch.distributed.nn.functional import all_to_all_single
            return all_to_all_single(x.new_empty((sum(out_splits), *x.shape[1:])), x.contiguous(),
                                     out_splits, in_splits, group=self.group)
        return _AllToAll.apply(x, out_splits, in_splits, self.group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])
        n = tokens.shape[0]
        r = self.routing = route(self.router(tokens), self.k, self.capacity_factor)
        self.aux_loss = group_load_balancing_loss(r.probs, r.expert[:, 0], self.group)
        gate = r.gate.t().reshape(-1)
        # 1. counts. The splits are host integers, read twice per layer on purpose: this rank's queues (one wait
        # for the device) and, after the counts' all-to-all, what the others send. Implementations with fixed
        # shapes pad every expert's slot to the capacity instead and read nothing (dispatch_buffer_bytes)
        lengths = queue_lengths(r)
        kept = [min(q, r.capacity) for q in lengths]  # rows this rank sends each expert
        a = torch.cat(expert_batches(r, lengths))  # kept choices sorted by expert, so by destination rank
        recv_counts = exchange_counts(torch.tensor(kept, device=tokens.device), self.ep, self.group)
        recv = recv_counts.tolist()  # (ep, E/e): rows from each rank for each local expert
        send_splits = [sum(kept[q * self.per:(q + 1) * self.per]) for q in range(self.ep)]
        recv_splits = [sum(row) for row in recv]
        # 2. dispatch: every kept choice's token row to its expert's rank; they arrive by source rank, then expert
        arrived = self._send(tokens[a % n], recv_splits, send_splits)
        # 3. the local experts, regrouped by expert: a stable sort keeps each expert's rows in source-rank order
        local = torch.arange(self.per, device=tokens.device).repeat(self.ep).repeat_interleave(
            recv_counts.reshape(-1), output_size=sum(recv_splits))
        perm = torch.argsort(local, stable=True)
        per_expert = [sum(col) for col in zip(*recv)]
        done = torch.cat([m(rows) for m, rows in zip(self.experts, arrived[perm].split(per_expert))])
        # 4. combine: the rows back home in send order (splits swapped), gated and summed per token
        home = self._send(done[torch.argsort(perm)], send_splits, recv_splits)
        out = torch.zeros_like(tokens).index_add(0, a % n, (home * gate[a, None]).to(tokens.dtype))
        return out.reshape(x.shape)


def experts_per_rank(n_experts: int, ep: int) -> int:
    """``E / e``; an error unless the EP group size divides the experts."""
    if ep < 1 or n_experts % ep:
        raise ValueError(f"an expert-parallel group of {ep} ranks cannot share {n_experts} experts evenly; "
                         f"use a group size that divides {n_experts}")
    return n_experts // ep


class _AllToAll(torch.autograd.Function):
    """Rows out by ``in_splits``, in by ``out_splits``; the backward sends the gradients back (splits swapped)."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return back, None, None, None


def exchange_counts(counts: torch.Tensor, ep: int, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Send each rank the counts of its experts; return ``(ep, E/e)``: row ``r`` = what rank ``r`` will send me."""
    per = experts_per_rank(counts.numel(), ep)
    received = torch.empty_like(counts)
    dist.all_to_all_single(received, counts, [per] * ep, [per] * ep, group=group)
    return received.view(ep, per)


def group_load_balancing_loss(probs: torch.Tensor, first_choice: torch.Tensor,
                              group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Switch's ``E * sum_i f_i P_i`` over the tokens of all of ``group``'s ranks; the gradient of this rank's.
    ``probs``: this rank's ``(T_r, E)`` router softmax; ``first_choice``: its ``(T_r,)`` first-choice expert ids. The
    value is ``moe.load_balancing_loss`` on all the group's tokens; the gradient reaches this rank's router through its
    own ``P_i`` sums only (``f_i`` carries none), and summed over the ranks is the one-process gradient."""
    n_experts = probs.shape[-1]
    # at least float32: in bf16 a count above 256 is no longer a whole number
    dtype = torch.promote_types(probs.dtype, torch.float32)
    mine = probs.to(dtype).sum(0)  # this rank's sum of each expert's probability
    stats = torch.cat([expert_counts(first_choice, n_experts).to(dtype), mine.detach(),
                       mine.new_full((1,), first_choice.numel())])
    # One all-reduce of detached numbers, not torch.distributed.nn's differentiable all_reduce: that one's backward
    # all-reduces the gradient as well, so every rank's router would get the gradient of all the group's tokens, and
    # after the router's gradient sync (a sum over ranks) e times the one-process gradient. Here the other ranks' sums
    # enter as constants: no collective in the backward. Cost: 2E + 1 numbers per forward, one latency-bound message.
    dist.all_reduce(stats, group=group)
    counts, sums, n = stats[:n_experts], stats[n_experts:2 * n_experts], stats[-1]
    f = counts / n  # no gradient
    # value: the group's sums exactly (mine - mine.detach() is 0); gradient: d/d(mine) only
    p = (sums + (mine - mine.detach())) / n
    return n_experts * (f * p).sum()


def params_per_rank(d_model: int, d_hidden: int, n_experts: int, ep: int) -> dict[str, int]:
    """Parameters one rank holds: the router whole, ``E/e`` experts of ``2 d h + h + d`` each."""
    expert = 2 * d_model * d_hidden + d_hidden + d_model
    return {"router": d_model * n_experts, "experts": experts_per_rank(n_experts, ep) * expert}


def bytes_per_layer(tokens: int, d_model: int, k: int, ep: int, elem_bytes: int = 4) -> float:
    """Bytes one rank sends per MoE layer (forward + backward) under even routing: ``4 (e-1)/e k T_r d b``."""
    return 4 * (ep - 1) / ep * k * tokens * d_model * elem_bytes


def dispatch_buffer_bytes(tokens: int, d_model: int, k: int, capacity_factor: float | None = None,
                          elem_bytes: int = 4) -> float:
    """Bytes of one dispatch buffer on a rank: ``k T_r d b`` rows of even routing, or with fixed shapes padded to the
    capacity, ``E C d b ~ capacity_factor k T_r d b``."""
    rows = k * tokens if capacity_factor is None else capacity_factor * k * tokens
    return rows * d_model * elem_bytes


def expert_dp_groups(world: int, ep: int) -> tuple[list[list[int]], list[list[int]]]:
    """EP x DP on ``world`` ranks: EP groups of consecutive ranks, DP groups of the ranks holding the same experts."""
    if ep < 1 or world % ep:
        raise ValueError(f"world size {world} is not a multiple of the expert-parallel size {ep}")
    ep_groups = [list(range(s, s + ep)) for s in range(0, world, ep)]
    dp_groups = [list(range(s, world, ep)) for s in range(ep)]
    return ep_groups, dp_groups
