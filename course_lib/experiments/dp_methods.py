"""Train one step with method X: DDP, ZeRO-1, ZeRO-2, ZeroRedundancyOptimizer or FSDP2 (chapter 09).

``setup(method, cfg, device)`` builds the run's model (``experiment.build_model``)
wrapped or sharded as ``method`` does it, with its optimizer and a byte
counter on its collectives; ``run_method`` trains ``cfg.steps`` steps of it on
this rank's rows and returns a ``MethodResult``: the loss per step, the bytes
held, resident and at the peak of a step, the bytes sent, the step time.
``compare_methods`` runs several and measures each against the single-process
reference (``experiment.reference``). ``fsdp2_adam`` and ``train_steps``: plain
FSDP2 training, for the checkpoint runs and chapter 11's offloading.

Every method keeps its gradient buffers (zeroed, not freed) from step to step,
so what is resident at the start of a step is exactly its model states.
"""

from __future__ import annotations

import contextlib
import functools
import statistics
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from course_lib import kernels, memory
from course_lib.experiments.counting import ByteCounter, counted
from course_lib.experiments.ddp_checks import allreduce_hook
from course_lib.experiments.run_config import RunConfig, build_model, local_batch, reference
from course_lib.experiments.results import gather_per_rank, max_abs_diff, mean_over_ranks
from course_lib.experiments.zero_meters import count_fsdp_traffic, held_bytes
from course_lib.parallel.sharding.zero import ZeroOptimizer, shard_fsdp2
from course_lib.models import lm_loss
from course_lib.timing import time_s

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


@dataclass
class MethodResult:
    """One training method's run. Lists hold one entry per rank; bytes are per rank."""

    losses: list[float]              # per step, the mean over ranks
    held: list[dict[str, int]]       # params, grads, optimizer state after the last step
    resident: list[int]              # at the start of the measured step: model states and the batch
    batch_bytes: list[int]           # of which the batch (this rank's inputs and targets)
    peak: list[int]                  # resident + the highest transient during zero_grad+forward+backward+step
    sent_per_step: list[float]       # bytes sent (ring formulas of ``comm``)
    sent_by_op: dict[str, float]     # rank 0, per collective
    calls_per_step: dict[str, float]  # rank 0, per collective
    step_s: float                    # median seconds per step, rank 0
    max_param_diff: float | None = None         # rank 0, from single-process Adam on the whole batch
    max_loss_diff: float | None = None
    max_param_diff_vs_ddp: float | None = None
    example_param: dict | None = None           # FSDP2: type, placements and shapes of a sharded parameter

    @property
    def transient(self) -> list[int]:
        """Bytes above the resident ones at the peak: activations, buckets, gathered layers, temporaries."""
        return [p - r for p, r in zip(self.peak, self.resident)]


@dataclass
class CompareResult:
    """Every method trained on the same batches, and the single-process reference (rank 0)."""

    world: int
    device: str                      # where the ranks ran: "cpu" (gloo) or "cuda" (NCCL, one GPU per rank)
    num_params: int
    dtype: str
    accumulation: int
    ref_losses: list[float] | None
    methods: dict[str, MethodResult]


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


@dataclass
class Method:
    """One training method set up on this rank: its model, its step, and what it holds and sends."""

    model: torch.nn.Module
    zero_grad: Callable[[], None]
    # zero_grad, forward, backward, optimizer step; returns the loss (context parallelism: this rank's part of it,
    # a tensor, summed over the ring after the step so that the step itself waits for nobody)
    step: Callable[[torch.Tensor, torch.Tensor], float | torch.Tensor]
    held: Callable[[], dict[str, int]]
    counter: ByteCounter


def setup(method: str, cfg: RunConfig, device: torch.device) -> Method:
    """The model, its step and meters for ``method``."""
    counter = ByteCounter()
    model = build_model(cfg, device)
    # the step's collectives on the default group, counted (the set-up's broadcasts, once per run, are not)
    no_sync, counting = None, functools.partial(counted, counter)
    if method in ("zero1", "zero2", "zero2_sync"):
        opt = ZeroOptimizer(model, torch.optim.Adam, 1 if method == "zero1" else 2, bucket_cap_mb=cfg.bucket_mb,
                            lr=cfg.lr, **({"max_in_flight": 0} if method == "zero2_sync" else {}))
        zero_grad, held = opt.zero_grad, opt.state_bytes  # stage 2: reduce-scatters in backward
    else:
        if method in ("ddp", "zero_redundancy"):
            # gradient_as_bucket_view: the buckets *are* the .grad tensors, else DDP holds the gradients twice
            model = DDP(model, gradient_as_bucket_view=True)
            model.register_comm_hook(None, allreduce_hook())  # its all-reduces where ``counted`` sees them
            no_sync = model.no_sync  # accumulate locally, all-reduce once
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
            counting = contextlib.nullcontext  # count_fsdp_traffic counts each of its collectives
        else:
            raise ValueError(f"unknown method {method!r}; choose from {', '.join(METHODS)}")
        if method != "zero_redundancy":
            opt = torch.optim.Adam(model.parameters(), lr=cfg.lr)

        def zero_grad() -> None:  # keep the gradient buffers: DDP's bucket views, FSDP2's 1/N shards
            opt.zero_grad(set_to_none=False)

        def held() -> dict[str, int]:
            return held_bytes(model, opt)

    # bf16 matmuls as this CPU runs them: the slow kernel itself (chapter 09 times what it costs), the emulated twin
    # only where it is broken (kernels.probe)
    bf16 = (lambda: kernels.bf16_matmuls(device, emulate=("broken",))) if method == "fsdp2_bf16" else contextlib.nullcontext

    def step(x: torch.Tensor, y: torch.Tensor) -> float:
        with counting():
            zero_grad()
            with bf16():
                loss = forward_backward(model, x, y, cfg.accumulation, no_sync)
            opt.step()
        return loss
    return Method(model, zero_grad, step, held, counter)


def measure_step(m: Method, x: torch.Tensor, y: torch.Tensor,
                 device: torch.device) -> tuple[int, int, float | torch.Tensor]:
    """One step of ``m``: (bytes resident at its start, its peak bytes, its loss)."""
    m.zero_grad()  # what the step's zero_grad frees, freed before the window (the CPU profiler cannot see its free)
    resident = sum(m.held().values()) + memory.tensor_bytes(x) + memory.tensor_bytes(y)
    box: list[float | torch.Tensor] = []
    transient = memory.peak_bytes(lambda: box.append(m.step(x, y)), device)
    return resident, resident + transient, box[0]


def profile_or_time(m: Method, x: torch.Tensor, y: torch.Tensor, device: torch.device,
                    profile: bool) -> tuple[float | torch.Tensor, tuple[int, int] | None, float | None]:
    """One step of ``m`` with every rank starting together: (its loss, (resident, peak) bytes if ``profile``, else
    its seconds). Never both: the profiler slows the step it watches. A collective: every rank calls it."""
    dist.barrier()  # start every rank's step together so the time is the step's, not the wait's
    if profile:
        resident, peak, loss = measure_step(m, x, y, device)
        return loss, (resident, peak), None
    box: list[float | torch.Tensor] = []
    seconds = time_s(lambda: box.append(m.step(x, y)), device)  # CUDA events on a GPU rank
    return box[0], None, seconds


def full_params(model: torch.nn.Module) -> list[torch.Tensor]:
    """Full parameter values on every rank (FSDP2's DTensors gathered: a collective)."""
    return [(p.full_tensor() if hasattr(p, "full_tensor") else p).detach() for p in model.parameters()]


def run_method(method: str, cfg: RunConfig, rank: int, world: int,
               device: torch.device) -> tuple[MethodResult, list[torch.Tensor]]:
    """Train ``cfg.steps`` steps with ``method``; return its result (rank 0's is complete) and final params."""
    m = setup(method, cfg, device)
    measured = [s for s in MEASURED_STEPS if s < cfg.steps] or [cfg.steps - 1]
    losses, times, resident, peak = [], [], 0, None
    for s in range(cfg.steps):
        x, y = local_batch(cfg, s, rank, world, device)
        loss, mem, took = profile_or_time(m, x, y, device, profile=s in measured)
        if mem is not None:
            resident, peak = mem[0], (mem[1] if peak is None else min(peak, mem[1]))
        else:
            times.append(took)
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
    full = [p.to("cpu", torch.float64) for p in full_params(model)]
    if method == "fsdp2":
        p = model.blocks[0].mlp[0].weight  # what a sharded parameter is
        result.example_param = {"type": type(p).__name__, "placements": str(p.placements),
                                "global_shape": list(p.shape), "local_shape": list(p.to_local().shape)}
    return result, full


def compare_methods(cfg: RunConfig, methods: list[str], rank: int, world: int, device: torch.device) -> CompareResult:
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


def fsdp2_adam(cfg: RunConfig, device: torch.device,
               offload_policy: object | None = None) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The run's model sharded by FSDP2 (``zero.shard_fsdp2``) and Adam on its shards (on the host when offloaded)."""
    model = shard_fsdp2(build_model(cfg, device), offload_policy=offload_policy)
    return model, torch.optim.Adam(model.parameters(), lr=cfg.lr)


def train_steps(model: torch.nn.Module, opt: torch.optim.Optimizer, cfg: RunConfig, device: torch.device,
                start: int = 0, stop: int | None = None, on_step: Callable[[int, list[float]], None] | None = None,
                times: list[float] | None = None) -> list[float]:
    """Steps ``start .. stop-1`` (default: to ``cfg.steps``) on this rank's rows; the mean loss over ranks per step.

    Each step's batch depends only on its number, so a resumed run reads what an uninterrupted one would.
    ``on_step(done, losses)`` runs after each step, ``done`` steps complete (a checkpoint's hook). With ``times``,
    each step is timed (``timing.time_s``: CUDA events on a GPU, the host's work in between included) after a
    barrier, so that the time is the step's, not the wait for a slower rank.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    losses: list[float] = []
    for s in range(start, cfg.steps if stop is None else stop):
        x, y = local_batch(cfg, s, rank, world, device)
        box: list[torch.Tensor] = []

        def step() -> None:
            opt.zero_grad()
            box.append(lm_loss(model(x), y))
            box[0].backward()
            opt.step()
        if times is None:
            step()
        else:
            dist.barrier()
            times.append(time_s(step, device))
        losses.append(mean_over_ranks(box[0].item(), device))
        if on_step is not None:
            on_step(s + 1, losses)
    return losses
