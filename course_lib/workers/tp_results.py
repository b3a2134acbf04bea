"""What one launch of chapter 10's worker ``tp_compare`` reports: dataclasses, sent as dicts and rebuilt here.

The worker reports a ``TPReport``; the notebook and the tests rebuild it with
``TPReport.from_dict`` and look runs up by method and size.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from course_lib.distributed.results import WorkerResult


@dataclass
class BlockResult:
    """One transformer block split over ``tp`` ranks (by hand or by the API), against the single-process block.

    Differences are the largest over ranks; bytes and calls are rank 0's, per
    block and micro-batch; ``saved_bytes`` is every rank's (forward of the block).
    """

    method: str                       # "tp", "sp", "sp_regather" (by hand), "api_tp", "api_sp", "api_sp_local"
    tp: int
    dtype: str
    out_diff: float
    input_grad_diff: float
    param_grad_diff: float
    sent_forward: dict[str, float]
    sent_backward: dict[str, float]
    calls_forward: dict[str, int]
    calls_backward: dict[str, int]
    saved_bytes: list[int]
    local_shapes: dict[str, list[int]]
    sync_bytes: float = 0.0           # SP by hand: the replicated gradients' all-reduce


@dataclass
class MeshResult:
    """A few Adam steps of the tiny transformer on a (dp, tp) mesh, against single-process Adam."""

    dp: int
    tp: int
    sequence_parallel: bool
    dtype: str
    losses: list[float]
    max_loss_diff: float
    max_param_diff: float
    held: list[dict[str, int]]          # per rank: params, grads, optimizer bytes
    saved_bytes: list[int]              # per rank: what the blocks save in one forward
    tp_sent_per_step: dict[str, float]  # rank 0, by collective: DTensor's (TP) collectives
    dp_sent_per_step: dict[str, float]  # rank 0, by collective: FSDP2's
    tp_calls_per_step: dict[str, float]
    step_s: float
    param_placements: dict[str, str] = field(default_factory=dict)
    partial_grads: int = 0              # gradients still partial sums before the optimizer (reduced once)
    lazy_optimizer_calls: dict[str, int] = field(default_factory=dict)  # collectives of a step on partial ones


@dataclass
class TPReport(WorkerResult):
    """Everything one launch of ``tp_compare`` measured."""

    world: int
    ops: dict
    blocks: list[BlockResult]
    meshes: list[MeshResult]
    ref_saved_bytes: dict[str, int]     # dtype -> what the single-process block saves
    num_params: int = 0

    def block(self, method: str, tp: int, dtype: str = "float64") -> BlockResult:
        """The block run of ``method`` at tensor-parallel size ``tp`` in ``dtype``."""
        for b in self.blocks:
            if (b.method, b.tp, b.dtype) == (method, tp, dtype):
                return b
        raise KeyError(f"no block run {method!r} at tp={tp} in {dtype}; have "
                       f"{sorted({(b.method, b.tp, b.dtype) for b in self.blocks})}")

    def mesh(self, dp: int, tp: int, dtype: str = "float32") -> MeshResult:
        """The training run on a ``dp`` x ``tp`` mesh in ``dtype``."""
        for m in self.meshes:
            if (m.dp, m.tp, m.dtype) == (dp, tp, dtype):
                return m
        raise KeyError(f"no mesh run {dp}x{tp} in {dtype}; have {[(m.dp, m.tp, m.dtype) for m in self.meshes]}")
