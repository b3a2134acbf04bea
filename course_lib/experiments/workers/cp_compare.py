"""Chapter 12's context-parallel experiment: ring attention over the launch's ranks, against one process.

    torchrun --nproc-per-node 4 -m course_lib.experiments.workers.cp_compare --tasks exact,saved,train,api,overlap

Tasks (``--tasks``, in this order, in one launch); rank 0 reports one ``CPReport``:

- ``exact``: for each layout (plain, zigzag), ring attention and the tiny transformer's loss and gradients in
  float64 against one process; the pairs and scores each rank computed; the bytes sent per layer (float32);
- ``saved``: the bytes one block saves for the backward on each rank, against one process;
- ``train``: the config's steps of Adam (zigzag, float32) against one process: losses, seconds, bytes sent, the peak
  and the states per rank; ``--dp`` data-parallel groups of rings, ``--zero-stage`` 0-2 over all the ranks;
- ``api``: torch's ``context_parallel`` on the same model: losses and gradients, or the error it raises;
- ``overlap``: ring attention alone, timed: the seconds spent computing tiles and waiting for hops, and a hop alone.

The runs and their checks are ``course_lib.experiments.cp_checks``.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field

import torch

from course_lib.parallel.context_parallel import layout as cp_layout
from course_lib.experiments import cp_checks
from course_lib.experiments import launch
from course_lib.experiments.cp_checks import LayoutResult
from course_lib.experiments.run_config import RunConfig
from course_lib.experiments.results import WorkerResult
from course_lib.env import seed_everything

TASKS = ("exact", "saved", "train", "api", "overlap")


@dataclass
class CPReport(WorkerResult):
    world: int
    seq_len: int
    layouts: list[LayoutResult] = field(default_factory=list)
    saved: dict[str, list[int]] = field(default_factory=dict)  # per rank: cp; one value: one_process, naive, fused
    train: dict = field(default_factory=dict)
    api: dict = field(default_factory=dict)
    overlap: dict = field(default_factory=dict)

    def layout(self, name: str) -> LayoutResult:
        return next(r for r in self.layouts if r.layout == name)


def _check(a: argparse.Namespace) -> None:
    """Refuse ``--dp`` before any rank waits for another (from the launch's ``WORLD_SIZE``)."""
    launch.pick(a.tasks, TASKS)
    world, batch = int(os.environ.get("WORLD_SIZE", "1")), RunConfig.from_json(a.cfg).batch
    if a.dp < 1 or world % a.dp or batch % a.dp:
        raise ValueError(f"--dp {a.dp} must divide the {world} ranks and the batch of {batch} sequences")


def run_tasks(a: argparse.Namespace, rank: int, world: int, device: torch.device) -> CPReport:
    """Every task of ``a.tasks``, in order: one ``CPReport``."""
    cfg, tasks = RunConfig.from_json(a.cfg), launch.pick(a.tasks, TASKS)
    # a clear error on every rank before any message: the saved and train tasks' rings have world/dp ranks
    for ring_ranks in {world // a.dp if t in ("saved", "train") else world for t in tasks}:
        cp_layout.check_layout(cfg.seq_len, ring_ranks)
    seed_everything(cfg.seed)
    report = CPReport(world=world, seq_len=cfg.seq_len)
    if "exact" in tasks:
        report.layouts = [cp_checks.run_layout(cfg, layout, device) for layout in cp_layout.LAYOUTS]
    if "saved" in tasks:
        report.saved = cp_checks.run_saved(cfg, device, a.dp)
    if "train" in tasks:
        report.train = cp_checks.run_train(cfg, device, a.dp, a.zero_stage)
    if "api" in tasks:
        report.api = cp_checks.run_api(cfg, device)
    if "overlap" in tasks:
        report.overlap = cp_checks.run_overlap(cfg, device)
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", default=",".join(TASKS), help=f"comma-separated: {', '.join(TASKS)}")
    parser.add_argument("--cfg", default=RunConfig().to_json(), help="RunConfig as JSON (seq_len: the whole sequence)")
    parser.add_argument("--dp", type=int, default=1, help="saved, train: data-parallel groups of world/dp ring ranks")
    parser.add_argument("--zero-stage", type=int, default=0, help="train: 0 (all-reduce), 1 or 2 (ZeroOptimizer)")
    launch.serve(parser, run_tasks, check=_check)


if __name__ == "__main__":
    main()
