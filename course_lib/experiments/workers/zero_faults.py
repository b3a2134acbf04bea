"""ZeroOptimizer on two ranks: when they do not all do the same thing, and what it sends (chapter 09).

    torchrun --nproc-per-node 2 -m course_lib.experiments.workers.zero_faults --pg-timeout 30

Four cases (``--cases``), in one launch on two ranks, each a function of ``course_lib.experiments.zero_checks``:
``skip`` (rank 1 skips micro-batches and a backward under stage 2), ``twice`` (a gradient arrives twice on rank 1
only), ``clip`` (sharded gradient clipping against one process's), all three with ``GuardedZeroOptimizer``; and
``count`` (the collectives of a step of the plain ``ZeroOptimizer``). Rank 0 reports ``FaultChecks``: what every
rank saw in each case (tests/test_zero_faults.py).

The process-group timeout (``--pg-timeout``) turns a rank left waiting into an
error, so a regression fails the launch instead of hanging it.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch

from course_lib.experiments import launch
from course_lib.experiments.results import WorkerResult
from course_lib.experiments.zero_checks import (ClipCase, CountCase, SkipCase, TwiceCase, clip_case, count_case,
                                                skip_case, twice_case)

CASES = {"skip": skip_case, "twice": twice_case, "clip": clip_case, "count": count_case}


@dataclass
class FaultChecks(WorkerResult):
    skip: SkipCase | None = None
    twice: TwiceCase | None = None
    clip: ClipCase | None = None
    count: CountCase | None = None


def run_cases(a: argparse.Namespace, rank: int, world: int, device: torch.device) -> FaultChecks:
    if world != 2:
        raise ValueError(f"zero_faults runs on 2 ranks, got {world}")
    result = FaultChecks()
    for name in launch.pick(a.cases, tuple(CASES), "case"):
        setattr(result, name, CASES[name](rank, world))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated from {tuple(CASES)}")
    launch.serve(parser, run_cases)


if __name__ == "__main__":
    main()
