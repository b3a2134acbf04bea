"""PipeDream's experiments in chapter 08: training against synchronous steps, and its bubble against the flush's.

``train_seed`` trains with ``pipeline.pipedream.run_pipedream`` on ``p`` ranks against one process taking the same
steps synchronously; ``timed_runs`` measures PipeDream's bubble against PipeDream-Flush's, every op padded (the
worker ``course_lib.experiments.workers.pipedream_run`` runs both).
"""

from __future__ import annotations

import argparse
import copy
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from course_lib.data import make_tokens
from course_lib.experiments.clock import CpuClock
from course_lib.experiments.pipeline_meter import Meter, StageRun, gather_step, metered_stage
from course_lib.experiments.pipeline_model import micro_batches, tiny_model, tokens
from course_lib.experiments.results import WorkerResult, gather_on_first
from course_lib.models import lm_loss
from course_lib.parallel.pipeline.executor import boundary_shapes, split_sequential
from course_lib.parallel.pipeline.pipedream import WeightStash, run_pipedream
from course_lib.parallel.pipeline.schedules import make_schedule


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


class CountedStash(WeightStash):
    """A ``WeightStash`` that records what it costs: copies and bytes stashed at once, and each update's versions."""

    def __init__(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer, stash: bool = True):
        super().__init__(module, optimizer, stash)
        self.peak_copies = self.peak_bytes = 0
        self.used: list[tuple[int, int, int]] = []   # (micro-batch, forward version, update version)

    def weights(self, i: int) -> dict[str, torch.Tensor] | None:
        copy = super().weights(i)
        if copy is not None:
            self.peak_copies = max(self.peak_copies, len(self.copies))
            self.peak_bytes = max(self.peak_bytes, sum(t.nbytes for _, c in self.copies.values() for t in c.values()))
        return copy

    def apply(self, i: int) -> int:
        version = super().apply(i)
        self.used.append((i, version, self.version - 1))
        return version


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
    stash = CountedStash(stage, torch.optim.Adam(stage.parameters(), lr=a.lr))
    dist.barrier()
    losses = run_pipedream(stage, stash, rank, world, n, shape, inputs=xs, targets=ys, loss_fn=lm_loss)
    got = gather_on_first({"losses": losses, "used": stash.used, "peak_copies": stash.peak_copies,
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
            meter = Meter(clock, pad, modules=[stage])
            losses = run_pipedream(stage, WeightStash(stage, opt), rank, world, n, shape, inputs=xs, targets=ys,
                                   loss_fn=lm_loss, watch=meter)
            runs.append(meter.result(rank, [], losses))
        else:
            for k in range(0, n, flush_m):          # one synchronous step per flush_m micro-batches: a flush each
                runs.append(metered_stage(stage, make_schedule("1f1b", world, flush_m), rank, shape,
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
