"""Chapter 12's experiment: a mixture-of-experts layer with its experts over ranks, against one process.

    torchrun --nproc-per-node 4 -m course_lib.workers.ep_compare --layouts 4x1,2x2 --ks 1,2

For each layout ``e x d`` (expert-parallel groups of ``e`` consecutive ranks,
``d`` of them, e * d = world) and each ``k``: the same ``MoEMLP`` (same seed)
in float64, every rank routing its own ``--tokens`` tokens, at a capacity
that drops nothing; the loss ``sum(out * w)`` backpropagated; the router's
gradients all-reduced over the world, the experts' over their DP group; then
outputs, input gradients and parameter gradients against the one-process layer
on all the world's tokens (each rank computes it: it is small). Also: the bytes
each rank's all-to-alls sent, the dispatch buffers' rows, the parameters held;
``--drop-factor`` adds a run at a capacity that drops (rows and drop rate);
``--api`` one run through torch's differentiable all-to-all (both on the
layouts with EP over the whole world, ``world x 1``).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from course_lib.distributed import comm, launch
from course_lib.distributed.comm import ByteCounter
from course_lib.distributed.expert_parallel import ExpertParallelMoE, expert_dp_groups
from course_lib.distributed.results import WorkerResult, gather_per_rank, max_over_ranks
from course_lib.moe import MoEMLP, no_drop_factor


# ----- what one launch reports: the notebook and the tests rebuild it with EPReport.from_dict -----


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


@dataclass
class EPReport(WorkerResult):
    world: int
    n_experts: int
    d_model: int
    d_hidden: int
    runs: list[EPRun] = field(default_factory=list)

    def run(self, ep: int, dp: int, k: int, a2a: str = "by_hand", dropping: bool = False) -> EPRun:
        """The run of that layout, ``k`` and all-to-all; ``dropping``: the one at a capacity that drops."""
        for r in self.runs:
            drops = r.capacity_factor < no_drop_factor(self.n_experts, k)
            if (r.ep, r.dp, r.k, r.a2a) == (ep, dp, k, a2a) and drops == dropping:
                return r
        raise KeyError(f"no run ep={ep} dp={dp} k={k} a2a={a2a} dropping={dropping}; the launch ran "
                       f"{[(r.ep, r.dp, r.k, r.a2a, r.capacity_factor) for r in self.runs]}")


def _diff(a: torch.Tensor | None, b: torch.Tensor | None) -> float:
    """Largest difference; a missing gradient (an expert no token reached) counts as zeros."""
    if a is None and b is None:
        return 0.0
    a, b = (torch.zeros_like(b) if a is None else a), (torch.zeros_like(a) if b is None else b)
    return (a - b).abs().max().item() if a.numel() else 0.0


def one_run(args: argparse.Namespace, ep: int, k: int, capacity_factor: float, a2a: str,
            groups: dict) -> EPRun:
    """One layout, one k: the EP layer on this rank's tokens against the one-process layer on all of them."""
    rank, world = dist.get_rank(), dist.get_world_size()
    dp = world // ep
    torch.manual_seed(args.seed)
    full = MoEMLP(args.d_model, args.hidden, args.experts, k, capacity_factor).double()
    gen = torch.Generator().manual_seed(args.seed + 1)
    x = torch.randn(world * args.tokens, args.d_model, generator=gen, dtype=torch.float64)  # host: the reference
    w = torch.randn(world * args.tokens, args.d_model, generator=gen, dtype=torch.float64)  # host: the reference
    mine = slice(rank * args.tokens, (rank + 1) * args.tokens)

    counter = ByteCounter()
    layer = ExpertParallelMoE(full, groups["ep"], counter if a2a == "by_hand" else None, a2a)
    x_ref = x.clone().requires_grad_()
    ref_out = full(x_ref)
    (ref_out * w).sum().backward()
    ref_out = ref_out.detach()
    x_mine = x[mine].clone().requires_grad_()
    out = layer(x_mine)
    (out * w[mine]).sum().backward()
    # gradient synchronisation: replicated router over the world, each expert over the ranks that hold it
    sync = ByteCounter()
    for p in layer.router.parameters():
        comm.all_reduce(p.grad, counter=sync)
    if dp > 1:
        for p in layer.experts.parameters():
            comm.all_reduce(p.grad, counter=sync, group=groups["dp"])
    sync_bytes = dict(sync.by_op)

    first = layer.shard * layer.per
    expert_diff = max(_diff(p.grad, q.grad) for i, m in enumerate(layer.experts)
                      for p, q in zip(m.parameters(), full.experts[first + i].parameters()))
    r = layer.routing
    send, recv, me = layer.send_splits, layer.recv_splits, layer.shard
    off = [sum(send) - send[me], sum(recv) - recv[me]]  # rows that left this rank, rows that came from others
    return EPRun(
        ep=ep, dp=dp, k=k, a2a=a2a, capacity_factor=capacity_factor, tokens_per_rank=args.tokens,
        row_bytes=8 * args.d_model,  # float64
        out_diff=max_over_ranks(_diff(out.detach(), ref_out[mine])),
        input_grad_diff=max_over_ranks(_diff(x_mine.grad, x_ref.grad[mine])),
        router_grad_diff=max_over_ranks(_diff(layer.router.weight.grad, full.router.weight.grad)),
        expert_grad_diff=max_over_ranks(expert_diff),
        drop_rate=gather_per_rank(r.drop_rate()),
        sent=gather_per_rank(counter.by_op.get("all_to_all", 0.0)),
        sent_counts=gather_per_rank(counter.by_op.get("counts", 0.0)),
        off_rank_rows=gather_per_rank(off), send_rows=gather_per_rank(sum(send)),
        recv_rows=gather_per_rank(sum(recv)),
        capacity=gather_per_rank(r.capacity),
        params=gather_per_rank({"router": sum(p.numel() for p in layer.router.parameters()),
                        "experts": sum(p.numel() for p in layer.experts.parameters())}),
        grad_sync=gather_per_rank(sync_bytes),
        # the load-balancing loss over the EP group's tokens: all the world's when EP spans it (dp = 1)
        aux_diff=max_over_ranks(abs(float(layer.aux_loss) - float(full.aux_loss))) if dp == 1 else float("nan"),
        aux_sent=gather_per_rank(counter.by_op.get("all_reduce", 0.0)))


def run_layouts(args: argparse.Namespace, rank: int, world: int, device: torch.device) -> EPReport:
    """Every layout of ``args.layouts`` and every k of ``args.ks``; the dropping and torch runs where EP spans the world."""
    torch.set_num_threads(1)
    layouts = [tuple(int(v) for v in s.split("x")) for s in args.layouts.split(",") if s] or [(world, 1)]
    report = EPReport(world=world, n_experts=args.experts, d_model=args.d_model, d_hidden=args.hidden)
    for ep, dp in layouts:
        if ep * dp != world:
            raise ValueError(f"layout {ep}x{dp} needs {ep * dp} ranks, the launch has {world}")
        ep_groups, dp_groups = expert_dp_groups(world, ep)
        # every rank creates every group, in the same order (new_group is collective)
        made = {"ep": [dist.new_group(g) for g in ep_groups], "dp": [dist.new_group(g) for g in dp_groups]}
        groups = {"ep": made["ep"][rank // ep], "dp": made["dp"][rank % ep]}
        for k in (int(v) for v in args.ks.split(",")):
            report.runs.append(one_run(args, ep, k, no_drop_factor(args.experts, k), "by_hand", groups))
            if args.drop_factor > 0 and dp == 1:
                report.runs.append(one_run(args, ep, k, args.drop_factor, "by_hand", groups))
        if args.api and dp == 1:
            report.runs.append(one_run(args, ep, 2, no_drop_factor(args.experts, 2), "torch", groups))
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--layouts", default="", help="comma-separated e x d, e.g. 4x1,2x2 (default: world x 1)")
    parser.add_argument("--ks", default="1,2")
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--d-model", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=32, help="tokens per rank")
    parser.add_argument("--drop-factor", type=float, default=0.0, help="also a run at this capacity factor")
    parser.add_argument("--api", action="store_true", help="also one run through torch's all_to_all_single")
    parser.add_argument("--seed", type=int, default=0)
    launch.serve(parser, run_layouts)


if __name__ == "__main__":
    main()
