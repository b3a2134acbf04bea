"""PipeDream: asynchronous 1F1B with weight stashing (chapter 08; Narayanan et al., SOSP 2019).

PipeDream never flushes the pipe: each stage runs 1F1B over an endless stream
of micro-batches and updates its weights after *every* backward. The bubble of
a flush is gone (only the first fill and the last drain remain), but a
micro-batch's forward and backward now happen at different weight versions:
stage ``s`` runs ``F(j + p - s - 1)`` right before ``B(j)``, so between a
micro-batch's forward and its backward it applies ``p - s - 1`` updates.

- Without stashing the backward would use the newer weights with activations
  computed by the older ones: a gradient of no function at all (autograd
  refuses: the saved weights were changed in place).
- **Weight stashing** keeps, for every micro-batch in flight, the weights its
  forward used, and runs its backward on them; *within the stage* the
  gradient is then the true gradient at that version, applied to the newest
  weights. It is ``p - s - 1`` updates stale on stage ``s``, and stage ``s``
  keeps ``p - s`` versions (one per micro-batch in flight). Across stages it
  is not one model's gradient: the incoming ``dY`` was computed downstream at
  those stages' own versions for the micro-batch (one more update per stage
  further down). PipeDream's optional vertical sync, which makes every stage
  use one version per micro-batch, is left out here, as in the paper's main
  results.

``versions`` reads the weight versions off a schedule; ``WeightStash`` is what
one rank keeps (``pipeline_exec.run_stage`` calls it). On ``p`` ranks,
``train_seed`` trains with it against synchronous steps, and ``timed_runs``
measures PipeDream's bubble against PipeDream-Flush's (the worker
``course_lib.experiments.workers.pipedream_run`` runs both).
"""

from __future__ import annotations

import argparse
import copy
from dataclasses import dataclass, field
from typing import Sequence

import torch
import torch.distributed as dist
from torch import nn

from course_lib.data import make_tokens
from course_lib.experiments.clock import CpuClock
from course_lib.parallel.pipeline.schedules import Op, make_schedule, one_f_one_b_order
from course_lib.parallel.pipeline.executor import (StageRun, boundary_shapes, gather_step, micro_batches, run_stage,
                                                  split_sequential)
from course_lib.experiments.pipeline_model import tiny_model, tokens
from course_lib.experiments.results import WorkerResult, gather_on_first
from course_lib.models import lm_loss


@dataclass
class Versions:
    """The weight versions one PipeDream stage uses (version k: after k updates)."""

    forward: dict[int, int]           # micro-batch -> version its forward used
    backward: dict[int, int]          # micro-batch -> version current when its backward ran
    held: list[list[int]]             # after each op: the versions stashed (one per micro-batch in flight)

    @property
    def staleness(self) -> int:
        """Most updates between a micro-batch's forward and the update its gradient makes."""
        return max(self.backward[i] - self.forward[i] for i in self.forward)

    @property
    def peak_stashed(self) -> int:
        return max(len(h) for h in self.held)


def versions(order: Sequence[Op]) -> Versions:
    """Play one stage's order with an update after every ``B``: which version each op uses and keeps."""
    version, fwd, bwd, alive, held = 0, {}, {}, {}, []
    for op, i, *_ in order:
        if op == "F":
            fwd[i] = alive[i] = version          # stash the weights this forward used
        elif op == "B":
            bwd[i] = version
            alive.pop(i)                         # its backward ran on them: drop the copy
            version += 1                         # and its gradient makes the next version
        held.append(sorted(alive.values()))
    return Versions(fwd, bwd, held)


def async_order(num_stages: int, num_microbatches: int, stage: int) -> list[Op]:
    """PipeDream's order on stage ``s``: 1F1B over the whole stream, with no flush between batches."""
    return one_f_one_b_order(num_stages, num_microbatches, stage)


def stash_formula(num_stages: int, stage: int) -> int:
    """Versions stage ``s`` of ``p`` keeps in steady state: ``p - s`` (Narayanan et al. 2019, section 3.3)."""
    return num_stages - stage


@dataclass
class WeightStash:
    """One rank's stash: a copy of the weights for every micro-batch in flight (what it costs: that many copies).

    ``weights(i)`` makes micro-batch ``i``'s copy of the live weights before its
    forward; ``apply(i)`` moves the gradient computed on that copy to the live
    weights, steps the optimizer and drops the copy. ``stash=False`` runs the
    forward on the live weights themselves (no copy): the next in-place update
    then breaks micro-batch ``i``'s backward.
    """

    module: nn.Module
    optimizer: torch.optim.Optimizer
    stash: bool = True
    version: int = 0
    copies: dict[int, tuple[int, dict[str, torch.Tensor]]] = field(default_factory=dict)
    peak_copies: int = 0
    peak_bytes: int = 0
    used: list[tuple[int, int, int]] = field(default_factory=list)  # (micro-batch, forward version, update version)

    def weights(self, i: int) -> dict[str, torch.Tensor] | None:
        if not self.stash:
            self.copies[i] = (self.version, {})
            return None
        copy = {n: p.detach().clone().requires_grad_(p.requires_grad) for n, p in self.module.named_parameters()}
        self.copies[i] = (self.version, copy)
        self.peak_copies = max(self.peak_copies, len(self.copies))
        self.peak_bytes = max(self.peak_bytes, sum(t.nbytes for _, c in self.copies.values() for t in c.values()))
        return copy

    def apply(self, i: int) -> None:
        version, copy = self.copies.pop(i)
        for name, p in self.module.named_parameters():
            if copy:
                p.grad = copy[name].grad                  # the gradient at the stashed version ...
        self.optimizer.step()                             # ... applied to the newest weights
        self.optimizer.zero_grad(set_to_none=True)
        self.used.append((i, version, self.version))
        self.version += 1


@dataclass
class SeedRun(WorkerResult):
    """One seed: PipeDream against synchronous steps on the same micro-batches."""

    seed: int
    async_losses: list[float]              # training loss of each micro-batch, as the last stage saw it
    sync_losses: list[float]
    async_eval: float                      # held-out loss after the n steps
    sync_eval: float
    used: list[list[tuple[int, int, int]]]  # per stage: (micro-batch, version its forward used, version it updated)
    peak_copies: list[int]                 # per stage: weight copies stashed at once
    peak_stash_bytes: list[int]
    stage_param_bytes: list[int]


@dataclass
class TimedRun(WorkerResult):
    """The same n micro-batches, ops padded: PipeDream or PipeDream-Flush."""

    kind: str                              # "async" or "flush"
    makespan_s: float
    bubble_measured: float
    peak_inflight: list[int]               # per stage: micro-batch graphs kept at once
    sent_messages: int                     # all ranks' point-to-point messages
    overruns: int                          # ops whose work took longer than their padded time
    timings: list[tuple[int, str, int, float, float]] = field(default_factory=list)


def _stage(a: argparse.Namespace, n: int, seed: int, rank: int, world: int) -> tuple:
    """This rank's stage of the seeded model, its input's shape, ``n`` micro-batches (xs, ys), the model, its stages."""
    model = tiny_model(a, world, seed)
    x, y = tokens(a, n, seed)
    xs, ys = micro_batches(x, n), micro_batches(y, n)
    pieces = split_sequential(model.as_sequential(), world)
    return pieces[rank], boundary_shapes(pieces, xs[0])[rank], xs, ys, model, pieces


def train_seed(a: argparse.Namespace, n: int, seed: int, rank: int, world: int) -> SeedRun | None:
    """PipeDream on the ranks and (rank 0) synchronous Adam steps, ``n`` micro-batches each, then both evaluated
    on a held-out batch; rank 0 returns them, the others ``None``. ``a``: ``pipeline_model.add_model_args``'s
    options and ``lr``."""
    stage, shape, xs, ys, model, pieces = _stage(a, n, seed, rank, world)
    reference = copy.deepcopy(model)
    x_eval, y_eval = make_tokens(64, a.seq_len, vocab=a.vocab, seed=10_000 + seed)
    stash = WeightStash(stage, torch.optim.Adam(stage.parameters(), lr=a.lr))
    dist.barrier()
    run = run_stage(stage, [async_order(world, n, s) for s in range(world)], rank, shape, inputs=xs, targets=ys,
                    loss_fn=lm_loss, clock=CpuClock(), weights=stash.weights, after_backward=stash.apply)
    got = gather_on_first({"losses": run.losses, "used": stash.used, "peak_copies": stash.peak_copies,
                           "peak_bytes": stash.peak_bytes, "param_bytes": sum(p.nbytes for p in stage.parameters()),
                           "state": stage.state_dict()})
    if rank != 0:
        return None
    for piece, g in zip(pieces, got):              # the trained stages, back in one model
        piece.load_state_dict(g["state"])
    opt = torch.optim.Adam(reference.parameters(), lr=a.lr)
    sync_losses = []
    for xi, yi in zip(xs, ys):                     # the same steps, each on fresh weights
        loss = lm_loss(reference(xi), yi)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sync_losses.append(loss.item())
    with torch.no_grad():
        async_eval, sync_eval = lm_loss(model(x_eval), y_eval).item(), lm_loss(reference(x_eval), y_eval).item()
    return SeedRun(seed, got[-1]["losses"], sync_losses, async_eval, sync_eval, used=[g["used"] for g in got],
                   peak_copies=[g["peak_copies"] for g in got], peak_stash_bytes=[g["peak_bytes"] for g in got],
                   stage_param_bytes=[g["param_bytes"] for g in got])


def timed_runs(a: argparse.Namespace, n: int, flush_m: int, seed: int, rank: int, world: int,
               padded: bool = True) -> list[TimedRun] | None:
    """PipeDream and PipeDream-Flush (one step per ``flush_m``) over the same ``n`` micro-batches, every op padded
    to a fixed time (``padded``; unpadded, a warm-up: the same first calls and messages without the sleeps)."""
    pad = {"F": a.t_forward_ms / 1e3, "B": a.t_backward_ms / 1e3} if padded else None
    clock, out = CpuClock(), []
    for kind in ("async", "flush"):
        stage, shape, xs, ys, *_ = _stage(a, n, seed, rank, world)
        opt = torch.optim.Adam(stage.parameters(), lr=a.lr)
        runs: list[StageRun] = []
        dist.barrier()                             # start together, so idle time is the schedule's
        if kind == "async":
            stash = WeightStash(stage, opt)
            runs.append(run_stage(stage, [async_order(world, n, s) for s in range(world)], rank, shape, inputs=xs,
                                  targets=ys, loss_fn=lm_loss, op_seconds=pad, clock=clock, weights=stash.weights,
                                  after_backward=stash.apply))
        else:
            for k in range(0, n, flush_m):          # one synchronous step per flush_m micro-batches: a flush each
                runs.append(run_stage(stage, make_schedule("1f1b", world, flush_m), rank, shape,
                                      inputs=xs[k:k + flush_m], targets=ys[k:k + flush_m], loss_fn=lm_loss,
                                      op_seconds=pad, clock=clock))
                opt.step()
                opt.zero_grad(set_to_none=True)
        # one run of the n micro-batches, however many flushes it took
        busy = [(op, i + k * flush_m, b, e) for k, r in enumerate(runs) for op, i, b, e in r.busy]
        step = gather_step(StageRun(rank, runs[0].start, runs[-1].end, busy,
                                    peak_inflight=max(r.peak_inflight for r in runs),
                                    sent_messages=sum(r.sent_messages for r in runs),
                                    overruns=sum(r.overruns for r in runs)))
        if step is not None:
            out.append(TimedRun(kind, step.makespan_s, step.bubble, step.each("peak_inflight"),
                                step.total("sent_messages"), step.total("overruns"), step.timings))
    return out if rank == 0 else None
