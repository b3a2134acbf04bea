"""PipeDream (asynchronous 1F1B with weight stashing) on ``p`` gloo ranks, against synchronous training (chapter 08).

    torchrun --nproc-per-node 4 -m course_lib.experiments.workers.pipedream_run --microbatches 32 --flush-m 8 --seeds 0,1,2

For each seed the ranks train a ``TinyTransformer`` cut into ``p`` stages on
a stream of micro-batches (``--train-microbatches``) with PipeDream: 1F1B with no flush, every
stage stepping its optimizer after each backward, on gradients computed with
the weights it stashed for that micro-batch (``pipedream.WeightStash``). Rank 0
also trains the whole model on the same micro-batches with one synchronous
step each (what PipeDream would compute without staleness), and both are
evaluated on a held-out batch (``pipedream.train_seed``). Then, with every op padded to a fixed time,
the ranks run PipeDream over the ``n`` micro-batches once more, and
PipeDream-Flush (1F1B, one step every ``m`` micro-batches) over the same
``n``: their measured bubbles and makespans (``pipedream.timed_runs``). Rank 0 reports a ``PipeDreamResult``.
The ranks always run on the CPU (gloo): on a GPU the point would be the same.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

import torch

from course_lib.experiments import launch
from course_lib.experiments.pipedream_runs import SeedRun, TimedRun, timed_runs, train_seed
from course_lib.experiments.pipeline_model import add_model_args
from course_lib.experiments.results import WorkerResult


@dataclass
class PipeDreamResult(WorkerResult):
    world: int
    n: int                                 # micro-batches of the timed runs (= optimizer steps of PipeDream)
    flush_m: int                           # micro-batches per step of PipeDream-Flush
    seeds: list[SeedRun] = field(default_factory=list)
    timed: list[TimedRun] = field(default_factory=list)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--microbatches", type=int, default=32, help="micro-batches in the stream (n)")
    parser.add_argument("--train-microbatches", type=int, default=0,
                        help="micro-batches (steps) of the training comparison (0: --microbatches)")
    parser.add_argument("--flush-m", type=int, default=8, help="micro-batches per step of PipeDream-Flush")
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated seeds of the training comparison")
    parser.add_argument("--lr", type=float, default=3e-3)
    add_model_args(parser, microbatch_size=4, seed=False)
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
    timed_runs(a, a.flush_m, a.flush_m, a.seeds[0], rank, world, padded=False)  # warm-up
    for seed in a.seeds:
        run = train_seed(a, a.train_microbatches or a.microbatches, seed, rank, world)
        if run is not None:
            result.seeds.append(run)
    # on a shared machine another process can stall a rank: keep each kind's fastest of a few repeats
    tries = [timed_runs(a, a.microbatches, a.flush_m, a.seeds[0], rank, world) for _ in range(a.repeats)]
    if rank != 0:
        return None
    result.timed = [min((t[k] for t in tries), key=lambda r: r.makespan_s) for k in range(2)]
    return result


if __name__ == "__main__":
    main()
