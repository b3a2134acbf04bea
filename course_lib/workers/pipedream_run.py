"""PipeDream (asynchronous 1F1B with weight stashing) on ``p`` gloo ranks, against synchronous training (chapter 08).

    torchrun --nproc-per-node 4 -m course_lib.workers.pipedream_run --microbatches 32 --flush-m 8 --seeds 0,1,2

For each seed the ranks train a ``TinyTransformer`` cut into ``p`` stages on
a stream of micro-batches (``--train-microbatches``) with PipeDream: 1F1B with no flush, every
stage stepping its optimizer after each backward, on gradients computed with
the weights it stashed for that micro-batch (``pipedream.WeightStash``). Rank 0
also trains the whole model on the same micro-batches with one synchronous
step each (what PipeDream would compute without staleness), and both are
evaluated on a held-out batch. Then, with every op padded to a fixed time,
the ranks run PipeDream over the ``n`` micro-batches once more, and
PipeDream-Flush (1F1B, one step every ``m`` micro-batches) over the same
``n``: their measured bubbles and makespans. Rank 0 reports a ``PipeDreamResult``.
The ranks always run on the CPU (gloo): on a GPU the point would be the same.
"""

from __future__ import annotations

import argparse
import copy
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from course_lib.data import make_tokens
from course_lib.distributed import launch
from course_lib.distributed.clock import CpuClock
from course_lib.distributed.pipedream import WeightStash, async_order
from course_lib.distributed.pipeline import make_schedule
from course_lib.distributed.pipeline_exec import (StageRun, boundary_shapes, micro_batches, run_stage, split_sequential,
                                                  timeline)
from course_lib.distributed.results import WorkerResult, gather_on_first
from course_lib.models import lm_loss
from course_lib.workers.pipeline_freeze_run import tiny_model


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


@dataclass
class PipeDreamResult(WorkerResult):
    world: int
    n: int                                 # micro-batches of the timed runs (= optimizer steps of PipeDream)
    flush_m: int                           # micro-batches per step of PipeDream-Flush
    seeds: list[SeedRun] = field(default_factory=list)
    timed: list[TimedRun] = field(default_factory=list)


def train_seed(a: argparse.Namespace, seed: int, rank: int, world: int) -> SeedRun | None:
    """PipeDream on the ranks and (rank 0) synchronous steps, ``n`` micro-batches each."""
    model = tiny_model(a, world, seed)
    reference = copy.deepcopy(model)
    n = a.train_microbatches or a.microbatches
    x, y = make_tokens(n * a.microbatch_size, a.seq_len, vocab=a.vocab, seed=seed)
    x_eval, y_eval = make_tokens(64, a.seq_len, vocab=a.vocab, seed=10_000 + seed)
    xs, ys = micro_batches(x, n), micro_batches(y, n)
    pieces = split_sequential(model.as_sequential(), world)
    stage = pieces[rank]
    stash = WeightStash(stage, torch.optim.Adam(stage.parameters(), lr=a.lr))
    schedule = [async_order(world, n, s) for s in range(world)]
    dist.barrier()
    run = run_stage(stage, schedule, rank, boundary_shapes(pieces, xs[0])[rank], inputs=xs if rank == 0 else None,
                    targets=ys if rank == world - 1 else None, loss_fn=lm_loss, clock=CpuClock(),
                    weights=stash.weights, after_backward=stash.apply)
    mine = {"losses": run.losses, "used": stash.used, "peak_copies": stash.peak_copies,
            "peak_bytes": stash.peak_bytes, "param_bytes": sum(p.nbytes for p in stage.parameters()),
            "state": stage.state_dict()}
    got = gather_on_first(mine)
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


def timed_runs(a: argparse.Namespace, rank: int, world: int, padded: bool = True) -> list[TimedRun] | None:
    """PipeDream and PipeDream-Flush over the same n micro-batches, every op padded to a fixed time (``padded``;
    unpadded, a warm-up: the same first calls and messages without the sleeps)."""
    pad = {"F": a.t_forward_ms / 1e3, "B": a.t_backward_ms / 1e3} if padded else None
    clock, out = CpuClock(), []
    for kind in ("async", "flush"):
        model = tiny_model(a, world, a.seeds[0])
        x, y = make_tokens(a.microbatches * a.microbatch_size, a.seq_len, vocab=a.vocab, seed=a.seeds[0])
        xs, ys = micro_batches(x, a.microbatches), micro_batches(y, a.microbatches)
        pieces = split_sequential(model.as_sequential(), world)
        stage, shape = pieces[rank], boundary_shapes(pieces, xs[0])[rank]
        opt = torch.optim.Adam(stage.parameters(), lr=a.lr)
        runs: list[StageRun] = []
        dist.barrier()                             # start together, so idle time is the schedule's
        if kind == "async":
            stash = WeightStash(stage, opt)
            schedule = [async_order(world, a.microbatches, s) for s in range(world)]
            runs.append(run_stage(stage, schedule, rank, shape, inputs=xs if rank == 0 else None,
                                  targets=ys if rank == world - 1 else None, loss_fn=lm_loss, op_seconds=pad,
                                  clock=clock, weights=stash.weights, after_backward=stash.apply))
        else:
            m = a.flush_m
            for k in range(0, a.microbatches, m):  # one synchronous step per m micro-batches: a flush each
                runs.append(run_stage(stage, make_schedule("1f1b", world, m), rank, shape,
                                      inputs=xs[k:k + m] if rank == 0 else None,
                                      targets=ys[k:k + m] if rank == world - 1 else None, loss_fn=lm_loss,
                                      op_seconds=pad, clock=clock))
                opt.step()
                opt.zero_grad(set_to_none=True)
        mine = StageRun(rank, runs[0].start, runs[-1].end,
                        busy=[(op, i + (k * a.flush_m if kind == "flush" else 0), b, e)
                              for k, r in enumerate(runs) for op, i, b, e in r.busy])
        got = gather_on_first({"rank": rank, "start": mine.start, "end": mine.end, "busy": mine.busy,
                               "inflight": max(r.peak_inflight for r in runs),
                               "sent": sum(r.sent_messages for r in runs), "overruns": sum(r.overruns for r in runs)})
        if rank == 0:
            meas, ops = timeline(got)
            out.append(TimedRun(kind, meas["makespan"], meas["bubble_fraction"], [g["inflight"] for g in got],
                                sum(g["sent"] for g in got), sum(g["overruns"] for g in got), ops))
    return out if rank == 0 else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--microbatches", type=int, default=32, help="micro-batches in the stream (n)")
    parser.add_argument("--train-microbatches", type=int, default=0,
                        help="micro-batches (steps) of the training comparison (0: --microbatches)")
    parser.add_argument("--flush-m", type=int, default=8, help="micro-batches per step of PipeDream-Flush")
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated seeds of the training comparison")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--microbatch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=64)
    parser.add_argument("--d-model", type=int, default=32)
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--t-forward-ms", type=float, default=20.0, help="padded forward of the timed runs")
    parser.add_argument("--t-backward-ms", type=float, default=40.0)
    parser.add_argument("--repeats", type=int, default=1, help="timed runs of each kind; the fastest is kept")
    launch.serve(parser, compare_pipedream, check=_check)


def _check(a: argparse.Namespace) -> None:
    a.seeds = [int(s) for s in a.seeds.split(",") if s.strip()]
    if not a.seeds or a.repeats < 1 or a.microbatches < 1 or a.flush_m < 1 or a.microbatches % a.flush_m:
        raise ValueError("give at least one seed, and a number of micro-batches that is a multiple of --flush-m")


def compare_pipedream(a: argparse.Namespace, rank: int, world: int, device: torch.device) -> PipeDreamResult | None:
    """Every seed's training comparison, then the timed runs (after an unpadded warm-up)."""
    torch.set_num_threads(1)                       # p ranks share the cores: one thread each
    result = PipeDreamResult(world, a.microbatches, a.flush_m)
    timed_runs(argparse.Namespace(**{**vars(a), "microbatches": a.flush_m}), rank, world, padded=False)  # warm-up
    for seed in a.seeds:
        run = train_seed(a, seed, rank, world)
        if run is not None:
            result.seeds.append(run)
    # on a shared machine another process can stall a rank: keep each kind's fastest of a few repeats
    tries = [timed_runs(a, rank, world) for _ in range(a.repeats)]
    if rank != 0:
        return None
    result.timed = [min((t[k] for t in tries), key=lambda r: r.makespan_s) for k in range(2)]
    return result


if __name__ == "__main__":
    main()
