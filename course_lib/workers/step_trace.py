"""One profiled training step per rank, written as Chrome traces (chapters 07 and 09).

    torchrun --nproc-per-node 2 -m course_lib.workers.step_trace --what ddp --out build/traces/ch07

Each function profiles one step after one warm-up step (``trace.profile_steps``) with its parts marked by
``record_function`` (``forward``, ``backward``, ``sync``, ``optimizer``) and writes ``<variant>_rank<r>.json``
(DDP, ~100 kB each) or ``.json.gz`` (ZeRO, whose transformer runs many more ops) into ``out``, one file per rank:

- ``trace_ddp``: ``NaiveDDP`` (every gradient all-reduced after the backward) and ``BucketedDDP`` (buckets
  all-reduced from the gradient hooks, while the backward runs) on an MLP; ``ddp_compare --trace-dir`` calls it;
- ``trace_zero``: ZeRO-1 (the full gradient reduce-scattered in ``step``) and ZeRO-2 (each bucket
  reduce-scattered from the hooks as soon as it is full) on the chapter's tiny transformer;
  ``zero_compare --tasks trace`` calls it.

The parent reads the files back with ``trace.read_step``: the workers report only the names of the files.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.profiler import record_function

from course_lib.distributed import comm, launch
from course_lib.distributed.ddp import BucketedDDP, NaiveDDP
from course_lib.models import MLP, lm_loss
from course_lib.trace import profile_steps

DDP_VARIANTS = ("naive", "bucketed")
ZERO_VARIANTS = ("zero1", "zero2")


def trace_file(out: str | Path, variant: str, rank: int) -> Path:
    """Where rank ``rank``'s trace of ``variant`` goes (gzipped for the ZeRO variants: Perfetto reads either)."""
    return Path(out) / f"{variant}_rank{rank}.json{'.gz' if variant in ZERO_VARIANTS else ''}"


def _barrier_then(step):
    """``step`` after a barrier, so that every rank starts its step at the same moment (the rows line up)."""
    import torch.distributed as dist

    def run() -> None:
        dist.barrier()
        step()
    return run


def trace_ddp(rank: int, world: int, device: torch.device, out: str | Path, in_features: int = 512,
              hidden: tuple[int, ...] = (512,) * 4, batch: int = 32, buckets: int = 4, seed: int = 0) -> list[str]:
    """Trace one step of ``NaiveDDP`` and of ``BucketedDDP`` (about ``buckets`` equal buckets) on an MLP."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed + rank)
    x = torch.randn(batch, in_features, generator=g).to(device)
    y = torch.randint(0, 10, (batch,), generator=g).to(device)
    written = []
    for variant in DDP_VARIANTS:
        torch.manual_seed(seed)
        net = MLP(in_features, tuple(hidden)).to(device)
        grad_mb = sum(comm.nbytes(p) for p in net.parameters()) / 2**20
        # a cap of 1/buckets of the gradient, and no small first bucket: a few buckets of about equal size
        model = NaiveDDP(net) if variant == "naive" else BucketedDDP(net, bucket_cap_mb=grad_mb / buckets,
                                                                     first_bucket_mb=None)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)

        def step(model=model, opt=opt) -> None:
            opt.zero_grad(set_to_none=True)
            with record_function("forward"):
                loss = F.cross_entropy(model(x), y)
            with record_function("backward"):
                loss.backward()
            with record_function("sync"):  # NaiveDDP sends everything here; BucketedDDP waits for what is left
                model.finish_gradient_synchronization()
            with record_function("optimizer"):
                opt.step()
        path = trace_file(out, variant, rank)
        profile_steps(_barrier_then(step), path, device=device.type)
        written.append(path.name)
    return written


def trace_zero(cfg, rank: int, world: int, device: torch.device, out: str | Path) -> list[str]:
    """Trace one step of ZeRO-1 and of ZeRO-2 (``ZeroOptimizer``) on ``cfg``'s tiny transformer (a ``RunConfig``)."""
    from course_lib.distributed.zero import ZeroOptimizer
    from course_lib.distributed.experiment import build_model, local_batch

    x, y = local_batch(cfg, 0, rank, world, device)
    written = []
    for variant in ZERO_VARIANTS:
        model = build_model(cfg, device)
        zopt = ZeroOptimizer(model, torch.optim.Adam, 1 if variant == "zero1" else 2, bucket_cap_mb=cfg.bucket_mb,
                             lr=cfg.lr)

        def step(model=model, zopt=zopt) -> None:
            zopt.zero_grad()
            with record_function("forward"):
                loss = lm_loss(model(x), y)
            with record_function("backward"):  # ZeRO-2's hooks start each full bucket's reduce-scatter in here
                loss.backward()
            with record_function("optimizer"):  # ZeRO-1's reduce-scatter, the update, the all-gathers
                zopt.step()
        path = trace_file(out, variant, rank)
        profile_steps(_barrier_then(step), path, device=device.type)
        written.append(path.name)
    return written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--what", choices=("ddp", "zero"), default="ddp")
    parser.add_argument("--out", required=True, help="folder for the trace files")
    parser.add_argument("--cfg", default=None, help="zero: an experiment.RunConfig as JSON")
    launch.serve(parser, run_trace)


def run_trace(a: argparse.Namespace, rank: int, world: int, device: torch.device) -> dict:
    if a.what == "ddp":
        return {"files": trace_ddp(rank, world, device, a.out), "world": world}
    from course_lib.distributed.experiment import RunConfig
    files = trace_zero(RunConfig.from_json(a.cfg) if a.cfg else RunConfig(), rank, world, device, a.out)
    return {"files": files, "world": world}


if __name__ == "__main__":
    main()
