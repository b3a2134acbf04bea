"""BatchNorm under data parallelism: per-rank statistics against synchronised ones (chapter 07).

    torchrun --nproc-per-node 2 -m course_lib.experiments.workers.ddp_batchnorm --batch 4

Each rank takes ``--batch`` samples of one shared batch; a single process takes all of them. Rank 0 reports a
``BatchNormResult`` (``ddp_checks.batchnorm_checks``): the largest gradient difference to the single process with
plain per-rank BatchNorm, with ``sync_batchnorm.SyncBatchNorm2dByHand`` (and on GPUs with ``nn.SyncBatchNorm``),
and how far apart the ranks' running means drifted.
"""

from __future__ import annotations

import argparse

from course_lib.experiments import launch
from course_lib.experiments.ddp_checks import BatchNormResult, batchnorm_checks  # noqa: F401 (importable here)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=4, help="samples per rank")
    parser.add_argument("--seed", type=int, default=0)
    launch.serve(parser, lambda a, rank, world, device: batchnorm_checks(rank, world, device, a.batch, a.seed))


if __name__ == "__main__":
    main()
