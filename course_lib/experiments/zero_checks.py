"""ZeroOptimizer on two ranks, against single-process Adam and against ZeRO's formula (chapter 09).

``agreement.GuardedZeroOptimizer`` keeps the ranks in step where one of them skips a backward, raises, or clips;
the first three functions here run one such case each, the fourth counts what the plain ``ZeroOptimizer`` sends.
Each runs on a tiny float64 model (rounding too small to hide a wrong gradient) and returns what every rank saw
(``course_lib.experiments.workers.zero_faults`` reports them):

- ``skip_case``: stage 2 while rank 1 does less than rank 0 (``PLAN``); every
  rank must end with the parameters of single-process Adam on the mean of what
  the ranks computed (zeros for what rank 1 skipped);
- ``twice_case``: a gradient arrives twice on rank 1 only (a weight used inside
  a reentrant checkpoint and outside it): every rank raises, and a normal step
  afterwards still works;
- ``clip_case``: ``ZeroOptimizer.clip_grad_norm_`` under stages 1 and 2 against
  clipping the whole batch's gradient in one process, and torch's
  ``clip_grad_norm_`` on the model under stage 1, which must raise on every rank;
- ``count_case``: every collective a step of the plain ``ZeroOptimizer`` hands to ``torch.distributed``, stages 1
  and 2, and stage 2 under accumulation: ZeRO's reduce-scatter and all-gather, nothing else.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from course_lib.experiments.results import gather_per_rank, max_abs_diff
from course_lib.experiments.zero_meters import count_collectives
from course_lib.parallel.sharding.agreement import GuardedZeroOptimizer
from course_lib.parallel.sharding.zero import ZeroOptimizer

DTYPE = torch.float64
LR = 1e-2
# The micro-batches each rank runs in each step of ``skip_case``: "batch" (a real one), "frozen" (a loss that reaches
# no trainable parameter); an empty list: no backward at all.
PLAN = {0: [["batch", "batch"]] * 3, 1: [["batch"], ["frozen"], []]}


@dataclass
class SkipCase:
    max_diff: list[float]        # per rank: largest parameter difference from single-process Adam
    ranks_equal: bool            # every rank holds the same parameters
    control_calls: list[int]     # per rank: the flag all-reduces that kept the ranks in step


@dataclass
class TwiceCase:
    errors: list[str]            # per rank: the error it raised ("" if none)
    then_ok: bool                # a normal step afterwards gives equal parameters on every rank


@dataclass
class CountCase:
    """Per variant (``stage1``, ``stage2``, ``stage2_accum2``), per rank: what one step handed to torch.distributed."""

    ops: dict[str, list[dict[str, int]]]  # collectives by name
    sent: dict[str, list[float]]          # bytes this rank sent, ring formulas of the tensors handed over
    buckets: int
    flat_numel: int                       # elements of the flat buffer, padding included
    num_params: int                       # Ψ
    element_size: int


@dataclass
class ClipCase:
    max_diff: dict[str, float]   # "stage1"/"stage2": from single-process Adam with clip_grad_norm_
    norm_diff: dict[str, float]  # the returned norm against torch's on the whole batch
    clipped: bool                # the limit was below the norm (the clipping did something)
    misuse_errors: list[str]     # per rank: what stage 1 raised after clip_grad_norm_ on the model


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3)).to(DTYPE)


def _batch(step: int, rank: int, micro: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * step + 10 * rank + micro)
    return torch.randn(4, 6, dtype=DTYPE, generator=gen)  # host


def _loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).pow(2).mean()


def _ranks_equal(model: nn.Module) -> bool:
    """Every rank holds exactly the same parameters."""
    flats = gather_per_rank(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
    return all(torch.equal(flats[0], f) for f in flats)


def _single_process_adam(plan: dict[int, list[list[str]]], micro_batches: int,
                         max_norm: float | None = None) -> tuple[nn.Module, list[float]]:
    """Adam in one process on the mean over the ranks of what each rank's real micro-batches give (zeros for what
    a rank skipped), clipped to ``max_norm`` if given: the model, and the norm of each step's gradient."""
    ref = _model()
    opt = torch.optim.Adam(ref.parameters(), lr=LR)
    norms = []
    for step in range(len(plan[0])):
        opt.zero_grad()
        for r in plan:
            for micro, kind in enumerate(plan[r][step]):
                if kind == "batch":
                    (_loss(ref, _batch(step, r, micro)) / micro_batches / len(plan)).backward()
        if max_norm is not None:
            norms.append(torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm).item())
        opt.step()
    return ref, norms


def skip_case(rank: int, world: int) -> SkipCase:
    """Stage 2 while rank 1 skips micro-batches and backwards (``PLAN``): nobody waits, every rank equals Adam."""
    model = _model()
    opt = GuardedZeroOptimizer(model, torch.optim.Adam, 2, bucket_cap_mb=1e-4, lr=LR)  # a bucket per tensor or so
    for step, micros in enumerate(PLAN[rank]):
        opt.zero_grad()
        for micro, kind in enumerate(micros):
            x = _batch(step, rank, micro)
            if kind == "batch":
                (_loss(model, x) / 2).backward()
            else:  # autograd runs, but reaches no parameter: no hook fires on this rank
                x.requires_grad_(True)
                (x.pow(2).sum() / 2).backward()
        opt.step()
    ref, _ = _single_process_adam(PLAN, micro_batches=2)
    return SkipCase(max_diff=gather_per_rank(max_abs_diff(list(model.parameters()), list(ref.parameters()))),
                    ranks_equal=_ranks_equal(model), control_calls=gather_per_rank(opt.control_calls))


class _Tied(nn.Module):
    """One linear layer applied twice; on rank 1 the inner use runs under a reentrant checkpoint."""

    def __init__(self, reentrant: bool):
        super().__init__()
        torch.manual_seed(0)
        self.lin, self.reentrant = nn.Linear(4, 4).to(DTYPE), reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        inner = checkpoint(self.lin, x, use_reentrant=True) if self.reentrant else self.lin(x)
        return self.lin(inner)


def twice_case(rank: int, world: int) -> TwiceCase:
    """A gradient that arrives twice on rank 1 only: every rank raises, and the next step works."""
    model = _Tied(reentrant=rank == 1)
    opt = GuardedZeroOptimizer(model, torch.optim.Adam, 2, lr=LR)
    x = _batch(0, rank, 0)[:, :4].requires_grad_(True)
    opt.zero_grad()
    error = ""
    try:
        model(x).pow(2).mean().backward()
    except RuntimeError as exc:
        error = str(exc)
    model.reentrant = False  # a normal step afterwards: nobody is stuck, the state was reset
    opt.zero_grad()
    model(x.detach()).pow(2).mean().backward()
    opt.step()
    return TwiceCase(errors=gather_per_rank(error), then_ok=_ranks_equal(model))


def clip_case(rank: int, world: int, max_norm: float = 0.05) -> ClipCase:
    """Sharded clipping (stages 1 and 2) against one process's; torch's clipping on a stage-1 model must raise."""
    ref, ref_norms = _single_process_adam({r: [["batch"]] * 2 for r in range(world)}, 1, max_norm)
    max_diff, norm_diff = {}, {}
    for stage in (1, 2):
        model = _model()
        opt = GuardedZeroOptimizer(model, torch.optim.Adam, stage, bucket_cap_mb=1e-4, lr=LR)
        worst = 0.0
        for step in range(2):
            opt.zero_grad()
            _loss(model, _batch(step, rank, 0)).backward()
            worst = max(worst, abs(opt.clip_grad_norm_(max_norm).item() - ref_norms[step]))
            opt.step()
        max_diff[f"stage{stage}"] = max_abs_diff(list(model.parameters()), list(ref.parameters()))
        norm_diff[f"stage{stage}"] = worst
    model = _model()
    opt = GuardedZeroOptimizer(model, torch.optim.Adam, 1, lr=LR)
    opt.zero_grad()
    _loss(model, _batch(0, rank, 0)).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)  # the wrong way: this rank's own gradient
    misuse = ""
    try:
        opt.step()
    except RuntimeError as exc:
        misuse = str(exc)
    return ClipCase(max_diff=max_diff, norm_diff=norm_diff, clipped=min(ref_norms) > max_norm,
                    misuse_errors=gather_per_rank(misuse))


def count_case(rank: int, world: int) -> CountCase:
    """One step of the plain ``ZeroOptimizer`` per variant, every collective it hands to torch.distributed counted."""
    ops, sent = {}, {}
    for name, stage, micros in (("stage1", 1, 1), ("stage2", 2, 1), ("stage2_accum2", 2, 2)):
        model = _model()
        opt = ZeroOptimizer(model, torch.optim.Adam, stage, bucket_cap_mb=1e-4, lr=LR)  # a bucket per tensor or so
        for step in range(2):  # the second step is counted: Adam's state exists by then
            with count_collectives() as issued:
                opt.zero_grad()
                for micro in range(micros):
                    (_loss(model, _batch(step, rank, micro)) / micros).backward()
                opt.step()
        ops[name] = gather_per_rank(dict(collections.Counter(i.op for i in issued)))
        sent[name] = gather_per_rank(sum(i.sent or 0.0 for i in issued))
    return CountCase(ops=ops, sent=sent, buckets=len(opt.buckets), flat_numel=opt.layout.numel,
                     num_params=sum(p.numel() for p in model.parameters()), element_size=DTYPE.itemsize)
