"""ZeroOptimizer when the ranks do not all do the same thing (chapter 09; tests/test_zero_faults.py).

    torchrun --nproc-per-node 2 -m course_lib.workers.zero_faults --pg-timeout 30

Three cases, in one launch, each on a tiny float64 model (rounding too small
to hide a wrong gradient):

- ``skip``: stage 2 while rank 1 does less than rank 0: one micro-batch of two,
  then a micro-batch that reaches no trainable parameter, then no backward at
  all. Rank 0 must not wait for ever, and every rank must end with the
  parameters of single-process Adam on the mean of what the ranks computed
  (zeros for what rank 1 skipped);
- ``twice``: a gradient arrives twice on rank 1 only (a weight used inside a
  reentrant checkpoint and outside it): every rank raises, and a normal step
  afterwards still works;
- ``clip``: stages 1 and 2 with ``clip_grad_norm_`` against single-process
  clipping of the whole batch's gradient, and ``torch.nn.utils.clip_grad_norm_``
  on the model under stage 1, which must raise on every rank.

The process-group timeout (``--pg-timeout``) turns a rank left waiting into an
error, so a regression fails the launch instead of hanging it.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from course_lib.distributed import launch
from course_lib.distributed.results import WorkerResult
from course_lib.distributed.zero import ZeroOptimizer
from course_lib.distributed.results import gather_per_rank

DTYPE = torch.float64
LR = 1e-2


@dataclass
class SkipCase(WorkerResult):
    max_diff: list[float]        # per rank: largest parameter difference from single-process Adam
    ranks_equal: bool            # every rank holds the same parameters
    control_calls: list[int]     # per rank: the flag all-reduces that kept the ranks in step


@dataclass
class TwiceCase(WorkerResult):
    errors: list[str]            # per rank: the error it raised ("" if none)
    then_ok: bool                # a normal step afterwards gives equal parameters on every rank


@dataclass
class ClipCase(WorkerResult):
    max_diff: dict[str, float]   # "stage1"/"stage2": from single-process Adam with clip_grad_norm_
    norm_diff: dict[str, float]  # the returned norm against torch's on the whole batch
    clipped: bool                # the limit was below the norm (the clipping did something)
    misuse_errors: list[str]     # per rank: what stage 1 raised after clip_grad_norm_ on the model


@dataclass
class FaultChecks(WorkerResult):
    skip: SkipCase | None = None
    twice: TwiceCase | None = None
    clip: ClipCase | None = None


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3)).to(DTYPE)


def _batch(step: int, rank: int, micro: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * step + 10 * rank + micro)
    return torch.randn(4, 6, dtype=DTYPE, generator=gen)  # host


def _loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).pow(2).mean()


def _flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _ranks_equal(model: nn.Module) -> bool:
    """Every rank holds exactly the same parameters."""
    flats = gather_per_rank(_flat(model))
    return all(torch.equal(flats[0], f) for f in flats)


# The micro-batches each rank runs in each step: "batch" (a real one), "frozen" (a loss that reaches no trainable
# parameter); an empty list: no backward at all.
PLAN = {0: [["batch", "batch"]] * 3, 1: [["batch"], ["frozen"], []]}


def skip_case(rank: int, world: int) -> SkipCase:
    model = _model()
    opt = ZeroOptimizer(model, torch.optim.Adam, 2, bucket_cap_mb=1e-4, lr=LR)  # a bucket per parameter or so
    ref = _model()
    ref_opt = torch.optim.Adam(ref.parameters(), lr=LR)
    for step in range(3):
        opt.zero_grad()
        for micro, kind in enumerate(PLAN[rank][step]):
            x = _batch(step, rank, micro)
            if kind == "batch":
                (_loss(model, x) / 2).backward()
            else:  # autograd runs, but reaches no parameter: no hook fires on this rank
                x.requires_grad_(True)
                (x.pow(2).sum() / 2).backward()
        opt.step()
        # the reference: Adam on the mean over the ranks of what each rank's micro-batches gave (zeros if none)
        ref_opt.zero_grad()
        for r in range(world):
            for micro, kind in enumerate(PLAN[r][step]):
                if kind == "batch":
                    (_loss(ref, _batch(step, r, micro)) / 2 / world).backward()
        ref_opt.step()
    diff = (_flat(model) - _flat(ref)).abs().max().item()
    return SkipCase(max_diff=gather_per_rank(diff), ranks_equal=_ranks_equal(model),
                    control_calls=gather_per_rank(opt.control_calls))


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
    model = _Tied(reentrant=rank == 1)
    opt = ZeroOptimizer(model, torch.optim.Adam, 2, lr=LR)
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


def clip_case(rank: int, world: int) -> ClipCase:
    max_norm = 0.05
    ref = _model()
    ref_opt = torch.optim.Adam(ref.parameters(), lr=LR)
    ref_norms = []
    for step in range(2):
        ref_opt.zero_grad()
        for r in range(world):
            (_loss(ref, _batch(step, r, 0)) / world).backward()
        ref_norms.append(torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm).item())
        ref_opt.step()
    max_diff, norm_diff = {}, {}
    for stage in (1, 2):
        model = _model()
        opt = ZeroOptimizer(model, torch.optim.Adam, stage, bucket_cap_mb=1e-4, lr=LR)
        worst = 0.0
        for step in range(2):
            opt.zero_grad()
            _loss(model, _batch(step, rank, 0)).backward()
            worst = max(worst, abs(opt.clip_grad_norm_(max_norm).item() - ref_norms[step]))
            opt.step()
        max_diff[f"stage{stage}"] = (_flat(model) - _flat(ref)).abs().max().item()
        norm_diff[f"stage{stage}"] = worst
    model = _model()
    opt = ZeroOptimizer(model, torch.optim.Adam, 1, lr=LR)
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


CASES = {"skip": skip_case, "twice": twice_case, "clip": clip_case}


def run_cases(a: argparse.Namespace, rank: int, world: int, device: torch.device) -> FaultChecks:
    if world != 2:
        raise ValueError(f"zero_faults runs on 2 ranks, got {world}")
    result = FaultChecks()
    for name in launch.pick(a.cases, tuple(CASES), "case"):
        setattr(result, name, CASES[name](rank, world))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="skip,twice,clip", help="comma-separated: skip, twice, clip")
    launch.serve(parser, run_cases)


if __name__ == "__main__":
    main()
