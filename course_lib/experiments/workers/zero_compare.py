"""Chapter 09's experiment: one model trained by DDP, ZeRO-1, ZeRO-2, ZeroRedundancyOptimizer and FSDP2.

    torchrun --nproc-per-node 2 -m course_lib.experiments.workers.zero_compare --tasks compare

(From Python: ``zero_common.run_workers``, which returns a typed ``zero_common.WorkerResult``.)
Tasks (``--tasks``, comma-separated, run in this order in one launch, to pay
for starting the processes once):

- ``compare``: every method of ``--methods`` trains the same tiny transformer from the same weights on the same
  global batches with Adam, and rank 0 the single-process reference (``dp_methods.compare_methods``). Reported per
  method (``dp_methods.MethodResult``): the mean loss per step, the largest parameter difference from the
  reference, the bytes each rank holds after a step, its peak during one whole step (``dp_methods.measure_step``),
  the bytes it sends per step (``comm`` ring formulas) and the step time;
- ``exact``: the same in float64 with two micro-batches per step, where rounding is too small to hide a real
  difference (see below), for ``--exact-steps`` steps (a wrong sum or update shows in the first step; the
  traffic it counts is per step);
- ``timeline``: when ZeroOptimizer's buckets leave during one backward, stages 1 and 2 (``zero_meters.bucket_timeline``);
- ``trace``: one profiled step of ZeRO-1 and of ZeRO-2, a Chrome trace per rank in ``--trace-dir``
  (``step_traces.trace_zero``);
- ``crash``, ``resume``, ``reshard``: sharded checkpoints (``checkpoint_runs.crash_run`` and the next two).

Why float64 for the equality check: the attention's key bias has a true
gradient of exactly zero (adding the same vector to every key shifts each row
of scores by a constant, which softmax ignores), so its float32 gradient is
pure rounding noise (about 1e-11 to 1e-10), whose value depends on the order
of the sums. Adam divides by the root of the squared gradient plus eps, so it
moves such a parameter by about lr * |g| / (|g| + eps) a step, in a direction
set by rounding: two correct implementations that sum in different orders
drift apart there by that much (chapter 09 prints it). In float64 the same
comparison agrees to about 1e-13.
"""

from __future__ import annotations

import argparse
import dataclasses

import torch

from course_lib.experiments import checkpoint_runs, launch
from course_lib.experiments.dp_methods import EXACT_METHODS, METHODS, compare_methods
from course_lib.experiments.run_config import RunConfig, build_model, local_batch
from course_lib.experiments.step_traces import trace_zero
from course_lib.experiments.workers.zero_common import TASKS, WorkerResult
from course_lib.experiments.zero_meters import BucketTimeline, bucket_timeline
from course_lib.models import lm_loss
from course_lib.parallel.sharding.zero import ZeroOptimizer


def timeline(cfg: RunConfig, rank: int, world: int, device: torch.device) -> list[BucketTimeline]:
    """One backward of the first batch under ZeroOptimizer stages 1 and 2, then a step."""
    out = []
    for stage in (1, 2):
        model = build_model(cfg, device)
        zopt = ZeroOptimizer(model, torch.optim.Adam, stage, bucket_cap_mb=cfg.bucket_mb, lr=cfg.lr)
        x, y = local_batch(cfg, 0, rank, world, device)
        out.append(bucket_timeline(zopt, model, lambda: lm_loss(model(x), y)))
        zopt.step()  # every rank takes part in the same collectives
    return out


def run_tasks(a: argparse.Namespace, rank: int, world: int, device: torch.device) -> WorkerResult:
    """Every task of ``a.tasks``, in order: one ``WorkerResult`` field each."""
    cfg, methods = RunConfig.from_json(a.cfg), launch.pick(a.methods, METHODS, "method")
    # float64, and two micro-batches per step where the rows allow: equal to Adam under accumulation too
    exact_cfg = dataclasses.replace(cfg, dtype="float64", accumulation=2 if cfg.batch % (2 * world) == 0 else 1,
                                    steps=a.exact_steps or cfg.steps)
    tasks = {
        "compare": lambda: compare_methods(cfg, methods, rank, world, device),
        "exact": lambda: compare_methods(exact_cfg, [m for m in methods if m in EXACT_METHODS], rank, world, device),
        "timeline": lambda: timeline(cfg, rank, world, device),
        "trace": lambda: trace_zero(cfg, rank, world, device, a.trace_dir),
        "crash": lambda: checkpoint_runs.crash_run(cfg, a.ckpt_dir, a.every, a.crash_at, device),
        "resume": lambda: checkpoint_runs.resume_run(cfg, a.ckpt_dir, device),
        "reshard": lambda: checkpoint_runs.reshard_load(cfg, a.ckpt_dir, device),
    }
    result = WorkerResult(world=world)
    for t in launch.pick(a.tasks, TASKS):
        if t in ("crash", "resume", "reshard") and not a.ckpt_dir:
            raise ValueError(f"task {t!r} needs --ckpt-dir")
        if t == "trace" and not a.trace_dir:
            raise ValueError("task 'trace' needs --trace-dir")
        setattr(result, t, tasks[t]())
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", default="compare", help=f"comma-separated from {TASKS}")
    parser.add_argument("--methods", default=",".join(METHODS[:5]), help=f"comma-separated from {METHODS}")
    parser.add_argument("--cfg", default=RunConfig().to_json(), help="RunConfig as JSON")
    parser.add_argument("--ckpt-dir", default=None, help="checkpoint folder for crash/resume/reshard")
    parser.add_argument("--exact-steps", type=int, default=0, help="steps of the exact task (0: the config's)")
    parser.add_argument("--every", type=int, default=2, help="checkpoint every this many steps")
    parser.add_argument("--crash-at", type=int, default=4, help="crash task: die while saving at this step")
    parser.add_argument("--trace-dir", default=None, help="trace task: folder for the ranks' trace files")
    launch.serve(parser, run_tasks, check=lambda a: launch.pick(a.methods, METHODS, "method"))


if __name__ == "__main__":
    main()
