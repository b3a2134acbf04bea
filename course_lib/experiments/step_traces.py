"""One profiled training step per rank, written as Chrome traces (chapters 07 and 09; ``workers.step_trace``).

Each function profiles one step after one warm-up step (``trace.profile_steps``) with its parts marked by
``record_function`` (``forward``, ``backward``, ``sync``, ``optimizer``) and writes ``<variant>_rank<r>.json``
(DDP, ~100 kB each) or ``.json.gz`` (ZeRO, whose transformer runs many more ops) into ``out``, one file per rank:

- ``trace_ddp``: ``NaiveDDP`` (every gradient all-reduced after the backward, in ``sync``) and ``BucketedDDP``
  (buckets all-reduced from the gradient hooks, while the backward runs; ``sync`` waits for what is left) on an MLP;
- ``trace_zero``: ZeRO-1 (the full gradient reduce-scattered in ``optimizer``, with the update and the
  all-gathers) and ZeRO-2 (each bucket reduce-scattered from the hooks, inside ``backward``, as soon as it is
  full) on the chapter's tiny transformer.

The parent reads the files back with ``trace.read_step``: the workers report only the names of the files.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.profiler import record_function

from course_lib.parallel import collectives as comm
from course_lib.parallel.data_parallel.ddp import BucketedDDP, NaiveDDP
from course_lib.experiments.ddp_checks import labelled
from course_lib.experiments.run_config import RunConfig, build_model, local_batch
from course_lib.parallel.sharding.zero import ZeroOptimizer
from course_lib.models import MLP, lm_loss
from course_lib.trace import profile_steps

DDP_VARIANTS = ("naive", "bucketed")
ZERO_VARIANTS = ("zero1", "zero2")


def trace_file(out: str | Path, variant: str, rank: int) -> Path:
    """Where rank ``rank``'s trace of ``variant`` goes (gzipped for the ZeRO variants: Perfetto reads either)."""
    return Path(out) / f"{variant}_rank{rank}.json{'.gz' if variant in ZERO_VARIANTS else ''}"


def profile_marked_step(out: str | Path, variant: str, rank: int, device: torch.device, zero_grad: Callable,
                        loss: Callable[[], torch.Tensor], step: Callable, sync: Callable | None = None) -> str:
    """Profile ``zero_grad()``, ``loss()`` (marked ``forward``), its ``backward``, ``sync()`` and the optimizer's
    ``step()`` into ``trace_file(out, variant, rank)``; the file's name."""
    def run() -> None:
        dist.barrier()  # every rank starts its step at the same moment: the ranks' rows line up
        zero_grad()
        with record_function("forward"):
            value = loss()
        with record_function("backward"):
            value.backward()
        if sync is not None:
            with record_function("sync"):
                sync()
        with record_function("optimizer"):
            step()
    path = trace_file(out, variant, rank)
    profile_steps(run, path, device=device.type)
    return path.name


def trace_ddp(rank: int, world: int, device: torch.device, out: str | Path, in_features: int = 512,
              hidden: tuple[int, ...] = (512,) * 4, batch: int = 32, buckets: int = 4, seed: int = 0) -> list[str]:
    """Trace one step of ``NaiveDDP`` and of ``BucketedDDP`` (about ``buckets`` equal buckets) on an MLP."""
    x, y = labelled(torch.Generator().manual_seed(seed + rank), (batch,), (in_features,), device)
    written = []
    for variant in DDP_VARIANTS:
        torch.manual_seed(seed)
        net = MLP(in_features, tuple(hidden)).to(device)
        grad_mb = sum(comm.nbytes(p) for p in net.parameters()) / 2**20
        # a cap of 1/buckets of the gradient, and no small first bucket: a few buckets of about equal size
        model = NaiveDDP(net) if variant == "naive" else BucketedDDP(net, bucket_cap_mb=grad_mb / buckets,
                                                                     first_bucket_mb=None)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        written.append(profile_marked_step(out, variant, rank, device, lambda: opt.zero_grad(set_to_none=True),
                                           lambda: F.cross_entropy(model(x), y), opt.step,
                                           model.finish_gradient_synchronization))
    return written


def trace_zero(cfg: RunConfig, rank: int, world: int, device: torch.device, out: str | Path) -> list[str]:
    """Trace one step of ZeRO-1 and of ZeRO-2 (``ZeroOptimizer``) on ``cfg``'s tiny transformer."""
    x, y = local_batch(cfg, 0, rank, world, device)
    written = []
    for variant in ZERO_VARIANTS:
        model = build_model(cfg, device)
        zopt = ZeroOptimizer(model, torch.optim.Adam, 1 if variant == "zero1" else 2, bucket_cap_mb=cfg.bucket_mb,
                             lr=cfg.lr)
        written.append(profile_marked_step(out, variant, rank, device, zopt.zero_grad,
                                           lambda: lm_loss(model(x), y), zopt.step))
    return written
