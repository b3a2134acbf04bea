"""Plan a training configuration for a memory budget (chapter 09, the capstone).

For every combination of precision (chapter 05), micro-batch with gradient
accumulation (chapters 02-03), activation checkpointing (chapter 05) and ZeRO
stage (chapter 08), predict the peak bytes on one device and the step time;
keep the fastest that fits.

Memory: a step peaks inside the forward/backward pass (states + saved
activations + the running op's temporaries: affine in the micro-batch ``m``)
or inside the optimizer step (states + Adam's temporaries: constant). A line
through whole-step peaks at ``m = 1, 2`` sees the optimizer moment and gets
the slope wrong (a maximum of two lines is not a line), so the two moments are
measured apart: ``fb`` with the gradients allocated, at ``m = 1, 2``, exact
since each term in it is affine in ``m``. Checkpointing is derived from the
bytes one block saves (Chen et al. 2016: ``k - 1`` segment inputs kept, at
most ``ceil(n/k)`` blocks rebuilt at once); ZeRO divides the states (chapter 08).

``calibrate`` (in ``course_lib.calibrate``) measures the model once;
``course_lib.step`` runs a configuration, so a plan can be checked.

Time is relative, since timings on a busy machine are noisy:
``A (alpha + beta m)(1 + recompute) + update + communication / bandwidth``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn

from course_lib import memory
from course_lib.calibrate import BatchFn, Measurements, calibrate, default_batch
from course_lib.checkpointing import recomputed_blocks, segment_plan
# Re-exported: the capstone runs and measures configurations through this module.
from course_lib.step import Config, LossFn, autocast, measure_peak, train_step, with_checkpointing

__all__ = ["Candidate", "Config", "Measurements", "Plan", "autocast", "calibrate", "comm_bytes", "default_batch",
           "measure_peak", "plan", "predict_peak", "predict_step_time", "segment_options", "train_step",
           "with_checkpointing"]

MiB = 2**20
# A backward costs about two forwards (6N FLOPs per token, 2N forward + 4N backward;
# Kaplan et al. 2020, section 2.1): rerunning a forward costs a third of a step.
FORWARD_SHARE = 1 / 3
# One PCIe 4.0 x16 link moves about 25 GB/s in practice (nominal 32 GB/s); pass
# your interconnect's measured all-reduce bandwidth instead (chapter 06).
DEFAULT_BANDWIDTH = 25e9
# The prediction's error measured in chapter 09 is a few percent either way, and
# allocators fragment: plan for 95% of the budget.
DEFAULT_HEADROOM = 0.05
TIMING_MAX_MICRO = 64  # larger timed passes would slow planning and add little


@dataclass
class Candidate:
    """One (precision, segments, stage) at its largest fitting micro-batch (at micro-batch 1 if none fits)."""

    config: Config
    fits: bool
    peak: dict                               # predict_peak of config
    samples_per_s: float                     # 0 when it does not fit


@dataclass
class Plan:
    """What ``plan`` chose, why, and every candidate it weighed."""

    config: Config
    predicted_peak_bytes: int
    predicted_samples_per_s: float
    budget_bytes: int
    world_size: int
    peak: dict
    explanation: str
    candidates: list[Candidate] = field(default_factory=list)
    measurements: Measurements | None = None

    def table(self, limit: int | None = None) -> str:
        """The candidates, fastest first (then those that do not fit), one line each."""
        rows = [f"{'precision':>9} {'segments':>8} {'ZeRO':>4} {'micro':>5} {'accum':>5} {'peak MiB':>9} "
                f"{'samples/s':>9}"]
        for c in sorted(self.candidates, key=lambda c: (-c.samples_per_s, c.peak["total"]))[:limit]:
            m, a = (c.config.micro_batch, c.config.accumulation_steps) if c.fits else ("-", "-")
            note = "  <- chosen" if c.config == self.config else ("" if c.fits else "  (micro-batch 1 too big)")
            rows.append(f"{c.config.precision:>9} {c.config.segments:>8} {c.config.zero_stage:>4} {m:>5} {a:>5} "
                        f"{c.peak['total'] / MiB:9.1f} {c.samples_per_s:9.1f}{note}")
        return "\n".join(rows)


# ----- predicting -------------------------------------------------------------------------


def predict_peak(meas: Measurements, config: Config, world_size: int = 1) -> dict:
    """Predicted peak bytes on one rank: ``params, grads, optimizer, batch, transient, total`` and ``where``.

    ``transient`` is the larger of the forward/backward part (activations and
    temporaries) and the optimizer step's temporaries; ``where`` names it. The
    forward/backward part assumes the gradients exist, as they do from the second
    micro-batch on; a single micro-batch (no accumulation) is overstated by up to
    its gradients, never understated: at any moment of its backward pass some of
    them exist, and no more activations than at the start.
    """
    n, k, m, s, N = meas.n_blocks, config.segments, config.micro_batch, config.zero_stage, world_size
    c, d = meas.fb[config.precision]
    fb = c + d * m
    if k > 1:  # keep k-1 segment inputs; rebuild one segment (at most ceil(n/k) blocks) at a time
        # Only the per-sample part of a block's saves goes: the constant part is bf16 weight copies (and
        # buffers), which autocast's cache keeps to the end of the forward pass, checkpointed or not.
        per_sample = meas.block[config.precision][1]
        rebuilt = max(len(r) for r in segment_plan(n, k))
        fb -= ((n - rebuilt) * per_sample - (k - 1) * meas.boundary_per_sample[config.precision]) * m
    # ZeRO: stage 1 shards the optimizer state, 2 the gradients too, 3 the parameters too (chapter 08)
    params = meas.param_bytes / (N if s >= 3 else 1)
    grads = meas.grad_bytes / (N if s >= 2 else 1)
    optim = meas.optimizer_bytes / (N if s >= 1 else 1)
    # Sharded gradients pass through one block's whole gradient before its reduce-scatter; stage 3 also
    # gathers one block's parameters, and the next block's ahead of time (FSDP2's prefetch).
    in_flight = meas.unit_bytes * ((s >= 2) + 2 * (s >= 3)) if N > 1 else 0
    opt_tmp = meas.optimizer_tmp_bytes / (N if s >= 1 else 1)  # the update runs on this rank's shard
    parts = dict(params=params, grads=grads, optimizer=optim,
                 batch=meas.batch_bytes_per_sample * m * config.accumulation_steps,
                 transient=max(fb + in_flight, opt_tmp))
    out: dict = {key: int(math.ceil(v)) for key, v in parts.items()}
    out["total"] = sum(out.values())
    out["where"] = "forward/backward" if fb + in_flight >= opt_tmp else "optimizer step"
    return out


def comm_bytes(param_bytes: int, config: Config, world_size: int) -> float:
    """Bytes one rank sends per optimizer step, in ring collectives (chapter 08), accumulation included.

    DDP (accumulating locally under ``no_sync``) and ZeRO-1 send twice the ring
    share ``(N-1)/N x P`` once per step. Sharded gradients cannot accumulate
    locally: ZeRO-2 reduce-scatters after every micro-batch and all-gathers once
    (A + 1); ZeRO-3 also gathers the parameters for every forward and backward
    (3 per micro-batch: 1.5x DDP when A = 1). (FSDP2 does the same by default;
    ``set_requires_gradient_sync(False)`` instead keeps unsharded gradients
    between micro-batches: less traffic, more memory. pytorch/pytorch#126166.)
    """
    share = (world_size - 1) / world_size * param_bytes
    a = config.accumulation_steps
    return share * {0: 2, 1: 2, 2: a + 1, 3: 3 * a}[config.zero_stage]


def predict_step_time(meas: Measurements, config: Config, world_size: int = 1,
                      bandwidth: float = DEFAULT_BANDWIDTH) -> float:
    """Predicted seconds of one optimizer step: good for ranking configurations, rough in absolute terms."""
    alpha, beta = meas.time[config.precision]
    recompute = 0.0
    if config.segments > 1:
        recompute = (FORWARD_SHARE * meas.block_flop_share
                     * recomputed_blocks(meas.n_blocks, config.segments) / meas.n_blocks)
    compute = config.accumulation_steps * (alpha + beta * config.micro_batch) * (1 + recompute)
    update = meas.optimizer_s / (world_size if config.zero_stage >= 1 else 1)
    return compute + update + comm_bytes(meas.param_bytes, config, world_size) / bandwidth


# ----- planning ----------------------------------------------------------------------------


def segment_options(n_blocks: int) -> list[int]:
    """For each size of the largest segment, the fewest segments that give it (fewer segments recompute less).

    A transformer block saves far more than its output, so more segments keep
    lowering the peak, past Chen's ``sqrt(n)`` (which assumes they are equal).
    """
    sizes = {math.ceil(n_blocks / k) for k in range(1, n_blocks + 1)}
    return sorted(min(k for k in range(1, n_blocks + 1) if math.ceil(n_blocks / k) == s) for s in sizes) or [1]


def _parts(peak: dict) -> str:
    return ", ".join(f"{k} {peak[k] / MiB:.1f}" for k in ("params", "grads", "optimizer", "batch", "transient"))


def plan(model: nn.Module, sample_shape: tuple[int, ...], global_batch: int, memory_budget_bytes: int,
         world_size: int = 1, *, loss_fn: LossFn | None = None, make_batch: BatchFn | None = None,
         device: torch.device | str | None = None, precisions: tuple[str, ...] | None = None,
         headroom: float = DEFAULT_HEADROOM, bandwidth: float = DEFAULT_BANDWIDTH) -> Plan:
    """The fastest predicted configuration whose peak bytes per device fit ``memory_budget_bytes``, with Adam.

    ``global_batch`` samples of shape ``sample_shape`` per optimizer step are
    split evenly over ``world_size`` ranks; each runs micro-batches (a divisor
    of its share) with accumulation, in fp32 or bf16 autocast, checkpointing
    ``model.blocks`` or not, at a ZeRO stage (0-3; 0 on one rank). The predicted
    peak must fit ``(1 - headroom)`` of the budget. ``loss_fn`` and
    ``make_batch(m) -> (inputs, targets)`` default to ``default_batch``'s. The
    model is measured in place on ``device`` (default: where its parameters
    are) and left as it was. Raises ``ValueError`` when nothing fits, saying
    what the smallest configuration needs.
    """
    device = torch.device(device) if device is not None else next(model.parameters()).device
    if world_size < 1 or global_batch < 1 or memory_budget_bytes <= 0 or not 0 <= headroom < 1:
        raise ValueError(f"need world_size >= 1, global_batch >= 1, a positive budget and 0 <= headroom < 1; "
                         f"got {world_size}, {global_batch}, {memory_budget_bytes}, {headroom}")
    if global_batch % world_size:
        raise ValueError(f"global batch {global_batch} does not split evenly over {world_size} ranks: "
                         f"use a multiple of {world_size}")
    per_rank, usable = global_batch // world_size, int(memory_budget_bytes * (1 - headroom))
    budget_text = f"{memory_budget_bytes / MiB:.1f} MiB per device ({usable / MiB:.1f} usable)"
    states = 4 * memory.param_bytes(model) / world_size  # weights, gradients, Adam's 2 moments: ZeRO-3 at best
    if states > usable:
        raise ValueError(f"nothing fits {budget_text}: the model states alone need {states / MiB:.1f} MiB even "
                         f"fully sharded over {world_size} rank(s). Use a smaller model or more ranks.")
    if precisions is None:
        bf16 = device.type == "cpu" or (device.type == "cuda" and torch.cuda.is_bf16_supported())
        precisions = ("fp32", "bf16") if bf16 else ("fp32",)
    default_make, default_loss = default_batch(model, tuple(sample_shape), device)
    try:
        meas = calibrate(model, make_batch or default_make, loss_fn or default_loss, device, precisions,
                         min(per_rank, TIMING_MAX_MICRO), usable)
    except torch.OutOfMemoryError as exc:
        raise ValueError(f"the device ran out of memory measuring micro-batches 1 and 2 of this model: it does "
                         f"not fit {budget_text}. Use a smaller model or more ranks.") from exc
    divisors = [m for m in range(1, per_rank + 1) if per_rank % m == 0]
    candidates = []
    for prec in precisions:
        for k in segment_options(meas.n_blocks):
            for s in [0] if world_size == 1 else [0, 1, 2, 3]:
                cfgs = [Config(prec, m, per_rank // m, k, s) for m in divisors]
                ok = [c for c in cfgs if predict_peak(meas, c, world_size)["total"] <= usable]
                cfg = ok[-1] if ok else cfgs[0]  # the largest micro-batch: fewest passes, least fixed cost
                speed = global_batch / predict_step_time(meas, cfg, world_size, bandwidth) if ok else 0.0
                candidates.append(Candidate(cfg, bool(ok), predict_peak(meas, cfg, world_size), speed))
    fits = sorted((c for c in candidates if c.fits), key=lambda c: -c.samples_per_s)
    if not fits:
        small = min(candidates, key=lambda c: c.peak["total"])
        raise ValueError(f"nothing fits {budget_text}: the smallest configuration ({small.config.describe()}) "
                         f"needs {small.peak['total'] / MiB:.1f} MiB ({_parts(small.peak)} MiB). Use a budget of at "
                         f"least {small.peak['total'] / (1 - headroom) / MiB:.1f} MiB, a smaller model or shorter "
                         "samples, or more ranks (ZeRO-3 divides the model states by the world size).")
    best, cfg = fits[0], fits[0].config
    why = [f"Chosen: {cfg.describe()}. Predicted peak {best.peak['total'] / MiB:.1f} MiB of {budget_text} "
           f"({_parts(best.peak)} MiB; the peak is in the {best.peak['where']}), about {best.samples_per_s:.0f} "
           "samples/s."]
    bigger = [m for m in divisors if m > cfg.micro_batch]
    if bigger:
        nxt = Config(cfg.precision, bigger[0], per_rank // bigger[0], cfg.segments, cfg.zero_stage)
        why.append(f"Micro-batch {bigger[0]} would need {predict_peak(meas, nxt, world_size)['total'] / MiB:.1f} MiB.")
    if len(fits) > 1:
        why.append(f"Runner-up: {fits[1].config.describe()}, {fits[1].samples_per_s:.0f} samples/s.")
    if "bf16" in meas.time and "fp32" in meas.time:
        t = {p: a + b * meas.timing_micro for p, (a, b) in meas.time.items()}
        why.append(f"A micro-batch of {meas.timing_micro} took {t['bf16'] / t['fp32']:.2f}x as long in bf16 as in "
                   "fp32 here.")
    if cfg.micro_batch < per_rank and any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules()):
        why.append(f"BatchNorm will see micro-batches of {cfg.micro_batch}, not the batch: consider GroupNorm "
                   "(chapter 04).")
    return Plan(cfg, best.peak["total"], best.samples_per_s, memory_budget_bytes, world_size, best.peak,
                " ".join(why), candidates, meas)
