"""Pipeline-parallel training steps on ``p`` ranks, checked against the sequential model (chapter 08).

    torchrun --nproc-per-node 4 -m course_lib.workers.pipeline_run --schedules gpipe,1f1b --microbatches 8 --api both

Each rank holds one stage of a ``TinyTransformer`` (its ``as_sequential()``
form cut into ``p`` pieces; ``interleaved``: ``p v`` pieces, rank ``d`` holding
``d, d + p, ...``). For every schedule (``gpipe``, ``1f1b``, ``zb-h1``,
``interleaved``) and number of micro-batches the ranks run one training step
with the hand-written executor (``pipeline_exec.run_stage``) and/or
(``--api torch``) with ``torch.distributed.pipelining`` (``PipelineStage``
with ``ScheduleGPipe``, ``Schedule1F1B``, ``ScheduleInterleaved1F1B``, and for
``zb-h1`` its nearest, ``ScheduleInterleavedZeroBubble``). Every rank also computes the whole model's step on the
whole batch, so each run reports how far the pipeline's outputs and gradients
are from the sequential ones, its measured bubble, its micro-batches and
activation bytes in flight, and the busy intervals of every op (for a Gantt chart):
rank 0 reports a ``PipelineResult``. On GPU ranks the ops are timed with CUDA events.
The unmeasured warm-up step of each schedule counts every op's ATen ops (``PipelineResult.counted``),
and ``--unpadded`` runs schedules once more with no padding (``PipelineResult.unpadded``).
``--freeze-stages k`` also runs ``pipeline_freeze_run``'s steps, the first ``k`` stages frozen and then
the pipeline repacked, in the same launch (``PipelineResult.freeze``).
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
from course_lib.distributed.results import WorkerResult, gather_on_first
from course_lib.distributed.pipeline import KINDS, bubble_formula, make_schedule, simulate, zb_h1_bubble_formula
from course_lib.distributed.pipeline_exec import (boundary_shapes, grad_diff, micro_batches, peak_sends_held, run_stage,
                                                  split_sequential, timeline)
from course_lib.models import lm_loss
from course_lib.workers.pipeline_freeze_run import FreezeRun, add_model_args, freeze_steps, tiny_model


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def _names(text: str) -> list[str]:
    return [k.strip() for k in text.split(",") if k.strip()]


def _chunks(a: argparse.Namespace, kind: str) -> int:
    return a.chunks if kind == "interleaved" else 1


def build(a: argparse.Namespace, world: int, m: int, v: int = 1):
    """The same model and batch on every rank (same seed), and the sequential reference step."""
    model = tiny_model(a, world * v)
    x, y = make_tokens(m * a.microbatch_size, a.seq_len, vocab=a.vocab, seed=a.seed)
    reference = copy.deepcopy(model)
    logits = reference(x)
    lm_loss(logits, y).backward()                  # mean over every token of the whole batch
    return model, reference, x, y, logits.detach()


def _my_chunks(pieces: list, rank: int, world: int, v: int) -> list:
    """Rank ``d`` holds virtual stages ``d, d + p, ..., d + (v - 1) p``."""
    return [pieces[c * world + rank] for c in range(v)]


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
    peak_sends_bound: list[int]             # per stage: what the schedule allows (pipeline_exec.peak_sends_held)
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
class PipelineResult(WorkerResult):
    world: int
    backend: str
    clock: str                              # what timed the ops: perf_counter, or CUDA events
    handmade: list[HandmadeRun] = field(default_factory=list)
    torch_api: list[TorchApiRun] = field(default_factory=list)
    counted: list[HandmadeRun] = field(default_factory=list)    # the warm-up steps, unpadded, ops counted
    unpadded: list[HandmadeRun] = field(default_factory=list)   # --unpadded: each op takes what its work takes
    freeze: FreezeRun | None = None         # --freeze-stages: frozen prefix, then repacked (pipeline_freeze_run)


def handmade_step(a: argparse.Namespace, kind: str, m: int, rank: int, world: int, device: torch.device,
                  clock: Clock, count_ops: bool = False) -> HandmadeRun | None:
    """One step with the hand-written executor; rank 0 returns the whole run's figures, the others None.

    ``count_ops`` counts every op's ATen ops (which slows them: the step's times then mean little).
    """
    v = _chunks(a, kind)
    model, reference, x, y, ref_logits = build(a, world, m, v)
    pieces = split_sequential(model.as_sequential(), world * v)
    refs = _my_chunks(split_sequential(reference.as_sequential(), world * v), rank, world, v)
    # separate tensors, as a data loader hands them out (a chunk is a view of the whole batch's storage)
    xs, ys = micro_batches(x, m), micro_batches(y, m)
    shapes = _my_chunks(boundary_shapes(pieces, xs[0]), rank, world, v)
    mine_ = [c.to(device) for c in _my_chunks(pieces, rank, world, v)]
    schedule = make_schedule(kind, world, m, chunks=v)
    t_f, t_b = a.t_forward_ms / 1e3, a.t_backward_ms / 1e3
    # A split backward is half input gradient, half weight gradient. A chunk's op would take 1/v of a
    # stage's time; it is padded to the whole t_f / t_b instead: the bubble, a fraction, does not depend
    # on the unit of time, and longer ops leave a shared machine's messaging delays less weight.
    pad = None if a.t_forward_ms <= 0 else {"F": t_f, "B": t_b / (2 if kind == "zb-h1" else 1), "W": t_b / 2}
    if pad and kind in a.main_only:
        pad = {op: a.main_pad_scale * t for op, t in pad.items()}
    dist.barrier()                                 # start together, so idle time is the schedule's
    run = run_stage(mine_ if v > 1 else mine_[0], schedule, rank, shapes if v > 1 else shapes[0],
                    inputs=xs if rank == 0 else None, targets=ys if rank == world - 1 else None, loss_fn=lm_loss,
                    op_seconds=pad, device=device, clock=clock, count_ops=count_ops)
    mine = {"rank": run.rank, "start": run.start, "end": run.end, "busy": run.busy, "chunks": run.busy_chunks,
            "peak_inflight": run.peak_inflight, "peak_activation_bytes": run.peak_activation_bytes,
            "peak_sends_held": run.peak_sends_held, "sent_messages": run.sent_messages,
            "sent_bytes": run.sent_bytes, "overruns": run.overruns,
            "grad_max_abs_diff": grad_diff(mine_, refs), "op_counts": run.op_counts}
    if run.outputs:                                # the last stage compares the model's outputs
        mine["output_max_abs_diff"] = (torch.cat(run.outputs) - ref_logits).abs().max().item()
    runs = gather_on_first(mine)
    if runs is None:
        return None

    meas, ops = timeline(runs)
    sim = simulate(schedule, a.t_forward_ms or 1.0, a.t_backward_ms or 2.0)
    formula = (zb_h1_bubble_formula(world, m, a.t_forward_ms or 1.0, a.t_backward_ms or 2.0) if kind == "zb-h1"
               else bubble_formula(world, m, v))
    return HandmadeRun(
        kind=kind, p=world, m=m, padded=pad is not None,
        makespan_s=meas["makespan"], bubble_measured=meas["bubble_fraction"],
        bubble_formula=formula, bubble_simulated=sim.bubble_fraction,
        peak_inflight=[r["peak_inflight"] for r in runs], peak_inflight_simulated=sim.peak_inflight,
        peak_activation_bytes=[r["peak_activation_bytes"] for r in runs],
        peak_sends_held=[r["peak_sends_held"] for r in runs],
        peak_sends_bound=[peak_sends_held(schedule, s) for s in range(world)],
        sent_messages=sum(r["sent_messages"] for r in runs), sent_bytes=sum(r["sent_bytes"] for r in runs),
        chunks=v, overruns=sum(r["overruns"] for r in runs),
        grad_max_abs_diff=max(r["grad_max_abs_diff"] for r in runs),
        output_max_abs_diff=runs[-1]["output_max_abs_diff"],
        # (stage, op, micro-batch, start, end, chunk) in seconds from the common start, for plots.gantt
        timings=[(*t, c) for t, c in zip(ops, (c for r in runs for c in r["chunks"]))],
        op_counts=[(r["rank"], op, i, c, n) for r in runs
                   for (op, i, *_), c, n in zip(r["busy"], r["chunks"], r["op_counts"])])


def torch_api_step(a: argparse.Namespace, kind: str, m: int, rank: int, world: int,
                   device: torch.device) -> TorchApiRun | None:
    """The same step with ``torch.distributed.pipelining``; rank 0 returns the differences, the others None."""
    from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B,
                                              ScheduleInterleavedZeroBubble)

    # zb-h1 runs as torch's interleaved zero-bubble schedule (two chunks per rank), the one it ships for this
    v = max(2, a.chunks) if kind == "zb-h1" else _chunks(a, kind)
    model, reference, x, y, ref_logits = build(a, world, m, v)
    mods = [c.to(device) for c in _my_chunks(split_sequential(model.as_sequential(), world * v), rank, world, v)]
    refs = _my_chunks(split_sequential(reference.as_sequential(), world * v), rank, world, v)
    stages = [PipelineStage(mod, stage_index=c * world + rank, num_stages=world * v, device=device)
              for c, mod in enumerate(mods)]
    # scale_grads=True (the default) divides the summed micro-batch gradients by m:
    # with a mean loss per micro-batch that is the gradient of the whole batch's mean loss.
    cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved": ScheduleInterleaved1F1B,
           "zb-h1": ScheduleInterleavedZeroBubble}[kind]
    schedule = cls(stages[0] if v == 1 else stages, n_microbatches=m, loss_fn=lm_loss)
    mine: dict = {}
    losses: list[torch.Tensor] = []
    if rank == 0:                                  # holds virtual stage 0 (and, interleaved, not the last)
        out = schedule.step(x.to(device), target=y.to(device) if rank == world - 1 else None, losses=losses)
    elif rank == world - 1:                        # holds the last virtual stage
        out = schedule.step(target=y.to(device), losses=losses)
    else:
        out = schedule.step()
    if losses:
        mine["output_max_abs_diff"] = (out.detach().cpu() - ref_logits).abs().max().item()
        mine["loss"] = torch.stack(losses).mean().item()
    mine["grad_max_abs_diff"] = grad_diff(mods, refs)
    gathered = gather_on_first(mine)
    if gathered is None:
        return None
    last = gathered[-1]
    return TorchApiRun(kind, world, m, grad_max_abs_diff=max(g["grad_max_abs_diff"] for g in gathered),
                       output_max_abs_diff=last["output_max_abs_diff"], loss=last["loss"], schedule=cls.__name__,
                       loss_reference=lm_loss(ref_logits, y).item())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedules", default="gpipe,1f1b", help="comma-separated: gpipe, 1f1b, zb-h1, interleaved")
    parser.add_argument("--chunks", type=int, default=2, help="model chunks per rank of the interleaved schedule")
    parser.add_argument("--microbatches", default="8", help="comma-separated numbers of micro-batches")
    add_model_args(parser)                         # --microbatch-size ... --t-backward-ms, shared with freezing
    parser.add_argument("--api", choices=["handmade", "torch", "both"], default="handmade",
                        help="the hand-written executor, torch.distributed.pipelining, or both")
    parser.add_argument("--torch-microbatches", default="",
                        help="micro-batch counts for torch.distributed.pipelining (default: --microbatches)")
    parser.add_argument("--main-only", default="",
                        help="schedules to run by hand only at the main number of micro-batches (the last of "
                             "--torch-microbatches, else of --microbatches), not at every one")
    parser.add_argument("--main-pad-scale", type=float, default=1.0,
                        help="pad the --main-only schedules' ops this many times longer: a schedule with no slack "
                             "(ZB-H1) lets every messaging delay add to its idle time")
    parser.add_argument("--unpadded", default="",
                        help="schedules to run once more at the main number of micro-batches without padding "
                             "(each op takes what its work takes), the fastest of --repeats tries")
    parser.add_argument("--repeats", type=int, default=1,
                        help="run each padded step this often and keep the fastest (least disturbed) one")
    parser.add_argument("--freeze-stages", type=int, default=0,
                        help="also run pipeline_freeze_run's steps at the main number of micro-batches with this "
                             "many stages frozen (0: not), in this launch: no second start of the processes")
    parser.add_argument("--freeze-repeats", type=int, default=1, help="tries of each padded freeze step")
    launch.serve(parser, run_schedules, check=_check)


def _check(a: argparse.Namespace) -> None:
    bad = [k for k in _names(a.schedules) + _names(a.unpadded) if k not in KINDS]
    if bad:
        raise ValueError(f"this worker runs the schedules {', '.join(KINDS)}; got {bad}")
    if a.repeats < 1:
        raise ValueError(f"--repeats must be at least 1; got {a.repeats}")


def _fastest(tries: list[HandmadeRun]) -> HandmadeRun:
    """The least disturbed of a few tries (on a shared machine another process can stall a rank for a while)."""
    best = min(tries, key=lambda r: r.makespan_s)
    best.bubble_measured_all = [r.bubble_measured for r in tries]
    return best


def run_schedules(a: argparse.Namespace, rank: int, world: int, device: torch.device) -> PipelineResult | None:
    """Every schedule and number of micro-batches ``a`` asks for, by hand and/or with torch's API."""
    kinds, a.main_only, unpadded = _names(a.schedules), set(_names(a.main_only)), _names(a.unpadded)
    torch.set_num_threads(1)                       # p ranks share the cores: one thread each
    clock = clock_for(device)                      # made here: on a GPU it calibrates its padding first
    result = PipelineResult(world, dist.get_backend(), clock.name)
    main_m = _ints(a.torch_microbatches or a.microbatches)[-1]
    if a.api in ("handmade", "both"):
        # Warm-up, not measured: the first messages between two ranks open their
        # connection and the first backward initialises autograd, which would
        # otherwise count as idle time of the first measured run.
        # Each schedule gets its own (its chunks' first backward with a received gradient took seconds here).
        # It also counts each op's ATen ops: what B, W and a whole backward compute, exactly.
        unpad = argparse.Namespace(**{**vars(a), "t_forward_ms": 0.0})
        for kind in kinds:
            counted = handmade_step(unpad, kind, world, rank, world, device, clock, count_ops=True)
            if counted is not None:
                result.counted.append(counted)
        for kind in kinds:
            for m in (_ints(a.microbatches) if kind not in a.main_only else [main_m]):
                # schedules run at one m only get at least 3 tries: they are few, and their ops shorter
                n = a.repeats if kind not in a.main_only else max(3, a.repeats)
                tries = [handmade_step(a, kind, m, rank, world, device, clock) for _ in range(n)]
                if rank == 0:
                    result.handmade.append(_fastest(tries))
        for kind in unpadded:                      # no padding: the ops' own times, on however many cores
            tries = [handmade_step(unpad, kind, main_m, rank, world, device, clock) for _ in range(a.repeats)]
            if rank == 0:
                result.unpadded.append(_fastest(tries))
    if a.freeze_stages > 0:
        result.freeze = freeze_steps(a, a.freeze_stages, main_m, a.freeze_repeats, rank, world, device, clock)
    if a.api in ("torch", "both"):
        for kind in kinds:
            for m in _ints(a.torch_microbatches or a.microbatches):
                run = torch_api_step(a, kind, m, rank, world, device)
                if run is not None:
                    result.torch_api.append(run)
    return result


if __name__ == "__main__":
    main()
