"""Pipeline-parallel training steps on ``p`` ranks, checked against the sequential model (chapter 08).

    torchrun --nproc-per-node 4 -m course_lib.experiments.workers.pipeline_run --schedules gpipe,1f1b --microbatches 8 --api both

Each rank holds one stage of a ``TinyTransformer`` (its ``as_sequential()``
form cut into ``p`` pieces; ``interleaved``: ``p v`` pieces, rank ``d`` holding
``d, d + p, ...``). For every schedule (``gpipe``, ``1f1b``, ``zb-h1``,
``interleaved``) and number of micro-batches the ranks run one training step
with the hand-written executor (``pipeline_steps.handmade_step``) and/or
(``--api torch``) with ``torch.distributed.pipelining`` (``pipeline_steps.torch_api_step``:
``PipelineStage`` with ``ScheduleGPipe``, ``Schedule1F1B``, ``ScheduleInterleaved1F1B``, and for
``zb-h1`` its nearest, ``ScheduleInterleavedZeroBubble``). Every rank also computes the whole model's step on the
whole batch, so each run reports how far the pipeline's outputs and gradients
are from the sequential ones, its measured bubble, its micro-batches and
activation bytes in flight, and the busy intervals of every op (for a Gantt chart):
rank 0 reports a ``PipelineResult``. On GPU ranks the ops are timed with CUDA events.
The unmeasured warm-up step of each schedule counts every op's ATen ops (``PipelineResult.counted``),
and ``--unpadded`` runs schedules once more with no padding (``PipelineResult.unpadded``).
``--straight gpipe,1f1b`` also runs the straight-line steps of ``pipeline.gpipe_1f1b`` (``pipeline_steps.straight_step``)
at every ``--microbatches`` (``PipelineResult.straight``).
``--freeze-stages k`` also runs ``pipeline_freeze.freeze_steps`` (the worker ``pipeline_freeze_run``), the first
``k`` stages frozen and then the pipeline repacked, in the same launch (``PipelineResult.freeze``).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from course_lib.experiments import launch
from course_lib.experiments.clock import clock_for
from course_lib.parallel.pipeline.schedules import KINDS
from course_lib.experiments.pipeline_freeze import FreezeRun, freeze_steps
from course_lib.experiments.pipeline_model import add_model_args
from course_lib.experiments.pipeline_steps import (HandmadeRun, StraightRun, TorchApiRun, fastest, handmade_step,
                                                   straight_step, torch_api_step)
from course_lib.experiments.results import WorkerResult


@dataclass
class PipelineResult(WorkerResult):
    world: int
    backend: str
    clock: str                              # what timed the ops: perf_counter, or CUDA events
    handmade: list[HandmadeRun] = field(default_factory=list)
    torch_api: list[TorchApiRun] = field(default_factory=list)
    counted: list[HandmadeRun] = field(default_factory=list)    # the warm-up steps, unpadded, ops counted
    unpadded: list[HandmadeRun] = field(default_factory=list)   # --unpadded: each op takes what its work takes
    straight: list[StraightRun] = field(default_factory=list)  # --straight: gpipe_1f1b's steps
    freeze: FreezeRun | None = None         # --freeze-stages: frozen prefix, then repacked (pipeline_freeze_run)


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
    parser.add_argument("--straight", default="", help="comma-separated: gpipe, 1f1b, the straight-line steps "
                        "of pipeline.gpipe_1f1b, run first at every --microbatches")
    parser.add_argument("--freeze-stages", type=int, default=0,
                        help="also run pipeline_freeze_run's steps at the main number of micro-batches with this "
                             "many stages frozen (0: not), in this launch: no second start of the processes")
    parser.add_argument("--freeze-repeats", type=int, default=1, help="tries of each padded freeze step")
    launch.serve(parser, run_schedules, check=_check)


def _check(a: argparse.Namespace) -> None:
    a.schedules, a.unpadded = launch.pick(a.schedules, KINDS, "schedule"), launch.pick(a.unpadded, KINDS, "schedule")
    a.straight = launch.pick(a.straight, ("gpipe", "1f1b"), "straight-line schedule")
    a.main_only = set(launch.pick(a.main_only, KINDS, "schedule"))
    a.microbatches = [int(v) for v in a.microbatches.split(",") if v.strip()]
    a.torch_microbatches = [int(v) for v in a.torch_microbatches.split(",") if v.strip()] or a.microbatches
    if a.repeats < 1:
        raise ValueError(f"--repeats must be at least 1; got {a.repeats}")


def run_schedules(a: argparse.Namespace, rank: int, world: int, device: torch.device) -> PipelineResult | None:
    """Every schedule and number of micro-batches ``a`` asks for, by hand and/or with torch's API."""
    torch.set_num_threads(1)                       # p ranks share the cores: one thread each
    clock = clock_for(device)                      # made here: on a GPU it calibrates its padding first
    result = PipelineResult(world, dist.get_backend(), clock.name)
    main_m = a.torch_microbatches[-1]

    def chunks(kind: str) -> int:
        return a.chunks if kind == "interleaved" else 1

    for kind in a.straight:                        # the straight-line steps, unpadded: only their numbers count
        for m in a.microbatches:
            run = straight_step(a, kind, m, rank, world, device)
            if run is not None:
                result.straight.append(run)
    if a.api in ("handmade", "both"):
        # Warm-up, not measured: the first messages between two ranks open their
        # connection and the first backward initialises autograd, which would
        # otherwise count as idle time of the first measured run.
        # Each schedule gets its own (its chunks' first backward with a received gradient took seconds here).
        # It also counts each op's ATen ops: what B, W and a whole backward compute, exactly.
        unpad = argparse.Namespace(**{**vars(a), "t_forward_ms": 0.0})
        for kind in a.schedules:
            counted = handmade_step(unpad, kind, world, rank, world, device, clock, chunks(kind), count_ops=True)
            if counted is not None:
                result.counted.append(counted)
        for kind in a.schedules:
            main_only = kind in a.main_only
            for m in [main_m] if main_only else a.microbatches:
                # schedules run at one m only get at least 3 tries: they are few, and their ops shorter
                tries = [handmade_step(a, kind, m, rank, world, device, clock, chunks(kind),
                                       a.main_pad_scale if main_only else 1.0)
                         for _ in range(max(3, a.repeats) if main_only else a.repeats)]
                if rank == 0:
                    result.handmade.append(fastest(tries))
        for kind in a.unpadded:                    # no padding: the ops' own times, on however many cores
            tries = [handmade_step(unpad, kind, main_m, rank, world, device, clock, chunks(kind))
                     for _ in range(a.repeats)]
            if rank == 0:
                result.unpadded.append(fastest(tries))
    if a.freeze_stages > 0:
        result.freeze = freeze_steps(a, a.freeze_stages, main_m, a.freeze_repeats, rank, world, device, clock)
    if a.api in ("torch", "both"):
        for kind in a.schedules:
            for m in a.torch_microbatches:
                run = torch_api_step(a, kind, m, rank, world, device, chunks(kind))
                if run is not None:
                    result.torch_api.append(run)
    return result


if __name__ == "__main__":
    main()
