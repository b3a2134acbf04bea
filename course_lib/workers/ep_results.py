"""What one launch of chapter 12's worker ``ep_compare`` reports (rebuilt with ``EPReport.from_dict``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from course_lib.distributed.results import WorkerResult
from course_lib.moe import no_drop_factor


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
