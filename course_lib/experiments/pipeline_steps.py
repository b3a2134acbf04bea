"""One pipeline training step on ``p`` ranks, checked against the sequential model (chapter 08).

``handmade_step`` runs a schedule of ``pipeline.make_schedule`` with the
hand-written executor (``pipeline.executor.run_stage``, metered by ``pipeline_meter``) and measures it: bubble,
micro-batches and bytes in flight, messages, every op's busy interval;
``torch_api_step`` runs the same step with ``torch.distributed.pipelining``, and ``straight_step`` with the
straight-line GPipe or 1F1B of ``pipeline.gpipe_1f1b``.
Both compare the outputs and gradients with the whole model's step on the
whole batch (``pipeline_model.staged``). The worker
``course_lib.experiments.workers.pipeline_run`` runs them for every schedule.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from course_lib.experiments.clock import Clock
from course_lib.parallel.pipeline.gpipe_1f1b import Pipe, gpipe_step, one_f_one_b_step
from course_lib.parallel.pipeline.schedules import (Schedule, bubble_formula, frozen_prefix, make_schedule, num_chunks,
                                                    simulate, zb_h1_bubble_formula)
from course_lib.experiments.pipeline_meter import gather_step, grad_diff, metered_stage
from course_lib.parallel.pipeline.executor import boundary_shapes, op_links, send_releases
from course_lib.experiments.pipeline_model import my_chunks, op_pads, staged
from course_lib.experiments.results import WorkerResult, gather_on_first
from course_lib.models import lm_loss


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
    peak_sends_held: list[int]              # per stage: sent tensors kept alive at once
    peak_sends_bound: list[int]             # per stage: what the schedule allows (``peak_sends_held``)
    sent_messages: int                      # all ranks' point-to-point messages
    sent_bytes: int
    chunks: int
    overruns: int                           # ops whose work took longer than their padded time
    grad_max_abs_diff: float
    output_max_abs_diff: float
    timings: list[tuple[int, str, int, float, float, int]]  # (stage, op, micro-batch, start, end, chunk), s
    bubble_measured_all: list[float] = field(default_factory=list)  # every repeat's
    # with counting: (stage, op, micro-batch, chunk, {ATen op: tensors computed}) for every op (views left out)
    op_counts: list[tuple[int, str, int, int, dict[str, int]]] = field(default_factory=list)


@dataclass
class TorchApiRun(WorkerResult):
    """One step of torch.distributed.pipelining."""

    kind: str
    p: int
    m: int
    grad_max_abs_diff: float
    output_max_abs_diff: float
    loss: float
    schedule: str = ""                      # torch's class that ran
    loss_reference: float = 0.0             # the sequential model's loss on the same batch


@dataclass
class StraightRun(WorkerResult):
    """One step of ``gpipe_1f1b``'s straight-line GPipe or 1F1B against the sequential step."""

    kind: str
    p: int
    m: int
    grad_max_abs_diff: float                # every stage's gradients against the sequential model's
    loss_abs_diff: float                    # the mean of the micro-batches' losses against the whole batch's
    loss: float


def peak_sends_held(schedule: Schedule, rank: int) -> int:
    """The most sent tensors ``rank`` keeps alive at once under ``executor.send_releases``: the schedule's bound.

    1F1B (``p >= 2``): ``min(p, m)`` on stage 0 (its warm-up's activations) and
    ``min(p - s + 1, m)`` on a later stage ``s`` (its cool-down's gradients),
    whatever ``m`` (chapter 08 checks this for p = 2..8, m = 1..24); GPipe: ``m``.
    """
    world, v, frozen = len(schedule), num_chunks(schedule), frozen_prefix(schedule)
    rel = send_releases(schedule, rank)
    sends = [k for k, o in enumerate(schedule[rank]) if op_links(o, rank, world, v, frozen)[1]]
    # before op r: every send up to op r - 1 that op r's receive (or a later one) has not yet proven delivered
    return max([0] + [sum(1 for j in sends if j < r and (rel[j] is None or rel[j] >= r))
                      for r in range(1, len(schedule[rank]) + 1)])


def straight_step(a: argparse.Namespace, kind: str, m: int, rank: int, world: int,
                  device: torch.device) -> StraightRun | None:
    """One step of ``gpipe_1f1b.gpipe_step`` (``kind`` ``"gpipe"``) or ``one_f_one_b_step`` (``"1f1b"``) over ``m``
    micro-batches; rank 0 returns the differences from the sequential step, the others ``None``."""
    ref = staged(a, world, m)
    mine = ref.stages[rank].to(device)
    shape, dtype = boundary_shapes(ref.stages, ref.xs[0])[rank]
    pipe = Pipe(mine, rank, world, shape, dtype, loss_fn=lm_loss, device=device)
    step = {"gpipe": gpipe_step, "1f1b": one_f_one_b_step}[kind]
    dist.barrier()
    losses = step(pipe, m, ref.xs if rank == 0 else None, ref.ys if rank == world - 1 else None)
    got = gather_on_first((grad_diff([mine], [ref.refs[rank]]), losses))
    if got is None:
        return None
    loss = sum(got[-1][1]) / m
    return StraightRun(kind, world, m, max(g for g, _ in got), abs(loss - ref.loss), loss)


def handmade_step(a: argparse.Namespace, kind: str, m: int, rank: int, world: int, device: torch.device,
                  clock: Clock, chunks: int = 1, pad_scale: float = 1.0, count_ops: bool = False) -> HandmadeRun | None:
    """One step of schedule ``kind`` over ``m`` micro-batches on every rank (``chunks`` per rank: interleaved);
    rank 0 returns the whole run's figures, the others ``None``. ``a``: ``pipeline_model.add_model_args``'s options.

    ``pad_scale`` pads the ops that many times longer; ``count_ops`` counts every op's ATen ops (which slows
    them: the step's times then mean little).
    """
    v = chunks
    ref = staged(a, world * v, m)
    mine = [c.to(device) for c in my_chunks(ref.stages, rank, world, v)]
    shapes = my_chunks(boundary_shapes(ref.stages, ref.xs[0]), rank, world, v)
    schedule = make_schedule(kind, world, m, chunks=v)
    # A chunk's op would take 1/v of a stage's time; it is padded to the whole t_f / t_b instead: the bubble, a
    # fraction, does not depend on the unit of time, and longer ops leave messaging delays less weight.
    pad = op_pads(a, split=kind == "zb-h1", scale=pad_scale)
    dist.barrier()                                 # start together, so idle time is the schedule's
    run = metered_stage(mine if v > 1 else mine[0], schedule, rank, shapes if v > 1 else shapes[0], inputs=ref.xs,
                    targets=ref.ys, loss_fn=lm_loss, op_seconds=pad, device=device, clock=clock, count_ops=count_ops)
    # the last stage compares the model's outputs
    out_diff = (torch.cat(run.outputs) - ref.logits).abs().max().item() if run.outputs else None
    step = gather_step(run, grad=grad_diff(mine, my_chunks(ref.refs, rank, world, v)), output=out_diff)
    if step is None:
        return None
    # the formula and the simulation in the padded ops' units; an unpadded run's ops take what their work takes,
    # so it is set beside the textbook t_b = 2 t_f (not beside its padding's t_b, with t_f = 1)
    t_f, t_b = (a.t_forward_ms, a.t_backward_ms) if pad is not None else (1.0, 2.0)
    sim = simulate(schedule, t_f, t_b)
    return HandmadeRun(
        kind=kind, p=world, m=m, padded=pad is not None, makespan_s=step.makespan_s, bubble_measured=step.bubble,
        bubble_formula=zb_h1_bubble_formula(world, m, t_f, t_b) if kind == "zb-h1" else bubble_formula(world, m, v),
        bubble_simulated=sim.bubble_fraction, peak_inflight=step.each("peak_inflight"),
        peak_inflight_simulated=sim.peak_inflight, peak_activation_bytes=step.each("peak_activation_bytes"),
        peak_sends_held=step.each("peak_sends_held"),
        peak_sends_bound=[peak_sends_held(schedule, s) for s in range(world)],
        sent_messages=step.total("sent_messages"), sent_bytes=step.total("sent_bytes"), chunks=v,
        overruns=step.total("overruns"), grad_max_abs_diff=max(step.each("grad")),
        output_max_abs_diff=step.each("output")[-1],
        timings=[(*t, c) for t, c in zip(step.timings, (c for r in step.runs for c in r.busy_chunks))],
        op_counts=[(r.rank, op, i, c, n) for r in step.runs
                   for (op, i, *_), c, n in zip(r.busy, r.busy_chunks, r.op_counts)])


def fastest(tries: list[HandmadeRun]) -> HandmadeRun:
    """The least disturbed of a few tries (on a shared machine another process can stall a rank for a while)."""
    best = min(tries, key=lambda r: r.makespan_s)
    best.bubble_measured_all = [r.bubble_measured for r in tries]
    return best


def torch_api_step(a: argparse.Namespace, kind: str, m: int, rank: int, world: int, device: torch.device,
                   chunks: int = 1) -> TorchApiRun | None:
    """The same step with ``torch.distributed.pipelining``; rank 0 returns the differences, the others None."""
    from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B,
                                              ScheduleInterleavedZeroBubble)

    # zb-h1 runs as torch's interleaved zero-bubble schedule (two chunks per rank), the one it ships for this
    v = max(2, chunks) if kind == "zb-h1" else chunks
    ref = staged(a, world * v, m)
    mods = [c.to(device) for c in my_chunks(ref.stages, rank, world, v)]
    stages = [PipelineStage(mod, stage_index=c * world + rank, num_stages=world * v, device=device)
              for c, mod in enumerate(mods)]
    # scale_grads=True (the default) divides the summed micro-batch gradients by m:
    # with a mean loss per micro-batch that is the gradient of the whole batch's mean loss.
    cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved": ScheduleInterleaved1F1B,
           "zb-h1": ScheduleInterleavedZeroBubble}[kind]
    schedule = cls(stages[0] if v == 1 else stages, n_microbatches=m, loss_fn=lm_loss)
    losses: list[torch.Tensor] = []
    x, y = ref.x.to(device), ref.y.to(device)
    if rank == 0:                                  # holds virtual stage 0 (and, interleaved, not the last)
        out = schedule.step(x, target=y if rank == world - 1 else None, losses=losses)
    elif rank == world - 1:                        # holds the last virtual stage
        out = schedule.step(target=y, losses=losses)
    else:
        out = schedule.step()
    out_diff = loss = 0.0
    if losses:                                     # the last rank: the model's outputs and loss
        out_diff, loss = (out.detach().cpu() - ref.logits).abs().max().item(), torch.stack(losses).mean().item()
    got = gather_on_first((grad_diff(mods, my_chunks(ref.refs, rank, world, v)), out_diff, loss))   # every rank's
    if got is None:
        return None
    _, out_diff, loss = got[-1]
    return TorchApiRun(kind, world, m, grad_max_abs_diff=max(g for g, _, _ in got), output_max_abs_diff=out_diff,
                       loss=loss, schedule=cls.__name__, loss_reference=ref.loss)
