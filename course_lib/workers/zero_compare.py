"""Chapter 09's experiment: one model trained by DDP, ZeRO-1, ZeRO-2, ZeroRedundancyOptimizer and FSDP2.

    torchrun --nproc-per-node 2 -m course_lib.workers.zero_compare --tasks compare

(From Python: ``zero_common.run_workers``, which returns a typed ``WorkerResult``.)
Every method trains the same tiny transformer from the same weights on the
same global batches (each rank its rows) with Adam. Rank 0 also trains the
single-process reference (Adam on the whole batch). Reported per method
(``zero_common.MethodResult``): the mean loss per step, the largest parameter
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
import contextlib
import dataclasses
import functools
import statistics
from typing import Callable

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from course_lib import memory
from course_lib.distributed import comm, launch
from course_lib.distributed.ddp import counting_allreduce_hook
from course_lib.distributed.results import gather_per_rank, max_abs_diff, mean_over_ranks
from course_lib.distributed.zero import (ZeroOptimizer, count_broadcasts, count_fsdp_traffic, held_bytes,
                                         shard_fsdp2)
from course_lib.models import lm_loss
from course_lib.timing import time_s
from course_lib.workers.step_trace import trace_zero
from course_lib.workers.zero_common import (TASKS, BucketTimeline, CompareResult, MethodResult, RunConfig,
                                            WorkerResult, build_model, local_batch, reference)

# zero2_sync: ZeroOptimizer stage 2 waiting for each reduce-scatter at once (max_in_flight=0), to price the overlap
METHODS = ("ddp", "zero1", "zero2", "zero_redundancy", "fsdp2", "fsdp2_keep", "fsdp2_bf16", "zero2_sync")
EXACT_METHODS = ("ddp", "zero1", "zero2", "zero_redundancy", "fsdp2")  # fp32 ones, to repeat in float64
# The steps whose peak is measured: from step 1 on Adam's state exists, and DDP rebuilds its buckets in the
# forward of step 1 (freeing buffers allocated before the window, which the CPU profiler would not see).
# On the CPU each measurement errs high for this thread's tensors (``memory.replay_allocations``: a buffer gloo frees
# on its own thread counts until its address is reused); the lower of two is the tighter one. Gloo makes its
# buffers on the calling thread, so none is missed; a tensor made on another thread would be. ZeRO-2's and FSDP2's
# asynchronous collectives also free their buffers when gloo's thread gets to them: the lowest of up to four
# measured steps is the one where they were freed in time.
MEASURED_STEPS = (2, 3, 4, 5)


def forward_backward(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, micro_batches: int,
                     no_sync: Callable[[], contextlib.AbstractContextManager] | None = None) -> float:
    """Forward and backward over ``micro_batches`` equal micro-batches of this rank's rows; the mean loss.

    ``no_sync`` (DDP's) skips the gradient all-reduce for all but the last micro-batch.
    """
    total = 0.0
    for i, (xm, ym) in enumerate(zip(x.chunk(micro_batches), y.chunk(micro_batches))):
        quiet = no_sync is not None and i < micro_batches - 1
        with no_sync() if quiet else contextlib.nullcontext():
            logits = model(xm)
            loss = lm_loss(logits.float() if logits.dtype == torch.bfloat16 else logits, ym) / micro_batches
            loss.backward()
        total += loss.item()
    return total


@dataclasses.dataclass
class _Method:
    model: torch.nn.Module
    zero_grad: Callable[[], None]
    step: Callable[[torch.Tensor, torch.Tensor], float]  # zero_grad, forward, backward, optimizer step
    held: Callable[[], dict[str, int]]
    counter: comm.ByteCounter


def _setup(method: str, cfg: RunConfig, device: torch.device) -> _Method:
    """The model, its step and meters for ``method``."""
    counter = comm.ByteCounter()
    model = build_model(cfg, device)
    no_sync, sync_counter = None, contextlib.nullcontext
    if method in ("zero1", "zero2", "zero2_sync"):
        opt = ZeroOptimizer(model, torch.optim.Adam, 1 if method == "zero1" else 2, bucket_cap_mb=cfg.bucket_mb,
                            lr=cfg.lr, **({"max_in_flight": 0} if method == "zero2_sync" else {}))
        zero_grad, held, counter = opt.zero_grad, opt.state_bytes, opt.counter  # stage 2: reduce-scatters in backward
    else:
        if method in ("ddp", "zero_redundancy"):
            # gradient_as_bucket_view: the buckets *are* the .grad tensors, else DDP holds the gradients twice
            model = DDP(model, gradient_as_bucket_view=True)
            model.register_comm_hook(None, counting_allreduce_hook(counter))
            no_sync = model.no_sync  # accumulate locally, all-reduce once
            sync_counter = functools.partial(count_broadcasts, counter)  # ZeroRedundancyOptimizer's broadcasts
            if method == "zero_redundancy":
                from torch.distributed.optim import ZeroRedundancyOptimizer
                opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam, lr=cfg.lr)
        elif method.startswith("fsdp2"):
            mp = None
            if method == "fsdp2_bf16":
                from torch.distributed.fsdp import MixedPrecisionPolicy
                # gather and compute in bf16, reduce the gradients in fp32 (the usual recipe)
                mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            shard_fsdp2(model, reshard_after_forward=(method != "fsdp2_keep"), mp_policy=mp)
            count_fsdp_traffic(model, counter)  # FSDP2 reduce-scatters after every micro-batch by default
        else:
            raise ValueError(f"unknown method {method!r}; choose from {', '.join(METHODS)}")
        if method != "zero_redundancy":
            opt = torch.optim.Adam(model.parameters(), lr=cfg.lr)

        def zero_grad() -> None:  # keep the gradient buffers: DDP's bucket views, FSDP2's 1/N shards
            opt.zero_grad(set_to_none=False)

        def held() -> dict[str, int]:
            return held_bytes(model, opt)

    def step(x: torch.Tensor, y: torch.Tensor) -> float:
        zero_grad()
        loss = forward_backward(model, x, y, cfg.accumulation, no_sync)
        with sync_counter():
            opt.step()
        return loss
    return _Method(model, zero_grad, step, held, counter)


def measure_step(m: _Method, x: torch.Tensor, y: torch.Tensor, device: torch.device) -> tuple[int, int, float]:
    """One step of ``m``: (bytes resident at its start, its peak bytes, its loss)."""
    m.zero_grad()  # what the step's zero_grad frees, freed before the window (see the module docstring)
    resident = sum(m.held().values()) + memory.tensor_bytes(x) + memory.tensor_bytes(y)
    box: list[float] = []
    transient = memory.peak_bytes(lambda: box.append(m.step(x, y)), device)
    return resident, resident + transient, box[0]


def _full_params(model: torch.nn.Module) -> list[torch.Tensor]:
    """Full parameter values on every rank (FSDP2's DTensors gathered: a collective)."""
    return [(p.full_tensor() if hasattr(p, "full_tensor") else p).detach() for p in model.parameters()]


def run_method(method: str, cfg: RunConfig, rank: int, world: int,
               device: torch.device) -> tuple[MethodResult, list[torch.Tensor]]:
    """Train ``cfg.steps`` steps with ``method``; return its result (rank 0's is complete) and final params."""
    m = _setup(method, cfg, device)
    measured = [s for s in MEASURED_STEPS if s < cfg.steps] or [cfg.steps - 1]
    losses, times, resident, peak = [], [], 0, None
    for s in range(cfg.steps):
        x, y = local_batch(cfg, s, rank, world, device)
        dist.barrier()  # start every rank's step together so the time is the step's, not the wait's
        if s in measured:
            resident, p, loss = measure_step(m, x, y, device)  # profiled: not timed
            peak = p if peak is None else min(peak, p)
        else:
            box: list[float] = []
            times.append(time_s(lambda: box.append(m.step(x, y)), device))  # CUDA events on a GPU rank
            loss = box[0]
        losses.append(mean_over_ranks(loss, device))
    timed = times[1:] if len(times) > 1 else times  # the first step pays for first-call allocations
    steps = cfg.steps
    batch = sum(memory.tensor_bytes(t) for t in local_batch(cfg, 0, rank, world))
    result = MethodResult(losses=losses, held=gather_per_rank(m.held()), resident=gather_per_rank(resident),
                          batch_bytes=gather_per_rank(batch),
                          peak=gather_per_rank(peak), sent_per_step=gather_per_rank(m.counter.bytes / steps),
                          sent_by_op={k: v / steps for k, v in m.counter.by_op.items()},
                          calls_per_step={k: v / steps for k, v in m.counter.calls.items()},
                          step_s=statistics.median(timed) if timed else float("nan"))
    model = m.model.module if isinstance(m.model, DDP) else m.model
    full = [p.to("cpu", torch.float64) for p in _full_params(model)]
    if method == "fsdp2":
        p = model.blocks[0].mlp[0].weight  # what a sharded parameter is
        result.example_param = {"type": type(p).__name__, "placements": str(p.placements),
                                "global_shape": list(p.shape), "local_shape": list(p.to_local().shape)}
    return result, full


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
