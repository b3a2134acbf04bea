"""Expert parallelism checked against one process (chapter 12): one mixture-of-experts layer on an ``ep x dp``
layout of the ranks.

``run_layer`` builds the same ``MoEMLP`` on every rank (same seed, float64), runs
this rank's tokens through its ``ExpertParallelMoE`` part and all the world's
tokens through the one-process layer (each rank computes it: it is small),
backpropagates ``sum(out * w)``, synchronises the gradients as training would
(the router's over the world, the experts' over their DP group) and returns an
``EPRun``: the differences, the bytes sent, the rows dispatched, the parameters held.
The bytes are counted from here (``counting.counted``), the layer untouched.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from course_lib.parallel.expert_parallel.moe_layer import ExpertParallelMoE, expert_dp_groups
from course_lib.experiments.counting import ByteCounter, counted
from course_lib.experiments.results import gather_per_rank, max_over_ranks
from course_lib.moe import MoEMLP, queue_lengths


@dataclass
class EPRun:
    """One MoE layer on an ``ep x dp`` layout of the ranks, against the one-process layer.

    Differences are the largest over ranks (float64); lists hold one entry per
    rank. ``sent`` is what each rank's all-to-alls sent to other ranks in one
    forward and backward; ``off_rank_rows``: ``[dispatched, received]`` rows
    that crossed ranks in the forward.
    """

    ep: int
    dp: int
    k: int
    a2a: str                      # "by_hand" (counted) or "torch" (torch.distributed.nn)
    capacity_factor: float
    tokens_per_rank: int
    row_bytes: int
    out_diff: float
    input_grad_diff: float
    router_grad_diff: float
    expert_grad_diff: float
    drop_rate: list[float]
    sent: list[float]
    sent_counts: list[float]
    off_rank_rows: list[list[int]]
    send_rows: list[int]
    recv_rows: list[int]
    capacity: list[int]
    params: list[dict[str, int]]
    grad_sync: list[dict[str, float]]  # per rank: bytes all-reduced for the router (world) and experts (dp group)
    aux_diff: float = float("nan")     # |EP layer's aux_loss - one process's| when EP spans the world (dp = 1)
    aux_sent: list[float] = field(default_factory=list)  # per rank: bytes of the aux loss's all-reduce (by hand)


def _diff(a: torch.Tensor | None, b: torch.Tensor | None) -> float:
    """Largest difference; a missing gradient (an expert no token reached) counts as zeros."""
    if a is None and b is None:
        return 0.0
    a, b = (torch.zeros_like(b) if a is None else a), (torch.zeros_like(a) if b is None else b)
    return (a - b).abs().max().item() if a.numel() else 0.0


def expert_process_groups(ep: int) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """This rank's EP and DP process groups of ``expert_dp_groups``; every rank makes every group, in the same order,
    as ``new_group`` requires."""
    ep_groups, dp_groups = expert_dp_groups(dist.get_world_size(), ep)
    made_ep, made_dp = [dist.new_group(g) for g in ep_groups], [dist.new_group(g) for g in dp_groups]
    return made_ep[dist.get_rank() // ep], made_dp[dist.get_rank() % ep]


def dispatch_splits(layer: ExpertParallelMoE, ep_group: dist.ProcessGroup) -> tuple[list[int], list[int]]:
    """The rows of the last forward's dispatch, per EP peer: ``(sent to each, received from each)``, from the routing
    of every rank of the group (gathered here, outside the layer and its counted collectives)."""
    r, per = layer.routing, layer.per
    kept = torch.tensor([min(q, r.capacity) for q in queue_lengths(r)], device=r.probs.device)  # rows sent each expert
    every = [torch.empty_like(kept) for _ in range(layer.ep)]
    dist.all_gather(every, kept, group=ep_group)
    send = [int(kept[q * per:(q + 1) * per].sum()) for q in range(layer.ep)]
    return send, [int(k[layer.shard * per:(layer.shard + 1) * per].sum()) for k in every]


def run_layer(ep_group: dist.ProcessGroup, dp_group: dist.ProcessGroup, k: int, capacity_factor: float,
              a2a: str = "by_hand", *, experts: int, d_model: int, hidden: int, tokens: int, seed: int = 0) -> EPRun:
    """The EP layer of ``experts`` experts on this rank's ``tokens`` tokens, against the one-process layer on all of
    them. ``ep_group``, ``dp_group``: this rank's (``expert_process_groups``)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    ep = dist.get_world_size(ep_group)
    dp = world // ep
    torch.manual_seed(seed)
    full = MoEMLP(d_model, hidden, experts, k, capacity_factor).double()
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(world * tokens, d_model, generator=gen, dtype=torch.float64)  # host: the reference
    w = torch.randn(world * tokens, d_model, generator=gen, dtype=torch.float64)  # host: the reference
    mine = slice(rank * tokens, (rank + 1) * tokens)

    counter = ByteCounter()
    layer = ExpertParallelMoE(full, ep_group, a2a)
    x_ref = x.clone().requires_grad_()
    ref_out = full(x_ref)
    (ref_out * w).sum().backward()
    ref_out = ref_out.detach()
    x_mine = x[mine].clone().requires_grad_()
    # torch's all-to-all (torch.distributed.nn) is not counted
    with counted(counter, ep_group, all_to_all=True) if a2a == "by_hand" else contextlib.nullcontext():
        out = layer(x_mine)
        (out * w[mine]).sum().backward()
    # gradient synchronisation: replicated router over the world, each expert over the ranks that hold it
    sync = ByteCounter()
    with counted(sync), counted(sync, dp_group):
        for p in layer.router.parameters():
            dist.all_reduce(p.grad)
        if dp > 1:
            for p in layer.experts.parameters():
                dist.all_reduce(p.grad, group=dp_group)

    first = layer.shard * layer.per
    expert_diff = max(_diff(p.grad, q.grad) for i, m in enumerate(layer.experts)
                      for p, q in zip(m.parameters(), full.experts[first + i].parameters()))
    r = layer.routing
    (send, recv), me = dispatch_splits(layer, ep_group), layer.shard
    off = [sum(send) - send[me], sum(recv) - recv[me]]  # rows that left this rank, rows that came from others
    return EPRun(
        ep=ep, dp=dp, k=k, a2a=a2a, capacity_factor=capacity_factor, tokens_per_rank=tokens,
        row_bytes=8 * d_model,  # float64
        out_diff=max_over_ranks(_diff(out.detach(), ref_out[mine])),
        input_grad_diff=max_over_ranks(_diff(x_mine.grad, x_ref.grad[mine])),
        router_grad_diff=max_over_ranks(_diff(layer.router.weight.grad, full.router.weight.grad)),
        expert_grad_diff=max_over_ranks(expert_diff),
        drop_rate=gather_per_rank(r.drop_rate()),
        sent=gather_per_rank(counter.by_op.get("all_to_all", 0.0)),
        sent_counts=gather_per_rank(counter.by_op.get("counts", 0.0)),
        off_rank_rows=gather_per_rank(off), send_rows=gather_per_rank(sum(send)), recv_rows=gather_per_rank(sum(recv)),
        capacity=gather_per_rank(r.capacity),
        params=gather_per_rank({"router": sum(p.numel() for p in layer.router.parameters()),
                                "experts": sum(p.numel() for p in layer.experts.parameters())}),
        grad_sync=gather_per_rank(dict(sync.by_op)),
        # the load-balancing loss over the EP group's tokens: all the world's when EP spans it (dp = 1)
        aux_diff=max_over_ranks(abs(float(layer.aux_loss) - float(full.aux_loss))) if dp == 1 else float("nan"),
        aux_sent=gather_per_rank(counter.by_op.get("all_reduce", 0.0)))
