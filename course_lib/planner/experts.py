"""Expert parallelism in the planner: one rank's bytes for a mixture-of-experts layer on ``e x d`` ranks (chapter 12).

A mixture of experts (``moe.MoEMLP``) is not a stack of the course's transformer blocks, so it is not measured like
one: its per-rank bytes follow from formulas that chapter 12 checks on real ranks (``expert_parallel``). On ``world =
e x d`` ranks each rank holds the router whole and ``E/e`` experts; with Adam in fp32 every parameter costs 16
bytes (weights, gradients, two moments; chapter 01). Its transient bytes are the dispatch buffers (the rows it
sends and receives, and their gradients) and the experts' hidden activations for the rows it runs. Traffic per
layer and step: the two all-to-alls forward and backward, ``4 (e-1)/e k T_r h`` elements under even routing, and
the gradients' all-reduce: the router's over all ranks, the experts' over the ``d`` ranks that hold the same ones.
``plan_experts`` takes the smallest ``e`` whose prediction fits: every step up in ``e`` adds all-to-all traffic.
"""

from __future__ import annotations

from dataclasses import dataclass

from course_lib.parallel.collectives import ring_factor

STATE_BYTES = 16  # fp32 weights, gradients and Adam's two moments, per parameter


@dataclass
class ExpertLayout:
    """One rank's predicted bytes for an MoE layer on ``ep x dp`` ranks."""

    ep: int
    dp: int
    params: int                 # router + this rank's experts
    transient: float            # dispatch buffers and the experts' activations, forward and backward
    all_to_all: float           # bytes sent per layer and step (even routing)
    grad_sync: float            # bytes sent per step summing the gradients (ring all-reduce)

    @property
    def states(self) -> int:
        """Model states: STATE_BYTES per parameter."""
        return STATE_BYTES * self.params

    @property
    def peak(self) -> float:
        return self.states + self.transient

    @property
    def traffic(self) -> float:
        return self.all_to_all + self.grad_sync


def predict_experts(d_model: int, d_hidden: int, n_experts: int, tokens_per_rank: int, k: int, ep: int, world: int,
                    capacity_factor: float | None = None, elem_bytes: int = 4) -> ExpertLayout:
    """One rank's bytes on ``ep`` expert-parallel x ``world / ep`` data-parallel ranks (chapter 12's formulas)."""
    from course_lib.parallel.expert_parallel import moe_layer as expert_parallel  # chapter 12's module; imported here, where it is used

    if world % ep:
        raise ValueError(f"expert-parallel size {ep} does not divide the {world} ranks")
    dp = world // ep
    params = expert_parallel.params_per_rank(d_model, d_hidden, n_experts, ep)  # checks that e divides E
    rows = expert_parallel.dispatch_buffer_bytes(tokens_per_rank, d_model, k, capacity_factor, elem_bytes)
    # dispatch and combine buffers, sent and received, forward and their gradients backward: 4 row buffers, plus
    # the rows' hidden activations (d_hidden wide) the experts save
    transient = 4 * rows + rows / d_model * d_hidden * 2
    grad_sync = (ring_factor("all_reduce", world) * params["router"]
                 + ring_factor("all_reduce", dp) * params["experts"]) * elem_bytes
    return ExpertLayout(ep, dp, sum(params.values()), transient,
                        expert_parallel.bytes_per_layer(tokens_per_rank, d_model, k, ep, elem_bytes), grad_sync)


def plan_experts(d_model: int, d_hidden: int, n_experts: int, tokens_per_rank: int, k: int, world: int,
                 budget_bytes: float, capacity_factor: float | None = None,
                 elem_bytes: int = 4) -> tuple[ExpertLayout, list[ExpertLayout]]:
    """The smallest expert-parallel size whose predicted peak fits ``budget_bytes``, and every layout weighed.

    Sizes that divide both the experts and the ranks are tried; ``ValueError`` says what the smallest needs when
    none fits.
    """
    sizes = [e for e in range(1, world + 1) if world % e == 0 and n_experts % e == 0]
    layouts = [predict_experts(d_model, d_hidden, n_experts, tokens_per_rank, k, e, world, capacity_factor,
                               elem_bytes) for e in sizes]
    fits = [lay for lay in layouts if lay.peak <= budget_bytes]
    if not fits:
        small = min(layouts, key=lambda lay: lay.peak)
        raise ValueError(f"no expert-parallel layout of {world} ranks fits {budget_bytes / 2**20:.2f} MiB: the "
                         f"smallest, {small.ep} x {small.dp}, needs {small.peak / 2**20:.2f} MiB")
    return fits[0], layouts
