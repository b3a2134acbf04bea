"""Freeze training on a real pipeline, then the pipeline repacked (chapter 08; ``pipeline.freeze``).

    torchrun --nproc-per-node 4 -m course_lib.experiments.workers.pipeline_freeze_run --frozen-stages 2 --microbatches 8

Chapter 08 runs ``pipeline_freeze.freeze_steps`` inside ``pipeline_run``'s launch (``--freeze-stages``), sparing
the start of another group of processes. On ``p`` ranks, with the first ``k`` stages of the chapter's
``TinyTransformer`` frozen:

1. **frozen in place**: one step of ``pipeline.freeze.frozen_schedule`` (1F1B, the first ``k`` stages
   forwards only) with ``pipeline.executor.run_stage``, once with every op's ATen ops counted (``m = p``,
   unpadded) and then padded, timed, the fastest of ``--repeats``;
2. **repacked**: the active layers in ``pipeline.freeze.repack``'s fewer stages, the freed ranks as
   data-parallel replicas (each a pipeline of its own on its ranks, over its share of the micro-batches),
   the gradients all-reduced between the replicas' matching stages; the first stage of each replica
   reads the frozen prefix's outputs from an ``ActivationCache`` filled once, before the first step.

Both are checked against one sequential step of the same model with the prefix frozen; rank 0 reports a
``FreezeRun``.
"""

from __future__ import annotations

import argparse

import torch

from course_lib.experiments import launch
from course_lib.experiments.clock import clock_for
from course_lib.experiments.pipeline_freeze import FreezeRun, freeze_steps
from course_lib.experiments.pipeline_model import add_model_args


def work(a: argparse.Namespace, rank: int, world: int, device: torch.device) -> FreezeRun | None:
    torch.set_num_threads(1)                       # p ranks share the cores: one thread each
    return freeze_steps(a, a.frozen_stages, a.microbatches, a.repeats, rank, world, device, clock_for(device))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--frozen-stages", type=int, default=1)
    parser.add_argument("--microbatches", type=int, default=4)
    add_model_args(parser)
    parser.add_argument("--repeats", type=int, default=1, help="run each padded step this often, keep the fastest")
    launch.serve(parser, work)


if __name__ == "__main__":
    main()
