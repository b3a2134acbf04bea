"""Chapter 12's experiment: a mixture-of-experts layer with its experts over ranks, against one process.

    torchrun --nproc-per-node 4 -m course_lib.experiments.workers.ep_compare --layouts 4x1,2x2 --ks 1,2

For each layout ``e x d`` (expert-parallel groups of ``e`` consecutive ranks, ``d`` of them, e * d = world) and
each ``k``: the same ``MoEMLP`` in float64, every rank routing its own ``--tokens`` tokens at a capacity that drops
nothing, against the one-process layer on all the world's tokens (``ep_checks.run_layer``). ``--drop-factor`` adds a
run at a capacity that drops, ``--api`` one through torch's differentiable all-to-all (both where EP spans the whole
world, ``world x 1``). Rank 0 reports one ``EPReport``.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

import torch

from course_lib.experiments import launch
from course_lib.experiments.ep_checks import EPRun, expert_process_groups, run_layer
from course_lib.experiments.results import WorkerResult
from course_lib.moe import no_drop_factor


# ----- what one launch reports: the notebook and the tests rebuild it with EPReport.from_dict -----


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


def run_layouts(args: argparse.Namespace, rank: int, world: int, device: torch.device) -> EPReport:
    """Every layout of ``args.layouts`` and every k of ``args.ks``; the dropping and torch runs where EP spans the
    world."""
    torch.set_num_threads(1)
    report = EPReport(world=world, n_experts=args.experts, d_model=args.d_model, d_hidden=args.hidden)
    sizes = dict(experts=args.experts, d_model=args.d_model, hidden=args.hidden, tokens=args.tokens, seed=args.seed)
    for ep, dp in launch.layouts(args.layouts, world):
        groups = expert_process_groups(ep)
        for k in (int(v) for v in args.ks.split(",")):
            report.runs.append(run_layer(*groups, k, no_drop_factor(args.experts, k), "by_hand", **sizes))
            if args.drop_factor > 0 and dp == 1:
                report.runs.append(run_layer(*groups, k, args.drop_factor, "by_hand", **sizes))
        if args.api and dp == 1:
            report.runs.append(run_layer(*groups, 2, no_drop_factor(args.experts, 2), "torch", **sizes))
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
