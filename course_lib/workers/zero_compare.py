"""Chapter 09's experiment: one model trained by DDP, ZeRO-1, ZeRO-2, ZeroRedundancyOptimizer and FSDP2.

    torchrun --nproc-per-node 2 -m course_lib.workers.zero_compare --tasks compare

(From Python: ``zero_common.run_workers``, which returns a typed ``WorkerResult``.)
Every method (``course_lib.distributed.dp_methods``) trains the same tiny transformer
from the same weights on the same global batches (``experiment``: each rank its rows) with Adam. Rank 0 also trains the
single-process reference (Adam on the whole batch). Reported per method
(``dp_methods.MethodResult``): the mean loss per step, the largest parameter
difference from the reference, the bytes each rank holds after a step, its
peak during one whole step, the bytes it sends per step (``comm`` ring
formulas) and the step time.

Tasks (``--tasks``, comma-separated, run in this order in one launch, to pay
for starting the processes once):

- ``compare``: the methods above (``--methods`` picks them);
- ``exact``: the same in float64 with two micro-batches per step, where
  rounding is too small to hide a real difference (in float32 Adam turns
  rounding noise into visible steps, see below);
- ``timeline``: when ZeroOptimizer's buckets leave during one backward, stages 1 and 2;
- ``trace``: one profiled step of ZeRO-1 and of ZeRO-2, a Chrome trace per rank in ``--trace-dir``
  (``step_trace.trace_zero``);
- ``crash``, ``resume``, ``reshard``: sharded checkpoints (``dcp_checkpoint``).

The peak per rank is what this rank holds at the start of the measured step
(its model states and the batch: counted tensor by tensor) plus the highest
transient above that during ``zero_grad``, forward, backward and ``step``
(``memory.peak_bytes``: CUDA statistics on a GPU, the profiler's
allocation records on the CPU, paired by address, so that a buffer gloo's
threads free unseen stops counting when its address is handed out again).
Every method keeps its gradient buffers (zeroed, not freed) from step to
step, so what is resident at the start is exactly its model states; ``zero_grad`` still runs before the window as well, since the
CPU profiler cannot see the free of a tensor allocated before it started.

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
from typing import Callable

import torch

from course_lib import memory
from course_lib.distributed import launch
from course_lib.distributed.dp_methods import EXACT_METHODS, METHODS, run_method
from course_lib.distributed.experiment import RunConfig, build_model, local_batch, reference
from course_lib.distributed.results import max_abs_diff
from course_lib.distributed.zero import ZeroOptimizer
from course_lib.models import lm_loss
from course_lib.workers.step_trace import trace_zero
from course_lib.workers.zero_common import TASKS, BucketTimeline, CompareResult, WorkerResult


def compare(cfg: RunConfig, methods: list[str], rank: int, world: int, device: torch.device) -> CompareResult:
    """Every method; rank 0 also trains the reference and measures each method's distance from it and from DDP."""
    ref_losses, ref_params = reference(cfg) if rank == 0 else (None, None)
    num_params = sum(p.numel() for p in build_model(cfg).parameters())
    results, finals = {}, {}
    for name in methods:
        r, finals[name] = run_method(name, cfg, rank, world, device)
        if rank == 0:
            r.max_param_diff = max_abs_diff(finals[name], ref_params)
            r.max_loss_diff = max(abs(a - b) for a, b in zip(r.losses, ref_losses))
        results[name] = r
    if rank == 0 and "ddp" in finals:
        for name in methods:
            results[name].max_param_diff_vs_ddp = max_abs_diff(finals[name], finals["ddp"])
    return CompareResult(world=world, device=device.type, num_params=num_params, dtype=cfg.dtype,
                         accumulation=cfg.accumulation, ref_losses=ref_losses, methods=results)


def timeline(cfg: RunConfig, rank: int, world: int, device: torch.device) -> list[BucketTimeline]:
    """One backward under ZeroOptimizer stages 1 and 2: how many buckets had left as each gradient was computed."""
    out = []
    for stage in (1, 2):
        model = build_model(cfg, device)
        zopt = ZeroOptimizer(model, torch.optim.Adam, stage, bucket_cap_mb=cfg.bucket_mb, lr=cfg.lr)
        names: list[str] = []
        seen: list[int] = []
        for name, p in model.named_parameters():
            def computed(grad: torch.Tensor, name: str = name) -> None:  # before autograd accumulates it
                names.append(name)
                seen.append(zopt.counter.calls.get("reduce_scatter", 0))
            p.register_hook(computed)
        x, y = local_batch(cfg, 0, rank, world, device)
        zopt.zero_grad()
        lm_loss(model(x), y).backward()
        out.append(BucketTimeline(
            stage=stage, buckets=len(zopt.buckets), names=names, reduce_scatters_seen=seen,
            after_backward=zopt.counter.calls.get("reduce_scatter", 0),
            full_grad_bytes_after_backward=memory.grad_bytes(model),
            slice_grad_bytes=sum(memory.tensor_bytes(b.piece.grad) for b in zopt.buckets if b.piece.grad is not None)))
        zopt.step()  # every rank takes part in the same collectives
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", default="compare", help=f"comma-separated from {TASKS}")
    parser.add_argument("--methods", default=",".join(METHODS[:5]), help=f"comma-separated from {METHODS}")
    parser.add_argument("--cfg", default=RunConfig().to_json(), help="RunConfig as JSON")
    parser.add_argument("--ckpt-dir", default=None, help="checkpoint folder for crash/resume/reshard")
    parser.add_argument("--every", type=int, default=2, help="checkpoint every this many steps")
    parser.add_argument("--crash-at", type=int, default=4, help="crash task: die while saving at this step")
    parser.add_argument("--trace-dir", default=None, help="trace task: folder for the ranks' trace files")
    launch.serve(parser, run_tasks, check=lambda a: launch.pick(a.methods, METHODS, "method"))


def run_tasks(a: argparse.Namespace, rank: int, world: int, device: torch.device) -> WorkerResult:
    """Every task of ``a.tasks``, in order: one ``WorkerResult`` field each."""
    from course_lib.workers import dcp_checkpoint  # imported here: the checkpoint tasks are optional

    cfg, methods = RunConfig.from_json(a.cfg), launch.pick(a.methods, METHODS, "method")
    # float64, and two micro-batches per step where the rows allow: equal to Adam under accumulation too
    exact_cfg = dataclasses.replace(cfg, dtype="float64", accumulation=2 if cfg.batch % (2 * world) == 0 else 1)
    tasks_fn: dict[str, Callable[[], object]] = {
        "compare": lambda: compare(cfg, methods, rank, world, device),
        "exact": lambda: compare(exact_cfg, [m for m in methods if m in EXACT_METHODS], rank, world, device),
        "timeline": lambda: timeline(cfg, rank, world, device),
        "trace": lambda: trace_zero(cfg, rank, world, device, a.trace_dir),
        "crash": lambda: dcp_checkpoint.crash_run(cfg, a.ckpt_dir, a.every, a.crash_at, device),
        "resume": lambda: dcp_checkpoint.resume_run(cfg, a.ckpt_dir, device),
        "reshard": lambda: dcp_checkpoint.reshard_load(cfg, a.ckpt_dir, device),
    }
    result = WorkerResult(world=world)
    for t in launch.pick(a.tasks, TASKS):
        if t in ("crash", "resume", "reshard") and not a.ckpt_dir:
            raise ValueError(f"task {t!r} needs --ckpt-dir")
        if t == "trace" and not a.trace_dir:
            raise ValueError("task 'trace' needs --trace-dir")
        setattr(result, t, tasks_fn[t]())
    return result


if __name__ == "__main__":
    main()
