"""One profiled training step per rank, written as Chrome traces (chapters 07 and 09).

    torchrun --nproc-per-node 2 -m course_lib.experiments.workers.step_trace --what ddp --out build/traces/ch07

``--what ddp`` traces ``NaiveDDP`` and ``BucketedDDP`` on an MLP, ``--what zero`` ZeRO-1 and ZeRO-2 on the tiny
transformer (``distributed.step_traces``), one file per rank and variant in ``--out``. Rank 0 reports the names of
its files and the world size; the parent reads the files back with ``trace.read_step``.
"""

from __future__ import annotations

import argparse

import torch

from course_lib.experiments import launch
from course_lib.experiments.run_config import RunConfig
from course_lib.experiments.step_traces import trace_ddp, trace_zero


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--what", choices=("ddp", "zero"), default="ddp")
    parser.add_argument("--out", required=True, help="folder for the trace files")
    parser.add_argument("--cfg", default=None, help="zero: an experiment.RunConfig as JSON")
    launch.serve(parser, run_trace)


def run_trace(a: argparse.Namespace, rank: int, world: int, device: torch.device) -> dict:
    if a.what == "ddp":
        return {"files": trace_ddp(rank, world, device, a.out), "world": world}
    files = trace_zero(RunConfig.from_json(a.cfg) if a.cfg else RunConfig(), rank, world, device, a.out)
    return {"files": files, "world": world}


if __name__ == "__main__":
    main()
