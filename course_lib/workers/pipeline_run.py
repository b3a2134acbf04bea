"""Pipeline-parallel training steps on ``p`` ranks, checked against the sequential model (chapter 07).

    torchrun --nproc-per-node 4 -m course_lib.workers.pipeline_run --schedules gpipe,1f1b --microbatches 8 --api both

Each rank holds one stage of a ``TinyTransformer`` (its ``as_sequential()``
form cut into ``p`` pieces). For every schedule and number of micro-batches
the ranks run one training step with the hand-written executor
(``pipeline_exec.run_stage``) and/or (``--api torch``) with
``torch.distributed.pipelining`` (``PipelineStage`` with ``ScheduleGPipe`` or
``Schedule1F1B``). Every rank also computes the whole model's step on the
whole batch, so each run reports how far the pipeline's outputs and gradients
are from the sequential ones, its measured bubble, its micro-batches and
activation bytes in flight, and the busy intervals of every op (for a Gantt chart):
rank 0 reports a ``PipelineResult``. On GPU ranks the ops are timed with CUDA events.
"""

from __future__ import annotations

import argparse
import copy
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from course_lib.data import make_tokens
from course_lib.distributed import launch
from course_lib.distributed.clock import Clock, clock_for
from course_lib.distributed.results import WorkerResult
from course_lib.distributed.pipeline import bubble_formula, make_schedule, simulate
from course_lib.distributed.pipeline_exec import (StageRun, boundary_shapes, measured_bubble, run_stage,
                                                  split_sequential)
from course_lib.env import seed_everything
from course_lib.models import TinyTransformer, lm_loss


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def build(a: argparse.Namespace, world: int, m: int):
    """The same model and batch on every rank (same seed), and the sequential reference step."""
    seed_everything(a.seed)
    layers = a.layers if a.layers > 0 else max(1, 2 * world - 2)   # 2 modules per stage with embed and head
    model = TinyTransformer(vocab=a.vocab, d_model=a.d_model, n_heads=a.heads, n_layers=layers,
                            max_len=a.seq_len)
    x, y = make_tokens(m * a.microbatch_size, a.seq_len, vocab=a.vocab, seed=a.seed)
    reference = copy.deepcopy(model)
    logits = reference(x)
    lm_loss(logits, y).backward()                  # mean over every token of the whole batch
    return model, reference, x, y, logits.detach()


def _max_grad_diff(stage: torch.nn.Module, ref_stage: torch.nn.Module) -> float:
    diffs = [(p.grad - r.grad).abs().max().item() for p, r in zip(stage.parameters(), ref_stage.parameters())]
    return max(diffs, default=0.0)


@dataclass
class HandmadeRun(WorkerResult):
    """One step of the hand-written executor, every rank's figures together."""

    kind: str
    p: int
    m: int
    padded: bool
    makespan_s: float
    bubble_measured: float
    bubble_formula: float
    bubble_simulated: float
    peak_inflight: list[int]                # per stage
    peak_inflight_simulated: list[float]
    peak_activation_bytes: list[int]        # per stage
    overruns: int                           # ops whose work took longer than their padded time
    grad_max_abs_diff: float
    output_max_abs_diff: float
    timings: list[tuple[int, str, int, float, float]]  # (stage, op, micro-batch, start, end), s from the start
    bubble_measured_all: list[float] = field(default_factory=list)  # every repeat's


@dataclass
class TorchApiRun(WorkerResult):
    """One step of torch.distributed.pipelining."""

    kind: str
    p: int
    m: int
    grad_max_abs_diff: float
    output_max_abs_diff: float
    loss: float


@dataclass
class PipelineResult(WorkerResult):
    world: int
    backend: str
    clock: str                              # what timed the ops: perf_counter, or CUDA events
    handmade: list[HandmadeRun] = field(default_factory=list)
    torch_api: list[TorchApiRun] = field(default_factory=list)


def handmade_step(a: argparse.Namespace, kind: str, m: int, rank: int, world: int, device: torch.device,
                  clock: Clock) -> HandmadeRun | None:
    """One step with the hand-written executor; rank 0 returns the whole run's figures, the others None."""
    model, reference, x, y, ref_logits = build(a, world, m)
    stages = split_sequential(model.as_sequential(), world)
    ref_stage = split_sequential(reference.as_sequential(), world)[rank]
    # separate tensors, as a data loader hands them out (a chunk is a view of the whole batch's storage)
    xs, ys = [c.clone() for c in x.chunk(m)], [c.clone() for c in y.chunk(m)]
    shapes = boundary_shapes(stages, xs[0])
    stage = stages[rank].to(device)
    order = make_schedule(kind, world, m)[rank]
    pad = None if a.t_forward_ms <= 0 else {"F": a.t_forward_ms / 1e3, "B": a.t_backward_ms / 1e3}
    dist.barrier()                                 # start together, so idle time is the schedule's
    run = run_stage(stage, order, rank, world, shapes[rank], inputs=xs if rank == 0 else None,
                    targets=ys if rank == world - 1 else None, loss_fn=lm_loss, op_seconds=pad, device=device,
                    clock=clock)
    mine = {"rank": run.rank, "start": run.start, "end": run.end, "busy": run.busy,
            "peak_inflight": run.peak_inflight, "peak_activation_bytes": run.peak_activation_bytes,
            "overruns": run.overruns, "grad_max_abs_diff": _max_grad_diff(stage.cpu(), ref_stage)}
    if run.outputs:                                # the last stage compares the model's outputs
        mine["output_max_abs_diff"] = (torch.cat(run.outputs) - ref_logits).abs().max().item()
    gathered: list[dict] | None = [None] * world if rank == 0 else None  # type: ignore[list-item]
    dist.gather_object(mine, gathered, dst=0)
    if rank != 0:
        return None
    runs = sorted(gathered, key=lambda r: r["rank"])  # type: ignore[arg-type]

    meas = measured_bubble([StageRun(r["rank"], r["start"], r["end"], busy=r["busy"]) for r in runs])
    t0 = min(r["start"] for r in runs)
    sim = simulate(make_schedule(kind, world, m), a.t_forward_ms or 1.0, a.t_backward_ms or 2.0)
    return HandmadeRun(
        kind=kind, p=world, m=m, padded=pad is not None,
        makespan_s=meas["makespan"], bubble_measured=meas["bubble_fraction"],
        bubble_formula=bubble_formula(world, m), bubble_simulated=sim.bubble_fraction,
        peak_inflight=[r["peak_inflight"] for r in runs], peak_inflight_simulated=sim.peak_inflight,
        peak_activation_bytes=[r["peak_activation_bytes"] for r in runs],
        overruns=sum(r["overruns"] for r in runs),
        grad_max_abs_diff=max(r["grad_max_abs_diff"] for r in runs),
        output_max_abs_diff=runs[-1]["output_max_abs_diff"],
        # (stage, op, micro-batch, start, end) in seconds from the common start, for plots.gantt
        timings=[(r["rank"], op, i, b - t0, e - t0) for r in runs for op, i, b, e in r["busy"]])


def torch_api_step(a: argparse.Namespace, kind: str, m: int, rank: int, world: int,
                   device: torch.device) -> TorchApiRun | None:
    """The same step with ``torch.distributed.pipelining``; rank 0 returns the differences, the others None."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    model, reference, x, y, ref_logits = build(a, world, m)
    stage_mod = split_sequential(model.as_sequential(), world)[rank].to(device)
    ref_stage = split_sequential(reference.as_sequential(), world)[rank]
    stage = PipelineStage(stage_mod, stage_index=rank, num_stages=world, device=device)
    # scale_grads=True (the default) divides the summed micro-batch gradients by m:
    # with a mean loss per micro-batch that is the gradient of the whole batch's mean loss.
    schedule = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[kind](stage, n_microbatches=m, loss_fn=lm_loss)
    mine: dict = {}
    if rank == 0:
        schedule.step(x.to(device))
    elif rank == world - 1:
        losses: list[torch.Tensor] = []
        out = schedule.step(target=y.to(device), losses=losses)
        mine["output_max_abs_diff"] = (out.detach().cpu() - ref_logits).abs().max().item()
        mine["loss"] = torch.stack(losses).mean().item()
    else:
        schedule.step()
    mine["grad_max_abs_diff"] = _max_grad_diff(stage_mod.cpu(), ref_stage)
    gathered: list[dict] | None = [None] * world if rank == 0 else None  # type: ignore[list-item]
    dist.gather_object(mine, gathered, dst=0)
    if rank != 0:
        return None
    return TorchApiRun(kind, world, m, grad_max_abs_diff=max(g["grad_max_abs_diff"] for g in gathered),  # type: ignore
                       output_max_abs_diff=gathered[-1]["output_max_abs_diff"],  # type: ignore[index]
                       loss=gathered[-1]["loss"])  # type: ignore[index]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedules", default="gpipe,1f1b", help="comma-separated: gpipe, 1f1b")
    parser.add_argument("--microbatches", default="8", help="comma-separated numbers of micro-batches")
    parser.add_argument("--microbatch-size", type=int, default=2, help="sequences per micro-batch")
    parser.add_argument("--seq-len", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=64)
    parser.add_argument("--d-model", type=int, default=32)
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--layers", type=int, default=0, help="transformer blocks (0: 2p - 2)")
    parser.add_argument("--t-forward-ms", type=float, default=20.0, help="pad each forward to this (0: no padding)")
    parser.add_argument("--t-backward-ms", type=float, default=40.0, help="pad each backward to this")
    parser.add_argument("--api", choices=["handmade", "torch", "both"], default="handmade",
                        help="the hand-written executor, torch.distributed.pipelining, or both")
    parser.add_argument("--torch-microbatches", default="",
                        help="micro-batch counts for torch.distributed.pipelining (default: --microbatches)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="run each padded step this often and keep the fastest (least disturbed) one")
    parser.add_argument("--seed", type=int, default=0)
    launch.add_timeout_arg(parser)
    a = parser.parse_args()
    kinds = [k.strip() for k in a.schedules.split(",") if k.strip()]
    bad = [k for k in kinds if k not in ("gpipe", "1f1b")]
    if bad:
        raise ValueError(f"this worker runs the gpipe and 1f1b schedules; got {bad}")
    if a.repeats < 1:
        raise ValueError(f"--repeats must be at least 1; got {a.repeats}")

    rank, world, device = launch.init_distributed(timeout_s=a.pg_timeout)
    torch.set_num_threads(1)                       # p ranks share the cores: one thread each
    clock = clock_for(device)                      # made here: on a GPU it calibrates its padding first
    result = PipelineResult(world, dist.get_backend(), clock.name)
    if a.api in ("handmade", "both"):
        # Warm-up, not measured: the first messages between two ranks open their
        # connection and the first backward initialises autograd, which would
        # otherwise count as idle time of the first measured run.
        handmade_step(argparse.Namespace(**{**vars(a), "t_forward_ms": 0.0}), "1f1b", world, rank, world, device,
                      clock)
        for kind in kinds:
            for m in _ints(a.microbatches):
                # On a shared machine another process can stall a rank for a while;
                # the fastest of a few repeats is the one closest to the schedule itself.
                tries = [handmade_step(a, kind, m, rank, world, device, clock) for _ in range(a.repeats)]
                if rank == 0:
                    best = min(tries, key=lambda r: r.makespan_s)
                    best.bubble_measured_all = [r.bubble_measured for r in tries]
                    result.handmade.append(best)
    if a.api in ("torch", "both"):
        for kind in kinds:
            for m in _ints(a.torch_microbatches or a.microbatches):
                run = torch_api_step(a, kind, m, rank, world, device)
                if run is not None:
                    result.torch_api.append(run)
    launch.report(result)
    launch.shutdown()


if __name__ == "__main__":
    main()
