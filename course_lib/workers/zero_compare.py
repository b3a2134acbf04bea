"""Chapter 08's experiment: one model trained by DDP, ZeRO-1, ZeRO-2, ZeroRedundancyOptimizer and FSDP2.

    torchrun --nproc-per-node 2 -m course_lib.workers.zero_compare --tasks compare

Every method trains the same tiny transformer from the same weights on the
same global batches (each rank its rows) with Adam. Rank 0 also trains the
single-process reference (Adam on the whole batch). Reported per method:
the mean loss per step, the largest parameter difference from the reference,
the bytes each rank holds (params, grads, optimizer state), the bytes each
rank sends per step (``comm`` ring formulas) and the step time.

Tasks (``--tasks``, comma-separated, run in this order in one launch, to pay
for starting the processes once):

- ``compare``: the methods above (``--methods`` picks them);
- ``exact``: the same in float64, where rounding is too small to hide a real
  difference (in float32 Adam turns rounding noise into visible steps, see below);
- ``crash``, ``resume``, ``reshard``: sharded checkpoints (``dcp_checkpoint``).

Why float64 for the equality check: the attention's key bias has a true
gradient of exactly zero (adding the same vector to every key shifts each row
of scores by a constant, which softmax ignores), so its float32 gradient is
pure rounding noise, about 1e-10, whose value depends on the order of the
sums. Adam divides by the root of the squared gradient, so noise becomes
steps of about the learning rate in a random direction: two correct
implementations that sum in different orders drift apart by ~lr there. In
float64 the same comparison agrees to about 1e-13.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from typing import Callable, Iterator

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from course_lib.distributed import comm, launch
from course_lib.distributed.zero import ZeroOptimizer, count_fsdp_traffic, counting_allreduce_hook, held_bytes
from course_lib.models import lm_loss
from course_lib.workers.zero_common import (RunConfig, build_model, gather_per_rank, global_batch, local_batch,
                                            mean_over_ranks, shard_fsdp2)

METHODS = ("ddp", "zero1", "zero2", "zero_redundancy", "fsdp2", "fsdp2_keep", "fsdp2_bf16")
EXACT_METHODS = ("ddp", "zero1", "zero2", "zero_redundancy", "fsdp2")  # fp32 ones, to repeat in float64


def reference(cfg: RunConfig) -> tuple[list[float], list[torch.Tensor]]:
    """Single-process Adam on the whole batch: losses and final parameters (what every method must equal)."""
    model = build_model(cfg)
    opt = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    losses = []
    for step in range(cfg.steps):
        x, y = global_batch(cfg, step)
        opt.zero_grad()
        loss = lm_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, [p.detach().clone() for p in model.parameters()]


@contextlib.contextmanager
def count_broadcasts(counter: comm.ByteCounter) -> Iterator[None]:
    """Count every ``dist.broadcast`` made inside the block (ZeroRedundancyOptimizer's parameter sync)."""
    original = dist.broadcast

    def counted(tensor, src, *args, **kwargs):
        counter.add("broadcast", comm.ring_factor("broadcast", dist.get_world_size()) * comm.nbytes(tensor))
        return original(tensor, src, *args, **kwargs)

    dist.broadcast = counted
    try:
        yield
    finally:
        dist.broadcast = original


def _setup(method: str, cfg: RunConfig, device: torch.device):
    """Model, a step function ``step(x, y) -> loss``, the byte counter and a ``held()`` meter for ``method``."""
    counter = comm.ByteCounter()
    model = build_model(cfg, device)
    if method in ("ddp", "zero_redundancy"):
        # gradient_as_bucket_view: the buckets *are* the .grad tensors, else DDP holds the gradients twice
        model = DDP(model, gradient_as_bucket_view=True)
        model.register_comm_hook(None, counting_allreduce_hook(counter))
        if method == "ddp":
            opt = torch.optim.Adam(model.parameters(), lr=cfg.lr)
        else:
            from torch.distributed.optim import ZeroRedundancyOptimizer
            opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam, lr=cfg.lr)

        def step(x, y):
            opt.zero_grad(set_to_none=False)  # keep the bucket views
            loss = lm_loss(model(x), y)
            loss.backward()
            with count_broadcasts(counter):
                opt.step()
            return loss
        return model, step, counter, lambda: held_bytes(model, opt)
    if method in ("zero1", "zero2"):
        zopt = ZeroOptimizer(model, torch.optim.Adam, int(method[-1]), lr=cfg.lr)
        counter = zopt.counter

        def step(x, y):
            zopt.zero_grad()
            loss = lm_loss(model(x), y)
            loss.backward()
            zopt.step()
            return loss
        return model, step, counter, zopt.state_bytes
    if method.startswith("fsdp2"):
        mp = None
        if method == "fsdp2_bf16":
            from torch.distributed.fsdp import MixedPrecisionPolicy
            # gather and compute in bf16, reduce the gradients in fp32 (the usual recipe)
            mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        shard_fsdp2(model, reshard_after_forward=(method != "fsdp2_keep"), mp_policy=mp)
        count_fsdp_traffic(model, counter)
        opt = torch.optim.Adam(model.parameters(), lr=cfg.lr)

        def step(x, y):
            opt.zero_grad()
            logits = model(x)
            loss = lm_loss(logits.float() if logits.dtype == torch.bfloat16 else logits, y)
            loss.backward()
            opt.step()
            return loss
        return model, step, counter, lambda: held_bytes(model, opt)
    raise ValueError(f"unknown method {method!r}; choose from {', '.join(METHODS)}")


def _full_params(model: torch.nn.Module) -> list[torch.Tensor]:
    """Full parameter values on every rank (FSDP2's DTensors gathered: a collective)."""
    return [(p.full_tensor() if hasattr(p, "full_tensor") else p).detach() for p in model.parameters()]


def run_method(method: str, cfg: RunConfig, rank: int, world: int,
               device: torch.device) -> tuple[dict, list[torch.Tensor]]:
    """Train ``cfg.steps`` steps with ``method``; return (losses, bytes held and sent, step times), final params."""
    if device.type == "cuda":  # on GPUs, also the real peak of everything this rank allocated
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    model, step, counter, held = _setup(method, cfg, device)
    losses, times = [], []
    for s in range(cfg.steps):
        x, y = local_batch(cfg, s, rank, world, device)
        dist.barrier()  # start every rank's step together so the time is the step's, not the wait's
        t0 = time.perf_counter()
        loss = step(x, y)
        times.append(time.perf_counter() - t0)
        losses.append(mean_over_ranks(loss.item(), device))
    out = {"losses": losses, "held": gather_per_rank(held()),
           "sent_per_step": gather_per_rank(counter.bytes / cfg.steps),
           "sent_by_op": {k: v / cfg.steps for k, v in counter.by_op.items()},
           "calls_per_step": {k: v / cfg.steps for k, v in counter.calls.items()},
           "step_s": statistics.median(times[1:] if len(times) > 1 else times)}
    if device.type == "cuda":
        out["cuda_peak_bytes"] = gather_per_rank(torch.cuda.max_memory_allocated(device))
    full = [p.to("cpu", torch.float64) for p in _full_params(model.module if isinstance(model, DDP) else model)]
    if method == "fsdp2":
        p = model.blocks[0].mlp[0].weight  # what a sharded parameter is
        out["example_param"] = {"type": type(p).__name__, "placements": str(p.placements),
                                "global_shape": list(p.shape), "local_shape": list(p.to_local().shape)}
    return out, full


def _max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((x.double() - y.double()).abs().max().item() for x, y in zip(a, b))


def compare(cfg: RunConfig, methods: list[str], rank: int, world: int, device: torch.device) -> dict:
    """Every method; rank 0 also trains the reference and measures each method's distance from it and from DDP."""
    ref_losses, ref_params = reference(cfg) if rank == 0 else (None, None)
    num_params = sum(p.numel() for p in build_model(cfg).parameters())
    results, finals = {}, {}
    for m in methods:
        results[m], finals[m] = run_method(m, cfg, rank, world, device)
        if rank == 0:
            results[m]["max_param_diff"] = _max_diff(finals[m], ref_params)
            results[m]["max_loss_diff"] = max(abs(a - b) for a, b in zip(results[m]["losses"], ref_losses))
    if rank == 0 and "ddp" in finals:
        for m in methods:
            results[m]["max_param_diff_vs_ddp"] = _max_diff(finals[m], finals["ddp"])
    return {"world": world, "num_params": num_params, "dtype": cfg.dtype, "ref_losses": ref_losses,
            "methods": results}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", default="compare", help="comma-separated: compare, exact, crash, resume, reshard")
    parser.add_argument("--methods", default=",".join(METHODS[:5]), help=f"comma-separated from {METHODS}")
    parser.add_argument("--cfg", default=RunConfig().to_json(), help="RunConfig as JSON")
    parser.add_argument("--ckpt-dir", default=None, help="checkpoint folder for crash/resume/reshard")
    parser.add_argument("--every", type=int, default=2, help="checkpoint every this many steps")
    parser.add_argument("--crash-at", type=int, default=4, help="crash task: die while saving at this step")
    a = parser.parse_args()
    cfg = RunConfig.from_json(a.cfg)
    tasks = [t for t in a.tasks.split(",") if t]
    methods = [m for m in a.methods.split(",") if m]
    for m in methods:
        if m not in METHODS:
            raise ValueError(f"unknown method {m!r}; choose from {', '.join(METHODS)}")
    rank, world, device = launch.init_distributed()
    from course_lib.workers import dcp_checkpoint  # imported here: the checkpoint tasks are optional
    tasks_fn: dict[str, Callable[[], dict]] = {
        "compare": lambda: compare(cfg, methods, rank, world, device),
        "crash": lambda: dcp_checkpoint.crash_run(cfg, a.ckpt_dir, a.every, a.crash_at, device),
        "resume": lambda: dcp_checkpoint.resume_run(cfg, a.ckpt_dir, device),
        "reshard": lambda: dcp_checkpoint.reshard_load(cfg, a.ckpt_dir, device),
    }
    exact_cfg = RunConfig.from_json(a.cfg)
    exact_cfg.dtype = "float64"
    tasks_fn["exact"] = lambda: compare(exact_cfg, [m for m in methods if m in EXACT_METHODS], rank, world, device)
    result: dict = {"world": world}
    for t in tasks:
        if t not in tasks_fn:
            raise ValueError(f"unknown task {t!r}; choose from {', '.join(tasks_fn)}")
        if t not in ("compare", "exact") and not a.ckpt_dir:
            raise ValueError(f"task {t!r} needs --ckpt-dir")
        result[t] = tasks_fn[t]()
    launch.report(result)
    launch.shutdown()


if __name__ == "__main__":
    main()
