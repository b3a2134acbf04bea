"""NaiveDDP, BucketedDDP, DynamicBucketedDDP and torch DDP against one process on the whole batch (chapter 07).

    torchrun --nproc-per-node 2 -m course_lib.experiments.workers.ddp_compare --steps 3

Rank 0 reports a ``CompareResult``:

- ``equal``: for three models that stress a DDP wrapper (a frozen layer and a
  block used twice; the same block inside a reentrant checkpoint, so its
  gradient hooks fire twice per step; an auxiliary head used on odd steps
  only), the largest gradient and parameter differences to a single process
  that trains on the concatenation of every rank's batch (``SUPPORTED`` says
  which scenarios each wrapper is built for);
- ``timing``: median step time of each wrapper on an MLP (``--timing-*``),
  with the bytes each sends per step, by the ring formula and by a spy on
  ``dist.all_reduce``;
- ``no_sync``: all-reduce calls for k accumulated micro-batches, with and
  without ``no_sync()``;
- ``batchnorm`` (with ``--bn``): see ``ddp_batchnorm``;
- ``trace`` (with ``--trace-dir``): one profiled step of NaiveDDP and BucketedDDP on the timing MLP, a Chrome
  trace per rank in that folder (``step_traces.trace_ddp``).

The checks are ``ddp_checks``'s; this script runs those its options ask for.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from course_lib.experiments import ddp_checks
from course_lib.experiments import launch
from course_lib.experiments.ddp_checks import SUPPORTED, BatchNormResult, NoSync, Timing, WrapperRun  # noqa: F401
from course_lib.experiments.results import WorkerResult
from course_lib.experiments.step_traces import trace_ddp


@dataclass
class CompareResult(WorkerResult):
    world: int
    backend: str
    equal: dict[str, dict[str, WrapperRun]] = field(default_factory=dict)  # scenario -> wrapper -> run
    no_sync: NoSync | None = None
    timing: Timing | None = None
    batchnorm: BatchNormResult | None = None
    trace: list[str] = field(default_factory=list)  # rank 0's trace files (one per rank each, in --trace-dir)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8, help="samples per rank for the equality checks")
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps for the equality checks")
    parser.add_argument("--timing-batch", type=int, default=32)
    parser.add_argument("--timing-in", type=int, default=512)
    parser.add_argument("--timing-hidden", type=int, nargs="+", default=[512] * 4)
    parser.add_argument("--timing-rounds", type=int, default=3, help="0 skips the timing")
    parser.add_argument("--timing-steps", type=int, default=5)
    parser.add_argument("--cap-mb", type=float, default=None,
                        help="bucket size in MiB for the timing (default: each wrapper's, 25 with a first bucket of 1)")
    parser.add_argument("--accum", type=int, default=4, help="micro-batches per step for the no_sync count")
    parser.add_argument("--bn", action="store_true", help="also run the BatchNorm checks")
    parser.add_argument("--timing-only", action="store_true", help="skip the equality and no_sync checks")
    parser.add_argument("--trace-dir", default=None, help="also profile one step of naive and bucketed DDP there")
    parser.add_argument("--seed", type=int, default=0)
    launch.serve(parser, run_checks)


def run_checks(a: argparse.Namespace, rank: int, world: int, device: torch.device) -> CompareResult:
    """The checks ``a`` asks for, on CPU + gloo or on a GPU per rank + NCCL."""
    result = CompareResult(world, dist.get_backend())
    if not a.timing_only:
        result.equal = {name: ddp_checks.compare_scenario(name, rank, world, a.batch, a.steps, a.seed, device)
                        for name in ddp_checks.SCENARIOS}
        result.no_sync = ddp_checks.no_sync_counts(rank, world, a.batch, a.accum, steps=2, seed=a.seed, device=device)
    if a.timing_rounds > 0:
        result.timing = ddp_checks.time_wrappers(world, rank, a.timing_batch, a.timing_in, a.timing_hidden,
                                                 a.timing_rounds, a.timing_steps, a.cap_mb, a.seed, device)
    if a.bn:
        result.batchnorm = ddp_checks.batchnorm_checks(rank, world, device, batch=4, seed=a.seed)
    if a.trace_dir:
        result.trace = trace_ddp(rank, world, device, a.trace_dir, a.timing_in, tuple(a.timing_hidden),
                                 a.timing_batch, seed=a.seed)
    return result


if __name__ == "__main__":
    main()
