"""Search: ``plan`` weighs every candidate ``Config``, keeps the fastest that fits, says why (chapter 13, section 3).

For every combination of precision, micro-batch with accumulation, checkpoint segments, ZeRO stage,
layout over the ranks (data x tensor x context x pipeline) and chapter 11's options, ``plan`` takes the largest
micro-batch whose predicted peak (``predict.predict_peak``) fits the budget less a headroom, ranks those by
predicted speed
(``predict.predict_step_time``); ``explain`` says why it chose, ``Plan.table`` lists every candidate. The model is
measured once (``measure.calibrate``); the notebook's Experiment then runs the chosen plan (``step``).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Callable

import torch
from torch import nn

from course_lib import env, kernels, memory
from course_lib.parallel.sharding.zero import DEFAULT_BUCKET_MB
from course_lib.models import CausalSelfAttention
from course_lib.planner.config import Config
from course_lib.planner.measure import (BatchFn, Measurements, calibrate, default_batch, lm_head, tp_sizes,
                                        transformer_layers)
from course_lib.planner.explain import MiB, Candidate, Plan, explain, layout_text, peak_parts
from course_lib.planner.predict import (DEFAULT_BANDWIDTH, DEFAULT_HOST_BANDWIDTH, DEFAULT_TP_BANDWIDTH, pipeline_runs,
                                        predict_peak, predict_step_time)
from course_lib.planner.step import LossFn

# The prediction's error measured in chapter 13 is a few percent either way, and allocators fragment.
DEFAULT_HEADROOM = 0.05
TIMING_MAX_MICRO = 64  # larger timed passes would slow planning and add little
# A chunk of the loss keeps at least this many tokens at micro-batch 1: with fewer, chapter 11's formula for the
# loss's peak falls a few percent below the measured one (the many chunks' bookkeeping), and the peak has long
# stopped falling (it is down to the head's weight gradient).
MIN_CHUNK_TOKENS = 8


def segment_options(n_blocks: int) -> list[int]:
    """For each size of the largest segment, the fewest segments that give it (fewer segments recompute less).

    A block saves far more than its output, so more segments keep lowering the peak, past Chen's ``sqrt(n)``.
    """
    sizes = {math.ceil(n_blocks / k) for k in range(1, n_blocks + 1)}
    return sorted(min(k for k in range(1, n_blocks + 1) if math.ceil(n_blocks / k) == s) for s in sizes) or [1]


def cp_sizes(model: nn.Module, sample_shape: tuple[int, ...], world_size: int) -> list[int]:
    """Context-parallel sizes ``c > 1`` for ``model``: transformer blocks with ``CausalSelfAttention`` (the ring
    replaces it, chapter 12), ``c`` dividing the ranks and ``2c`` the sequence (the zigzag's chunks)."""
    layers = transformer_layers(model, sample_shape)
    if layers is None or not any(isinstance(m, CausalSelfAttention) for m in model.modules()):
        return []
    return [c for c in range(2, world_size + 1) if world_size % c == 0 and layers.seq_len % (2 * c) == 0]


def _layouts(model: nn.Module, sample_shape: tuple[int, ...], global_batch: int, world_size: int,
             tensor_parallel: bool, sequence_parallel: bool, context_parallel: bool) -> list[tuple[int, int]]:
    """The (tensor, context)-parallel sizes to try, one of them 1 (the course runs either, not both together):
    those ``tp_sizes`` and ``cp_sizes`` allow whose data-parallel ranks split the batch."""
    ts = tp_sizes(transformer_layers(model, sample_shape), world_size, sequence_parallel) if tensor_parallel else [1]
    sizes = [(t, 1) for t in ts] + [(1, c) for c in (cp_sizes(model, sample_shape, world_size)
                                                      if context_parallel else [])]
    ok = [(t, c) for t, c in sizes if global_batch % (world_size // (t * c)) == 0]
    if not ok:
        names = " or ".join(layout_text(world_size // (t * c), t, c) for t, c in sizes[1:])
        raise ValueError(f"global batch {global_batch} does not split evenly over {world_size} ranks: use a multiple "
                         f"of {world_size}" + (f" (or of the data-parallel ranks d of a layout: {names})"
                                              if len(sizes) > 1 else ""))
    return ok


def _switch(name: str, wanted: bool | None, pays: bool, runs: bool, needs: str) -> list[bool]:
    """The values an on/off option of ``plan`` is searched with: ``wanted=None`` where it ``pays``, ``True``
    wherever it ``runs`` (else an error naming what it ``needs``), ``False`` never."""
    if wanted and not runs:
        raise ValueError(f"{name}=True needs {needs}")
    return [False, True] if runs and (pays if wanted is None else wanted) else [False]


def _largest_fitting(meas: Measurements, shape: Config, per_rank: int, world_size: int, usable: int,
                     speed: Callable[[Config], float]) -> Candidate | None:
    """``shape`` at the largest micro-batch dividing ``per_rank`` whose predicted peak fits ``usable`` bytes."""
    cfgs = [dataclasses.replace(shape, micro_batch=m, accumulation_steps=per_rank // m)
            for m in range(1, per_rank + 1) if per_rank % m == 0]
    cfgs = [c for c in cfgs if pipeline_runs(meas, c)]
    if not cfgs:
        return None
    ok = [c for c in cfgs if predict_peak(meas, c, world_size)["total"] <= usable]
    cfg = ok[-1] if ok else cfgs[0]  # the largest micro-batch: fewest passes, least fixed cost
    if ok and shape.pp > 1:  # a pipeline also wants many micro-batches (its bubble): the fastest that fits
        cfg = max(ok, key=speed)
    return Candidate(cfg, bool(ok), predict_peak(meas, cfg, world_size), speed(cfg) if ok else 0.0)


def default_precisions(device: torch.device) -> tuple[tuple[str, ...], str]:
    """The precisions ``plan`` searches when it is not told: fp32, bf16 where the device runs it at speed, and fp8
    where it has FP8 tensor cores.

    A CUDA GPU with bf16 support and a CPU with native bf16 get bf16. A CPU that emulates bf16
    (``env.bf16_is_slow``) does not: there bf16 is never the faster choice, and timing it would make the
    calibration take minutes. fp8 (chapter 06) is searched on GPUs of compute capability 8.9 and up (L4, H100,
    H200), where ``_scaled_mm`` runs on FP8 units; a CPU has none (chapter 06 measures it slower than fp32). A
    precision left out could still be the one that fits, so the second value says what was left out and how to
    search it anyway (empty when nothing was).
    """
    no_fp8 = "a CPU has no FP8 units (chapter 06: its FP8 matmul is slower than fp32)"
    if device.type == "cuda":
        bf16 = ("bf16",) if torch.cuda.is_bf16_supported() else ()
        if torch.cuda.get_device_capability(device) >= (8, 9):
            return ("fp32", *bf16, "fp8"), ""
        no_fp8 = "this GPU has no FP8 tensor cores (compute capability 8.9 and up)"
        chosen, note = ("fp32", *bf16), ""
    elif device.type != "cpu":
        return ("fp32",), ""
    elif env.bf16_is_slow(device):
        chosen, note = ("fp32",), f"this CPU's bf16 matmuls are not native ({kernels.probe('bf16').short()}); "
    else:
        chosen, note = ("fp32", "bf16"), ""
    left = [p for p in ("bf16", "fp8") if p not in chosen]
    return chosen, (f" {' and '.join(left)} {'was' if len(left) == 1 else 'were'} not searched: {note}{no_fp8}; "
                    f"pass precisions=('fp32', 'bf16', 'fp8') to search {'it' if len(left) == 1 else 'them'} anyway.")


def plan(model: nn.Module, sample_shape: tuple[int, ...], global_batch: int, memory_budget_bytes: int,
         world_size: int = 1, *, loss_fn: LossFn | None = None, make_batch: BatchFn | None = None,
         device: torch.device | str | None = None, precisions: tuple[str, ...] | None = None,
         headroom: float = DEFAULT_HEADROOM, bandwidth: float = DEFAULT_BANDWIDTH,
         bucket_cap_mb: float = DEFAULT_BUCKET_MB, tensor_parallel: bool = True, sequence_parallel: bool = True,
         tp_bandwidth: float = DEFAULT_TP_BANDWIDTH, fused: bool | None = None, chunk_loss: bool | None = None,
         offload: bool | None = None, host_bandwidth: float = DEFAULT_HOST_BANDWIDTH,
         pipeline_stages: int | tuple[int, ...] = 1, virtual_stages: tuple[int, ...] = (1,),
         context_parallel: bool = True) -> Plan:
    """The fastest predicted configuration whose peak bytes per device fit ``memory_budget_bytes``, with Adam.

    ``global_batch`` samples of shape ``sample_shape`` per step are split evenly over the data-parallel ranks; each
    runs micro-batches (a divisor of its share) with accumulation, in fp32 or bf16 autocast, checkpointing
    ``model.blocks`` or not, at a ZeRO stage (0-3; stage 2 as ``ZeroOptimizer`` with ``bucket_cap_mb``). With
    ``tensor_parallel`` and blocks that are ``TransformerBlock``s, the ``world_size`` ranks may also form a
    ``d x t`` mesh: ``t`` ranks (dividing the heads) split every block, with ``sequence_parallel`` or not, and
    FSDP2 (ZeRO-3) shards over the ``d`` others, as chapter 10 trains. ``bandwidth`` prices data parallelism's
    traffic, ``tp_bandwidth`` tensor parallelism's. The predicted peak must fit ``(1 - headroom)`` of the budget.

    Chapter 11's options, without tensor parallelism; each is ``None`` (searched where it pays), ``True``
    (searched wherever it runs) or ``False`` (never): ``fused`` attention, for a model with
    ``CausalSelfAttention`` layers; ``chunk_loss``, ``lm_loss`` in chunks of at least ``MIN_CHUNK_TOKENS`` tokens
    (``chunked_loss.transformer_loss``), for a ``TinyTransformer``-like model, where it pays when the vocabulary
    is wider than the model; ``offload`` of what the blocks save, without checkpointing or ZeRO-3, priced at
    ``host_bandwidth``, where it pays on a GPU. On a CPU machine the host is the device's own memory: there
    ``offload=True`` plans chapter 11's simulation (``offload.OffloadToHost``), which saves nothing real.

    With ``context_parallel`` and ``TransformerBlock``s of ``CausalSelfAttention``, ``c`` of the ranks may also
    share every sequence (``cp_sizes``): ring attention over ``T/c`` positions each (chapter 12), with the fused
    kernel's saves and without checkpointing, offload or loss chunks (what the course's ring runs); ZeRO then
    shards over the ``d x c`` ranks, which all hold the whole model.

    ``pipeline_stages = p > 1`` cuts the blocks into ``p`` pipeline stages on ``p`` of the ranks (chapter 08), the
    others data-parallel (a tuple: each ``p`` is tried); each of ``virtual_stages`` is tried (``v > 1``:
    interleaved 1F1B, for a smaller bubble and more activations in flight), where it cuts the blocks and the
    accumulation steps come in groups of ``p``.

    ``loss_fn`` and ``make_batch(m) -> (inputs, targets)`` default to ``default_batch``'s. The model is measured in
    place on ``device`` (default: where its parameters are) and left as it was. Raises ``ValueError`` when
    nothing fits, saying what the smallest needs.
    """
    device = torch.device(device) if device is not None else next(model.parameters()).device
    if world_size < 1 or global_batch < 1 or memory_budget_bytes <= 0 or not 0 <= headroom < 1:
        raise ValueError(f"need world_size >= 1, global_batch >= 1, a positive budget and 0 <= headroom < 1; "
                         f"got {world_size}, {global_batch}, {memory_budget_bytes}, {headroom}")
    stage_counts = (pipeline_stages,) if isinstance(pipeline_stages, int) else tuple(pipeline_stages)
    if (not stage_counts or any(p < 1 or world_size % p for p in stage_counts) or not virtual_stages
            or min(virtual_stages) < 1):
        raise ValueError(f"pipeline_stages must divide world_size ({world_size}) and virtual_stages be >= 1; got "
                         f"{pipeline_stages}, {virtual_stages}")
    sizes, refusals = [], []  # (t, c, p) layouts; why a pipeline depth could not split the batch
    for pp in stage_counts:
        try:
            sizes += [(t, c, pp) for t, c in _layouts(model, tuple(sample_shape), global_batch, world_size // pp,
                                                      tensor_parallel, sequence_parallel,
                                                      context_parallel and fused is not False)]  # the ring: fused
        except ValueError as exc:
            refusals.append(exc)
    if not sizes:
        raise refusals[0]
    usable = int(memory_budget_bytes * (1 - headroom))
    budget_text = f"{memory_budget_bytes / MiB:.1f} MiB per device ({usable / MiB:.1f} usable)"
    states = 4 * memory.param_bytes(model) / world_size  # weights, gradients, Adam's 2 moments: ZeRO-3 at best
    if states > usable:
        raise ValueError(f"nothing fits {budget_text}: the model states alone need {states / MiB:.1f} MiB even "
                         f"fully sharded over {world_size} rank(s). Use a smaller model or more ranks.")
    precisions, unsearched = (tuple(precisions), "") if precisions is not None else default_precisions(device)
    one_device = any(t == 1 for t, _, _ in sizes)  # chapter 11's options run without tensor parallelism
    kernels = _switch("fused", fused, True, one_device and any(isinstance(m, CausalSelfAttention)
                                                                for m in model.modules()),
                      "a model with CausalSelfAttention layers, on a layout without tensor parallelism")
    lm = lm_head(model, tuple(sample_shape), loss_fn)
    chunked = _switch("chunk_loss", chunk_loss, lm is not None and lm.vocab > lm.width,
                      one_device and lm is not None and lm.tokens >= 2 * MIN_CHUNK_TOKENS,
                      f"a TinyTransformer-like model trained with lm_loss on samples of at least "
                      f"{2 * MIN_CHUNK_TOKENS} tokens, on a layout without tensor parallelism")[-1]
    chunk_counts = [1] + [2**i for i in range(1, 32) if chunked and 2**i * MIN_CHUNK_TOKENS <= lm.tokens]
    blocks = getattr(model, "blocks", None)
    offloads = _switch("offload", offload, device.type == "cuda",
                       one_device and isinstance(blocks, nn.Sequential) and len(blocks) > 0,
                       "a model whose `blocks` is a non-empty nn.Sequential, on a layout without tensor parallelism")
    default_make, default_loss = default_batch(model, tuple(sample_shape), device)
    largest = global_batch // min(world_size // (pp * t * c) for t, c, pp in sizes)  # the largest share of a rank
    try:
        meas = calibrate(model, make_batch or default_make, loss_fn or default_loss, device, precisions,
                         min(largest, TIMING_MAX_MICRO), usable, bucket_cap_mb, fused=tuple(kernels),
                         lm=lm if chunked else None, packed=True in offloads)
    except torch.OutOfMemoryError as exc:
        raise ValueError(f"the device ran out of memory measuring micro-batches 1 and 2 of this model: it does "
                         f"not fit {budget_text}. Use a smaller model or more ranks.") from exc

    def speed(cfg: Config) -> float:
        return global_batch / predict_step_time(meas, cfg, world_size, bandwidth, tp_bandwidth, host_bandwidth)

    candidates = []
    for prec, kernel, k, (t, cp, pp) in itertools.product(precisions, kernels, segment_options(meas.n_blocks),
                                                          sizes):
        if kernel and t > 1 or cp > 1 and (not kernel or k > 1):
            continue
        vs = tuple(virtual_stages) if pp > 1 else (1,)
        per_rank = global_batch // (world_size // (t * cp * pp))
        zero_ranks = world_size // (t * pp)  # every rank holding the same weights: data- and context-parallel
        # TP runs with FSDP2 over the data-parallel ranks (chapter 10); plain data parallelism takes any stage
        stages = [0] if zero_ranks == 1 else [0, 1, 2, 3] if t == 1 else [3]
        for s in stages:
            for off in offloads if t == 1 and cp == 1 and k == 1 and s < 3 else [False]:
                for v in vs:
                    shape = Config(prec, 1, per_rank, k, s, t, sequence_parallel and t > 1, kernel, off, pp=pp,
                                   virtual_stages=v, cp=cp)
                    listed = None
                    for chunks in chunk_counts if t == 1 and cp == 1 else [1]:
                        c = _largest_fitting(meas, dataclasses.replace(shape, loss_chunks=chunks), per_rank,
                                             world_size, usable, speed)
                        if c is None:
                            continue
                        # more chunks cost a matmul of the head: listed only where they let a larger micro-batch fit
                        larger = (listed is None or not listed.fits
                                  or c.config.micro_batch > listed.config.micro_batch)
                        if listed is None or c.fits and larger:
                            candidates.append(c)
                            listed = c
    fits = sorted((c for c in candidates if c.fits), key=lambda c: -c.samples_per_s)
    if not fits:
        small = min(candidates, key=lambda c: c.peak["total"])
        more = "ZeRO-3 divides the model states by the world size"
        if any(t > 1 for t, _, _ in sizes):
            more += ", tensor parallelism what each block saves"
        if any(c > 1 for _, c, _ in sizes):
            more += ", context parallelism each sequence's activations"
        raise ValueError(f"nothing fits {budget_text}: the smallest configuration ({small.config.describe()}) "
                         f"needs {small.peak['total'] / MiB:.1f} MiB ({peak_parts(small.peak)} MiB). Use a budget of at "
                         f"least {small.peak['total'] / (1 - headroom) / MiB:.1f} MiB, a smaller model or shorter "
                         f"samples, or more ranks ({more}).{unsearched}")
    best = fits[0]
    why = explain(best, fits, meas, model, device, world_size, global_batch, usable, budget_text,
                  unsearched, tp_bandwidth, host_bandwidth)
    return Plan(best.config, best.peak["total"], best.samples_per_s, memory_budget_bytes, world_size,
                best.peak, why, candidates, meas)
