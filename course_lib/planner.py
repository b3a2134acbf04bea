"""Plan a training configuration for a memory budget (chapter 12, the capstone): measure, predict, search.

For every combination of precision (chapter 05), micro-batch with gradient accumulation (chapters 02-03),
activation checkpointing (chapter 05), ZeRO stage (chapter 08), tensor-parallel size (chapter 10), and chapter
11's fused attention, chunked loss and activation offload, predict the peak bytes per device and the step time;
keep the fastest that fits. The module reads in that order:

1. **measure**: ``train_step`` runs a ``Config``, ``measure_peak`` measures it, ``calibrate`` measures a model once;
2. **predict**: ``predict_peak``, ``comm_bytes``, ``predict_step_time``: arithmetic on the measurements;
3. **search**: ``plan`` weighs every candidate, keeps the fastest that fits, and says why.

Memory: a step peaks in the forward/backward pass (states + saved activations + the running op's temporaries:
affine in the micro-batch ``m``) or in the optimizer step (states + Adam's temporaries: constant). A line through
whole-step peaks at ``m = 1, 2`` sees the optimizer moment (a maximum of two lines is not a line), so the two are
measured apart: ``fb`` with the gradients allocated, at ``m = 1, 2``. Checkpointing follows from the bytes one
block saves (Chen et al. 2016: ``k - 1`` segment inputs kept, at most ``ceil(n/k)`` blocks rebuilt at once); ZeRO
divides the states (``memory.zero_memory``) and adds what is in flight (chapter 08). Tensor parallelism over
``t`` of the ``world = d x t`` ranks splits the blocks' weights and what they save per sequence (``tp_costs``,
chapter 10); ZeRO then runs over the ``d`` data-parallel ranks. Fused attention is another kernel, so it is
measured like a precision (its own ``fb`` line); offloading and the chunked loss are chapter 11's formulas on
top of a measured pass (``offload.predict_offload_peak``, ``chunked_loss.predict_loss_peak``). Time is relative,
since timings on a busy machine are noisy: ``A (alpha + beta m)(1 + recompute + extra head) + update +
communication / bandwidth + offload traffic / host bandwidth``, with data parallelism's traffic at an inter-node
bandwidth and tensor parallelism's per-layer collectives at an intra-node one.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import math
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from course_lib import chunked_loss, memory, offload
from course_lib.checkpointing import checkpointed_sequential, fastest_times, recomputed_blocks, segment_plan
from course_lib.distributed import tp_costs
from course_lib.distributed.zero import DEFAULT_BUCKET_MB, bucket_sizes, zero_bytes_per_rank
from course_lib.models import CausalSelfAttention, TransformerBlock, lm_loss

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
BatchFn = Callable[[int], "tuple[torch.Tensor, torch.Tensor]"]
MiB = 2**20
# A backward costs about two forwards (6N FLOPs per token, 2N forward + 4N backward; Kaplan et al. 2020,
# section 2.1): rerunning a forward costs a third of a step.
FORWARD_SHARE = 1 / 3
# Data parallelism's traffic (gradients; ZeRO-3's gathers): one PCIe 4.0 x16 link moves about 25 GB/s in
# practice (nominal 32 GB/s), as does a 200 Gb/s InfiniBand port between nodes; pass your interconnect's measured
# all-reduce bandwidth instead (chapter 06).
DEFAULT_BANDWIDTH = 25e9
# Tensor parallelism's per-layer collectives stay inside a node (chapter 10): NVLink 4 moves 450 GB/s each way
# per H100 SXM GPU (NVIDIA's Hopper architecture page; nominal, a real all-reduce reaches less).
DEFAULT_TP_BANDWIDTH = 450e9
# Offloaded activations cross the host link twice per byte (chapter 11): PCIe 4.0 x16 again, about 25 GB/s in
# practice (PCIe 5.0 x16 doubles it). ``offload.OffloadToHost`` copies on the compute stream: the copies add to
# the step's time instead of hiding behind it.
DEFAULT_HOST_BANDWIDTH = 25e9
# The prediction's error measured in chapter 12 is a few percent either way, and allocators fragment.
DEFAULT_HEADROOM = 0.05
TIMING_MAX_MICRO = 64  # larger timed passes would slow planning and add little
# A chunk of the loss keeps at least this many tokens at micro-batch 1: with fewer, chapter 11's formula for the
# loss's peak falls a few percent below the measured one (the many chunks' bookkeeping), and the peak has long
# stopped falling (it is down to the head's weight gradient).
MIN_CHUNK_TOKENS = 8


# ----- 1. measure: run a configuration, measure a step, calibrate a model ----------------------


@dataclass(frozen=True)
class Config:
    """One way to run a training step on each rank."""

    precision: str          # "fp32", or "bf16" autocast (weights, gradients, optimizer state stay fp32)
    micro_batch: int
    accumulation_steps: int
    segments: int           # checkpoint segments over ``model.blocks``; 1 = no checkpointing
    zero_stage: int         # over the data-parallel ranks; 0 = plain data parallel (or one device)
    tp: int = 1             # tensor-parallel ranks sharing each block; the world / tp others are data-parallel
    sequence_parallel: bool = False  # with tp > 1: the LayerNorm regions cut along the sequence (chapter 10)
    fused: bool = False     # every CausalSelfAttention runs F.scaled_dot_product_attention (chapter 11), else op by op
    offload: bool = False   # what the blocks save waits in host memory until the backward pass (chapter 11)
    loss_chunks: int = 1    # the loss over the vocabulary in this many token chunks (chapter 11); 1 = whole

    def __post_init__(self) -> None:
        if self.loss_chunks < 1:
            raise ValueError(f"loss_chunks must be >= 1, got {self.loss_chunks}")
        if self.offload and (self.segments > 1 or self.zero_stage == 3):
            raise ValueError("offload moves what the blocks save: not with checkpointing (which saves only the "
                             "segment inputs) nor with ZeRO-3, whose gathered weights the hooks would copy too")
        if self.tp > 1 and (self.fused or self.offload or self.loss_chunks > 1):
            raise ValueError("the course's tensor-parallel block (chapter 10) runs op-by-op attention, the whole "
                             "loss and no offload: use fused, offload and loss_chunks with tp = 1")

    @property
    def pass_key(self) -> str:
        """The measured forward/backward pass this runs: the keys of ``Measurements``' lines (``pass_key``)."""
        return pass_key(self.precision, self.fused)

    def describe(self) -> str:
        ckpt = "no checkpointing" if self.segments == 1 else f"checkpointing in {self.segments} segments"
        text = (f"{self.precision}, micro-batch {self.micro_batch} x {self.accumulation_steps} accumulation "
                f"steps, {ckpt}, ZeRO stage {self.zero_stage}")
        if self.tp > 1:
            text += f", tensor parallel over {self.tp}"
            text += " with sequence parallelism" if self.sequence_parallel else ""
        return ", ".join([text, *self.memory_options()])

    def memory_options(self) -> list[str]:
        """Chapter 11's options this configuration uses, in words."""
        return ((["fused attention"] if self.fused else [])
                + ([f"the loss in {self.loss_chunks} chunks"] if self.loss_chunks > 1 else [])
                + (["activations offloaded to the host"] if self.offload else []))


def autocast(precision: str, device: torch.device | str):
    """bf16 autocast for ``"bf16"``, nothing for ``"fp32"``."""
    if precision not in ("fp32", "bf16"):
        raise ValueError(f"unknown precision {precision!r}: choose 'fp32' or 'bf16'")
    return torch.autocast(torch.device(device).type, dtype=torch.bfloat16) if precision == "bf16" else nullcontext()


@contextmanager
def _blocks_replaced(model: nn.Module, what: str, wrap: Callable[[nn.Sequential], nn.Module]) -> Iterator[nn.Module]:
    """Inside the block ``model.blocks`` is ``wrap(model.blocks)``; restored after, also after an error.

    The model's forward calls ``self.blocks``: swapping that one child for a wrapper of the same blocks (same
    parameters) changes the step and nothing else, and copies nothing.
    """
    blocks = getattr(model, "blocks", None)
    if not isinstance(blocks, nn.Sequential):
        raise ValueError(f"{what} needs a model whose `blocks` attribute is an nn.Sequential")
    model.blocks = wrap(blocks)
    try:
        yield model
    finally:
        model.blocks = blocks


@contextmanager
def checkpointing(model: nn.Module, segments: int) -> Iterator[nn.Module]:
    """Inside the block, ``model.blocks`` runs checkpointed in ``segments`` segments (1: unchanged); restored after."""
    if segments == 1:
        yield model
        return
    with _blocks_replaced(model, "checkpointing", lambda blocks: checkpointed_sequential(blocks, segments)):
        yield model


@contextmanager
def offloading(model: nn.Module, on: bool = True) -> Iterator[nn.Module]:
    """Inside the block, every block of ``model.blocks`` saves into host memory (``offload.OffloadToHost``, the
    parameters left in place): pinned on CUDA; on a CPU machine chapter 11's simulation, NumPy memory that the
    allocator does not count. ``on=False``: unchanged."""
    if not on:
        yield model
        return
    hooks = offload.OffloadToHost(keep=model.parameters(), pin_memory=next(model.parameters()).is_cuda)
    with _blocks_replaced(model, "offloading", lambda blocks: offload.offload_blocks(blocks, hooks)):
        yield model


@contextmanager
def attention_kernel(model: nn.Module, fused: bool) -> Iterator[nn.Module]:
    """Inside the block every ``CausalSelfAttention`` of ``model`` runs fused (chapter 11) or op by op; restored
    after. Only the kernel changes: the same parameters, the same function."""
    layers = [m for m in model.modules() if isinstance(m, CausalSelfAttention)]
    if fused and not layers:
        raise ValueError("fused attention needs a model with CausalSelfAttention layers (course_lib.models)")
    before = [m.fused for m in layers]
    for m in layers:
        m.fused = fused
    try:
        yield model
    finally:
        for m, was in zip(layers, before):
            m.fused = was


def train_step(model: nn.Module, loss_fn: LossFn, inputs: torch.Tensor, targets: torch.Tensor,
               optimizer: torch.optim.Optimizer, config: Config) -> float:
    """One optimizer step of ``config`` on one rank's batch; the mean loss.

    With ``config.loss_chunks > 1`` the loss is ``chunked_loss.transformer_loss``: ``lm_loss`` in chunks, so
    ``loss_fn`` must be ``lm_loss``.
    """
    if len(inputs) != config.micro_batch * config.accumulation_steps:
        raise ValueError(f"the batch has {len(inputs)} samples; {config.describe()} needs "
                         f"{config.micro_batch * config.accumulation_steps}")
    if config.loss_chunks > 1 and loss_fn is not lm_loss:
        raise ValueError("a loss in chunks is models.lm_loss computed from the head's input: pass loss_fn=lm_loss, "
                         "or loss_chunks=1 for another loss")
    optimizer.zero_grad(set_to_none=True)
    total = 0.0
    with (checkpointing(model, config.segments), attention_kernel(model, config.fused),
          offloading(model, config.offload)):
        for x, y in zip(inputs.split(config.micro_batch), targets.split(config.micro_batch)):
            with autocast(config.precision, inputs.device):
                loss = (chunked_loss.transformer_loss(model, x, y, config.loss_chunks) if config.loss_chunks > 1
                        else loss_fn(model(x), y))
                loss = loss / config.accumulation_steps  # equal micro-batches, equal weights
            loss.backward()  # frees this micro-batch's activations before the next forward
            total += loss.item()
    optimizer.step()
    return total


def measure_peak(model: nn.Module, loss_fn: LossFn, inputs: torch.Tensor, targets: torch.Tensor,
                 optimizer: torch.optim.Optimizer, config: Config) -> int:
    """Measured peak bytes of one ``train_step``, counted as ``predict_peak`` counts (states + batch + transients).

    Call it after a first step (Adam makes its state then). The gradients are freed first: the CPU profiler
    cannot see the free of a tensor made before it started.
    """
    optimizer.zero_grad(set_to_none=True)
    resident = (memory.param_bytes(model) + memory.optimizer_state_bytes(optimizer)
                + memory.tensor_bytes(inputs) + memory.tensor_bytes(targets))
    return resident + memory.peak_bytes(lambda: train_step(model, loss_fn, inputs, targets, optimizer, config),
                                        inputs.device)


@dataclass(frozen=True)
class Layers:
    """The blocks tensor parallelism can split (chapter 10): ``model.blocks`` all ``TransformerBlock``s alike."""

    heads: int
    width: int
    seq_len: int
    dropout: bool
    split_share: float                       # of the model's parameters: the blocks' 12h² + 7h that TP splits
    block_split_share: float                 # of one block's parameters


def transformer_layers(model: nn.Module, sample_shape: tuple[int, ...]) -> Layers | None:
    """What ``Layers`` says of ``model``, or None when its blocks are not all alike ``TransformerBlock``s."""
    blocks = getattr(model, "blocks", None)
    if (len(sample_shape) != 1 or not isinstance(blocks, nn.Sequential) or not len(blocks)
            or not all(isinstance(b, TransformerBlock) for b in blocks)):
        return None
    kinds = {(b.attn.n_heads, b.attn.proj.in_features, isinstance(b.attn.attn_drop, nn.Dropout)) for b in blocks}
    if len(kinds) != 1:
        return None
    (heads, width, dropout), = kinds
    split, whole = tp_costs.block_param_split(width)
    total = sum(p.numel() for p in model.parameters())
    return Layers(heads, width, sample_shape[0], dropout, len(blocks) * split / total, split / (split + whole))


def tp_sizes(layers: Layers | None, world_size: int, sequence_parallel: bool = True) -> list[int]:
    """Tensor-parallel sizes that divide the world and the heads (and, with sequence parallelism, the sequence)."""
    if layers is None:
        return [1]
    return [t for t in range(1, world_size + 1) if world_size % t == 0 and layers.heads % t == 0
            and (not sequence_parallel or layers.seq_len % t == 0)]


@dataclass(frozen=True)
class LmHead:
    """A language model whose loss can be computed in chunks (chapter 11): ``embed``, ``blocks``, ``head.ln``
    and the ``head.out`` Linear of ``models.TinyTransformer``, trained with ``lm_loss``."""

    tokens: int                              # per sample: the sequence length
    vocab: int
    width: int


def lm_head(model: nn.Module, sample_shape: tuple[int, ...], loss_fn: LossFn | None = None) -> LmHead | None:
    """What ``LmHead`` says of ``model`` and its loss, or None when ``transformer_loss`` cannot chunk it."""
    head = getattr(model, "head", None)
    out = getattr(head, "out", None)
    if (loss_fn not in (None, lm_loss) or len(sample_shape) != 1 or not isinstance(out, nn.Linear)
            or not isinstance(getattr(head, "ln", None), nn.LayerNorm) or not hasattr(model, "embed")
            or not isinstance(getattr(model, "blocks", None), nn.Sequential)):
        return None
    return LmHead(sample_shape[0], out.out_features, out.in_features)


@dataclass
class Measurements:
    """What ``calibrate`` measured; the inputs of ``predict_peak`` and ``predict_step_time``.

    The dicts are keyed by ``Config.pass_key``: a precision, with " fused" for fused attention.
    """

    n_blocks: int
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    unit_bytes: int                          # parameters of the largest block (ZeRO-3 gathers one whole)
    bucket_bytes: int                        # the largest gradient bucket of ZeroOptimizer (ZeRO-2 reduces one whole)
    gloo: bool                               # ranks on the CPU: gloo, whose reduce-scatter copies its input first
    batch_bytes_per_sample: int              # inputs + targets
    fb: dict[str, tuple[float, float]]       # pass -> (c, d): forward+backward peak above the states
    block: dict[str, tuple[float, float]]    # pass -> (c, d): bytes one block saves for backward
    boundary_per_sample: dict[str, float]    # pass -> bytes of one block's output per sample
    time: dict[str, tuple[float, float]]     # pass -> (alpha, beta): seconds of one micro-batch
    timing_micro: int                        # the second micro-batch the time line was measured at
    optimizer_tmp_bytes: int
    optimizer_s: float
    block_flop_share: float                  # fraction of the forward FLOPs spent in ``model.blocks``
    layers: Layers | None = None             # what tensor parallelism can split; None: nothing
    lm: LmHead | None = None                 # what chunking the loss needs; None: it cannot be chunked
    loss: dict[str, tuple[float, float]] = field(default_factory=dict)  # pass -> (c, d): the head's loss alone,
    #                                          forward + backward peak above its input (with ``lm``)
    head_flop_share: float = 0.0             # fraction of the forward FLOPs in the head (with ``lm``)
    packed: dict[str, tuple[float, float]] = field(default_factory=dict)  # pass -> (c, d): bytes one block's
    #                                          saved-tensor hooks pack, what offloading copies (when measured)


@contextmanager
def _left_as_it_was(model: nn.Module) -> Iterator[None]:
    """Restore the mode, the buffers, every module's extra state (MABN's step) and the gradients afterwards."""
    mode, grads = model.training, [(p, p.grad) for p in model.parameters()]
    buffers = [(v, v.clone()) for v in model.buffers()]  # BatchNorm's running statistics and counts
    extra = [(m, copy.deepcopy(m.get_extra_state())) for m in model.modules()
             if type(m).get_extra_state is not nn.Module.get_extra_state]
    for p, _ in grads:
        p.grad = None
    try:
        yield
    finally:
        with torch.no_grad():
            for v, saved in buffers:
                v.copy_(saved)
        for m, state in extra:
            m.set_extra_state(state)
        for p, g in grads:
            p.grad = g
        model.train(mode)


def default_batch(model: nn.Module, sample_shape: tuple[int, ...],
                  device: torch.device | str) -> tuple[BatchFn, LossFn]:
    """Random batches and a loss: token ids and ``lm_loss`` for a model with an embedding (``sample_shape =
    (seq_len,)``), else inputs of ``sample_shape`` (e.g. ``(3, 32, 32)``) and cross-entropy over its outputs."""
    gen = torch.Generator().manual_seed(0)  # private: planning leaves the global RNG alone
    emb = next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
    if emb is not None:
        if len(sample_shape) != 1:
            raise ValueError(f"a token model takes samples of shape (seq_len,), got {tuple(sample_shape)}")
        def tokens(m: int):
            idx = torch.randint(0, emb.num_embeddings, (m, sample_shape[0] + 1), generator=gen)
            return idx[:, :-1].to(device), idx[:, 1:].to(device)
        return tokens, lm_loss
    with _left_as_it_was(model), torch.no_grad():  # one forward for the number of classes
        classes = model(torch.zeros(1, *sample_shape, device=device)).shape[-1]
    return (lambda m: (torch.randn(m, *sample_shape, generator=gen).to(device),
                       torch.randint(0, classes, (m,), generator=gen).to(device))), F.cross_entropy


def _line(x1: float, y1: float, x2: float, y2: float) -> tuple[float, float]:
    d = (y2 - y1) / (x2 - x1)
    return y1 - d * x1, d


def pass_key(precision: str, fused: bool) -> str:
    """The name of a measured forward/backward pass: its precision, and " fused" for fused attention."""
    return precision + (" fused" if fused else "")


def _inputs_of(model: nn.Module, modules: list[nn.Module], x: torch.Tensor, precision: str, fused: bool,
               device: torch.device) -> list[torch.Tensor]:
    """What each of ``modules`` receives in one forward of ``model`` on ``x``, detached (no graph is kept)."""
    got: dict[int, torch.Tensor] = {}
    hooks = [mod.register_forward_pre_hook(lambda mod, args, i=i: got.update({i: args[0].detach()}))
             for i, mod in enumerate(modules)]
    try:
        with torch.no_grad(), attention_kernel(model, fused), autocast(precision, device):
            model(x)
    finally:
        for h in hooks:
            h.remove()
    return [got[i] for i in range(len(modules))]


def calibrate(model: nn.Module, make_batch: BatchFn, loss_fn: LossFn, device: torch.device,
              precisions: tuple[str, ...], max_micro: int, budget: int,
              bucket_cap_mb: float = DEFAULT_BUCKET_MB, fused: tuple[bool, ...] = (False,),
              lm: LmHead | None = None, packed: bool = False) -> Measurements:
    """Measure ``model`` in place on ``device`` and leave it as it was (Adam with ``lr=0`` moves no weight).

    For each pass (each precision, with each attention kernel in ``fused``): memory at micro-batches 1 and 2
    (each part is affine in the micro-batch: two points give exact lines), what one block saves for backward,
    the time of a pass at 1 and at the largest power of two up to ``max_micro`` whose predicted peak fits
    ``budget``; then the optimizer step, and the share of the forward FLOPs in the blocks. With ``lm``, also the
    peak of the head's loss alone (what a chunked loss replaces) and the head's FLOP share; with ``packed``, the
    bytes one block's saved-tensor hooks pack (what offloading copies).
    """
    blocks = model.blocks if isinstance(getattr(model, "blocks", None), nn.Sequential) else nn.Sequential()
    watched = [blocks] + ([model.head] if lm is not None and len(blocks) else [])
    x1, y1 = make_batch(1)
    lines: dict[str, dict] = {name: {} for name in ("fb", "block", "loss", "packed")}
    bnd, passes, inputs = {}, {}, {}
    with _left_as_it_was(model):
        model.train()
        opt = torch.optim.Adam(model.parameters(), lr=0.0)  # lr=0: the same state and temporaries, no update
        for prec, kernel in [(p, f) for p in precisions for f in fused]:
            key = pass_key(prec, kernel)

            def fwd_bwd(x, y, prec=prec, kernel=kernel):
                with attention_kernel(model, kernel), autocast(prec, device):
                    loss = loss_fn(model(x), y)
                loss.backward()
            fwd_bwd(x1, y1)
            opt.step()  # gradients and Adam's state exist from here on: measured above them
            points: dict[str, list] = {name: [] for name in lines}
            for m in (1, 2):
                x, y = make_batch(m)
                points["fb"].append(memory.peak_bytes(lambda: fwd_bwd(x, y), device))
                if not len(blocks):
                    continue
                inputs[m] = _inputs_of(model, watched, x, prec, kernel, device)
                with attention_kernel(model, kernel), autocast(prec, device):
                    # what one block saves, and its output (a segment boundary)
                    points["block"].append(memory.saved_activation_bytes(lambda: blocks[0](inputs[m][0]),
                                                                         blocks[0].parameters()))
                    bnd[key] = memory.tensor_bytes(blocks[0](inputs[m][0])) / m
                    if packed:  # what the hooks copy: a tensor saved by two ops is packed twice
                        hooks = offload.OffloadToHost(keep=model.parameters())
                        with hooks:
                            blocks[0](inputs[m][0])
                        points["packed"].append(hooks.copied_bytes)
                if lm is not None:  # the head and the loss alone, from the head's input
                    h = inputs[m][1].requires_grad_()

                    def head_loss(h=h, y=y, prec=prec):
                        with autocast(prec, device):
                            loss = loss_fn(model.head(h), y)
                        loss.backward()
                    points["loss"].append(memory.peak_bytes(head_loss, device))
            for name, values in points.items():
                if values:
                    lines[name][key] = _line(1, values[0], 2, values[1])
            lines["block"].setdefault(key, (0.0, 0.0))
            passes[key] = fwd_bwd
        opt_tmp = memory.peak_bytes(opt.step, device)
        states = memory.param_bytes(model) + memory.grad_bytes(model) + memory.optimizer_state_bytes(opt)
        batch_bytes = sum(memory.tensor_bytes(t) for t in (x1, y1))
        fits = lambda m: all(states + batch_bytes * m + c + d * m <= budget  # noqa: E731
                             for c, d in lines["fb"].values())
        tm = max([2**i for i in range(int(math.log2(max_micro)) + 1) if fits(2**i)], default=1)
        xt, yt = make_batch(tm)
        sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
        steps = {"opt": lambda: (opt.step(), sync())}
        for key, f in passes.items():
            steps[f"{key}/1"] = lambda f=f: (f(x1, y1), sync())
            steps[f"{key}/{tm}"] = lambda f=f: (f(xt, yt), sync())
        best = fastest_times(steps, repeats=3)  # in turns, fastest of three: the least disturbed run
        share = {"blocks": 0.0, "head": 0.0}
        if len(blocks):  # the FLOP shares of the blocks (what checkpointing reruns) and of the head
            with torch.no_grad(), FlopCounterMode(display=False) as total_flops:
                model(x1)
            for part, module, arg in zip(share, watched, inputs[1]):
                with torch.no_grad(), FlopCounterMode(display=False) as flops:
                    module(arg)
                share[part] = flops.get_total_flops() / max(total_flops.get_total_flops(), 1)
        counts = dict(param_bytes=memory.param_bytes(model), grad_bytes=memory.grad_bytes(model),
                      optimizer_bytes=memory.optimizer_state_bytes(opt))
    times = {}
    for key in passes:
        t1, tb = best[f"{key}/1"], best[f"{key}/{tm}"]
        alpha, beta = _line(1, t1, tm, tb) if tm > 1 else (0.0, t1)
        # noise can make the slope <= 0: keep it positive, so a larger micro-batch never looks slower
        times[key] = (max(alpha, 0.0), max(beta, 1e-3 * tb / tm))
    units = [memory.param_bytes(b) for b in blocks] or [memory.param_bytes(c) for c in model.children()] or [0]
    trainable = [p for p in model.parameters() if p.requires_grad]
    return Measurements(n_blocks=len(blocks), **counts, unit_bytes=max(units),
                        bucket_bytes=max(bucket_sizes(trainable, bucket_cap_mb), default=0),
                        gloo=device.type == "cpu", batch_bytes_per_sample=batch_bytes, fb=lines["fb"],
                        block=lines["block"], boundary_per_sample=bnd, time=times, timing_micro=tm,
                        optimizer_tmp_bytes=opt_tmp, optimizer_s=best["opt"], block_flop_share=share["blocks"],
                        layers=transformer_layers(model, tuple(x1.shape[1:])), lm=lm, loss=lines["loss"],
                        head_flop_share=share["head"], packed=lines["packed"])


# ----- 2. predict: arithmetic on the measurements -------------------------------------------


def tp_shares(meas: Measurements, config: Config, world_size: int) -> tuple[int, float, float]:
    """(data-parallel ranks, share of the model states, share of one block's parameters) one rank keeps under
    ``config.tp``-way tensor parallelism: ``1/t`` of the split weights and all of the others (chapter 10)."""
    t, layers = config.tp, meas.layers
    if t < 1 or world_size % t:
        raise ValueError(f"tensor-parallel size {t} does not divide the {world_size} ranks")
    if t == 1:
        return world_size, 1.0, 1.0
    if layers is None or layers.heads % t:
        raise ValueError(f"tensor parallelism over {t} ranks needs transformer blocks whose heads {t} divides")
    if config.sequence_parallel and layers.seq_len % t:
        raise ValueError(f"sequence parallelism over {t} ranks cuts the sequence: {layers.seq_len} tokens do not "
                         f"split; choose a sequence length divisible by {t}")
    return (world_size // t, layers.split_share / t + 1 - layers.split_share,
            layers.block_split_share / t + 1 - layers.block_split_share)


def _measured(meas: Measurements, line: str, config: Config) -> tuple[float, float]:
    """``config``'s measured line ``line`` (``fb``, ``block``, ``time``, ``loss``, ``packed``), or a clear error."""
    lines = getattr(meas, line)
    if config.pass_key not in lines:
        what = {"loss": "the peak of the loss alone (measured for a loss that can be chunked)",
                "packed": "the bytes offloading copies (measured by plan(..., offload=True))"}.get(
                    line, f"the {config.pass_key} pass")
        raise ValueError(f"these measurements lack {what} for {config.describe()}; they have {sorted(lines)}")
    return lines[config.pass_key]


def block_saves(meas: Measurements, config: Config) -> tuple[float, float, float]:
    """Bytes one block saves for backward on one rank, ``(constant, per sample)``, and its output per sample.

    Measured on the whole block; under tensor parallelism each rank keeps the share of the per-sample part that
    ``tp_costs.saved_fraction_per_rank`` gives (torch's ``SequenceParallel``: gathered inputs saved), and with
    sequence parallelism its shard of the output. The constant part (the causal mask; under autocast also bf16
    weight copies, which TP would split too: an overestimate) stays whole.
    """
    const, per_sample = _measured(meas, "block", config)
    boundary = meas.boundary_per_sample.get(config.pass_key, 0.0)
    if config.tp == 1:
        return const, per_sample, boundary
    layers, sp = meas.layers, config.sequence_parallel
    kept = tp_costs.saved_fraction_per_rank(layers.seq_len, layers.width, layers.heads, config.tp, sp,
                                            act_bytes=2 if config.precision == "bf16" else 4, dropout=layers.dropout)
    return const, per_sample * kept, boundary / (config.tp if sp else 1)


def predict_peak(meas: Measurements, config: Config, world_size: int = 1) -> dict:
    """Predicted peak bytes on one rank: ``params, grads, optimizer, batch, transient, total`` and ``where``.

    ``transient`` is the larger of the forward/backward part (activations, temporaries, what ZeRO has in flight)
    and the optimizer step's temporaries; ``where`` names it. The forward/backward part assumes the gradients
    exist, as they do from the second micro-batch on: a single micro-batch is overstated by up to its gradients,
    never understated (at any moment of its backward some exist, and no more activations than at the start).
    Offload and the chunked loss are chapter 11's formulas: an offloaded pass keeps one block's saves of its ``n``
    (an upper estimate: the backward brings them back one node at a time), and a chunked loss replaces the
    measured peak of the whole loss by ``chunked_loss.predict_loss_peak``.
    """
    n, k, m, s = meas.n_blocks, config.segments, config.micro_batch, config.zero_stage
    N, share, block_share = tp_shares(meas, config, world_size)  # N: the ranks ZeRO shards over
    c, slope = _measured(meas, "fb", config)
    _, per_sample, boundary = block_saves(meas, config)
    fb = c + slope * m - n * (_measured(meas, "block", config)[1] - per_sample) * m  # TP: the blocks keep less
    if k > 1:  # keep k-1 segment inputs; rebuild one segment (at most ceil(n/k) blocks) at a time
        # Only the per-sample part of a block's saves goes: the constant part is bf16 weight copies (and
        # buffers), which autocast's cache keeps to the end of the forward pass, checkpointed or not.
        rebuilt = max(len(r) for r in segment_plan(n, k))
        fb -= ((n - rebuilt) * per_sample - (k - 1) * boundary) * m
    if config.offload:  # no recompute: the blocks' saves wait on the host (the constant part stays, as above)
        fb = offload.predict_offload_peak(fb, n, per_sample * m)
    if config.loss_chunks > 1:  # the whole loss's peak out, the chunked loss's in
        whole_c, whole_d = _measured(meas, "loss", config)
        lm = meas.lm
        fb += (chunked_loss.predict_loss_peak(m * lm.tokens, lm.vocab, lm.width, config.loss_chunks)
               - whole_c - whole_d * m)
    # the states: ZeRO's formula, with the bytes one TP rank holds as the bytes of one "parameter"
    states = zero_bytes_per_rank(share, N, s, meas.param_bytes, meas.grad_bytes, meas.optimizer_bytes)
    in_flight = 0.0
    if N > 1 and s == 2:  # ZeroOptimizer: one bucket's full gradient (plus gloo's copy of it) and its slice
        in_flight = meas.bucket_bytes * share * (1 + meas.gloo + 1 / N)
    elif N > 1 and s == 3:  # FSDP2: one block gathered, the next prefetched, one block's gradient (and gloo's copy)
        in_flight = meas.unit_bytes * block_share * (3 + meas.gloo)
    opt_tmp = meas.optimizer_tmp_bytes * share / (N if s >= 1 else 1)  # the update runs on this rank's shard
    parts = dict(**states, batch=meas.batch_bytes_per_sample * m * config.accumulation_steps,
                 transient=max(fb + in_flight, opt_tmp))
    out: dict = {key: int(math.ceil(v)) for key, v in parts.items()}
    out["total"] = sum(out.values())
    out["where"] = "forward/backward" if fb + in_flight >= opt_tmp else "optimizer step"
    return out


def comm_bytes(param_bytes: int, config: Config, world_size: int) -> float:
    """Bytes one rank sends per optimizer step, in ring collectives (chapter 08), accumulation included.

    DDP (accumulating under ``no_sync``) and ZeRO-1 send twice the ring share ``(N-1)/N x P`` once per step.
    Sharded gradients cannot accumulate locally: ZeRO-2 reduce-scatters after every micro-batch and all-gathers
    once (A + 1); ZeRO-3 also gathers the parameters for every forward and backward (3A). (FSDP2's
    ``set_requires_gradient_sync(False)`` keeps unsharded gradients instead: less traffic, more memory.)
    """
    share = (world_size - 1) / world_size * param_bytes
    a = config.accumulation_steps
    return share * {0: 2, 1: 2, 2: a + 1, 3: 3 * a}[config.zero_stage]


def tp_comm_bytes(meas: Measurements, config: Config) -> float:
    """Bytes one rank sends per optimizer step in tensor parallelism's per-layer collectives (chapter 10).

    Four activation-sized collectives per block and micro-batch (``tp_costs.comm_bytes_per_layer``, gathered
    inputs saved). Left out, as small: the gathers before the head and of the embedding's gradient, and under
    sequence parallelism the once-per-step sum of the LayerNorms' gradients.
    """
    if config.tp == 1:
        return 0.0
    layers, act = meas.layers, 2 if config.precision == "bf16" else 4
    per_block = tp_costs.comm_bytes_per_layer(layers.seq_len, config.micro_batch, layers.width, config.tp,
                                              config.sequence_parallel, regather=False, act_bytes=act)
    return config.accumulation_steps * meas.n_blocks * sum(per_block.values())


def offload_bytes(meas: Measurements, config: Config) -> float:
    """Bytes over the host link per optimizer step of an offloading ``config`` (``offload.offload_traffic_bytes``)."""
    if not config.offload:
        return 0.0
    c, d = _measured(meas, "packed", config)
    per_block = int(round(c + d * config.micro_batch))
    return config.accumulation_steps * offload.offload_traffic_bytes(meas.n_blocks, per_block)


def predict_step_time(meas: Measurements, config: Config, world_size: int = 1,
                      bandwidth: float = DEFAULT_BANDWIDTH, tp_bandwidth: float = DEFAULT_TP_BANDWIDTH,
                      host_bandwidth: float = DEFAULT_HOST_BANDWIDTH) -> float:
    """Predicted seconds of one optimizer step: good for ranking configurations, rough in absolute terms.

    ``bandwidth``: bytes per second of data parallelism's collectives; ``tp_bandwidth``: of tensor parallelism's;
    ``host_bandwidth``: of offloading's copies. A chunked loss runs the head's matmul once more (chapter 11).
    """
    alpha, beta = _measured(meas, "time", config)
    dp, share, _ = tp_shares(meas, config, world_size)
    # a TP rank runs 1/t of the blocks' FLOPs and all the rest (embedding, head, loss)
    blocks = meas.block_flop_share / config.tp
    work = 1 - meas.block_flop_share + blocks
    recompute = 0.0
    if config.segments > 1:
        recompute = FORWARD_SHARE * blocks / work * recomputed_blocks(meas.n_blocks, config.segments) / meas.n_blocks
    head = FORWARD_SHARE * meas.head_flop_share / work if config.loss_chunks > 1 else 0.0  # one more forward
    compute = config.accumulation_steps * (alpha + beta * config.micro_batch * work) * (1 + recompute + head)
    update = meas.optimizer_s * share / (dp if config.zero_stage >= 1 else 1)
    return (compute + update + comm_bytes(meas.param_bytes * share, config, dp) / bandwidth
            + tp_comm_bytes(meas, config) / tp_bandwidth + offload_bytes(meas, config) / host_bandwidth)


# ----- 3. search: every candidate, the fastest that fits, and why ------------------------------


@dataclass
class Candidate:
    """One (pass, segments, layout, stage, offload, loss chunks) at its largest fitting micro-batch (at 1 if none
    fits)."""

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

    @property
    def mesh(self) -> tuple[int, int]:
        """(data-parallel, tensor-parallel) ranks of the chosen configuration."""
        return self.world_size // self.config.tp, self.config.tp

    def table(self, limit: int | None = None) -> str:
        """The candidates, fastest first (then those that do not fit), one line each."""
        rows = [f"{'precision':>9} {'chapter 11':>18} {'segments':>8} {'d x t':>5} {'ZeRO':>4} {'micro':>5} "
                f"{'accum':>5} {'peak MiB':>9} {'samples/s':>9}"]
        for c in sorted(self.candidates, key=lambda c: (-c.samples_per_s, c.peak["total"]))[:limit]:
            m, a = (c.config.micro_batch, c.config.accumulation_steps) if c.fits else ("-", "-")
            note = "  <- chosen" if c.config == self.config else ("" if c.fits else "  (micro-batch 1 too big)")
            mesh = f"{self.world_size // c.config.tp}x{c.config.tp}"
            rows.append(f"{c.config.precision:>9} {_options(c.config):>18} {c.config.segments:>8} {mesh:>5} "
                        f"{c.config.zero_stage:>4} {m:>5} {a:>5} {c.peak['total'] / MiB:9.1f} "
                        f"{c.samples_per_s:9.1f}{note}")
        return "\n".join(rows)


def segment_options(n_blocks: int) -> list[int]:
    """For each size of the largest segment, the fewest segments that give it (fewer segments recompute less).

    A block saves far more than its output, so more segments keep lowering the peak, past Chen's ``sqrt(n)``.
    """
    sizes = {math.ceil(n_blocks / k) for k in range(1, n_blocks + 1)}
    return sorted(min(k for k in range(1, n_blocks + 1) if math.ceil(n_blocks / k) == s) for s in sizes) or [1]


def _options(config: Config) -> str:
    """Chapter 11's options of ``config``, in a few characters: fused attention, loss chunks, offload."""
    names = ["fused"] * config.fused + [f"loss/{config.loss_chunks}"] * (config.loss_chunks > 1)
    return " ".join(names + ["offload"] * config.offload) or "-"


def _parts(peak: dict) -> str:
    return ", ".join(f"{k} {peak[k] / MiB:.1f}" for k in ("params", "grads", "optimizer", "batch", "transient"))


def _layouts(model: nn.Module, sample_shape: tuple[int, ...], global_batch: int, world_size: int,
             tensor_parallel: bool, sequence_parallel: bool) -> list[int]:
    """The tensor-parallel sizes to try: those ``tp_sizes`` allows whose data-parallel ranks split the batch."""
    sizes = tp_sizes(transformer_layers(model, sample_shape), world_size, sequence_parallel) if tensor_parallel else [1]
    ok = [t for t in sizes if global_batch % (world_size // t) == 0]
    if not ok:
        layouts = " or ".join(f"{world_size // t}x{t}" for t in sizes)
        raise ValueError(f"global batch {global_batch} does not split evenly over {world_size} ranks: use a multiple "
                         f"of {world_size}" + (f" (or of the data-parallel ranks d of a d x t layout: {layouts})"
                                              if len(sizes) > 1 else ""))
    return ok


def _switch(name: str, wanted: bool | None, pays: bool, runs: bool, needs: str) -> list[bool]:
    """The values an on/off option of ``plan`` is searched with: ``wanted=None`` where it ``pays``, ``True``
    wherever it ``runs`` (else an error naming what it ``needs``), ``False`` never."""
    if wanted and not runs:
        raise ValueError(f"{name}=True needs {needs}")
    return [False, True] if runs and (pays if wanted is None else wanted) else [False]


def _largest_fitting(meas: Measurements, shape: Config, per_rank: int, world_size: int, usable: int,
                     speed: Callable[[Config], float]) -> Candidate:
    """``shape`` at the largest micro-batch dividing ``per_rank`` whose predicted peak fits ``usable`` bytes."""
    cfgs = [dataclasses.replace(shape, micro_batch=m, accumulation_steps=per_rank // m)
            for m in range(1, per_rank + 1) if per_rank % m == 0]
    ok = [c for c in cfgs if predict_peak(meas, c, world_size)["total"] <= usable]
    cfg = ok[-1] if ok else cfgs[0]  # the largest micro-batch: fewest passes, least fixed cost
    return Candidate(cfg, bool(ok), predict_peak(meas, cfg, world_size), speed(cfg) if ok else 0.0)


def plan(model: nn.Module, sample_shape: tuple[int, ...], global_batch: int, memory_budget_bytes: int,
         world_size: int = 1, *, loss_fn: LossFn | None = None, make_batch: BatchFn | None = None,
         device: torch.device | str | None = None, precisions: tuple[str, ...] | None = None,
         headroom: float = DEFAULT_HEADROOM, bandwidth: float = DEFAULT_BANDWIDTH,
         bucket_cap_mb: float = DEFAULT_BUCKET_MB, tensor_parallel: bool = True, sequence_parallel: bool = True,
         tp_bandwidth: float = DEFAULT_TP_BANDWIDTH, fused: bool | None = None, chunk_loss: bool | None = None,
         offload: bool | None = None, host_bandwidth: float = DEFAULT_HOST_BANDWIDTH) -> Plan:
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

    ``loss_fn`` and ``make_batch(m) -> (inputs, targets)`` default to ``default_batch``'s. The model is measured in
    place on ``device`` (default: where its parameters are) and left as it was. Raises ``ValueError`` when
    nothing fits, saying what the smallest needs.
    """
    device = torch.device(device) if device is not None else next(model.parameters()).device
    if world_size < 1 or global_batch < 1 or memory_budget_bytes <= 0 or not 0 <= headroom < 1:
        raise ValueError(f"need world_size >= 1, global_batch >= 1, a positive budget and 0 <= headroom < 1; "
                         f"got {world_size}, {global_batch}, {memory_budget_bytes}, {headroom}")
    sizes = _layouts(model, tuple(sample_shape), global_batch, world_size, tensor_parallel, sequence_parallel)
    usable = int(memory_budget_bytes * (1 - headroom))
    budget_text = f"{memory_budget_bytes / MiB:.1f} MiB per device ({usable / MiB:.1f} usable)"
    states = 4 * memory.param_bytes(model) / world_size  # weights, gradients, Adam's 2 moments: ZeRO-3 at best
    if states > usable:
        raise ValueError(f"nothing fits {budget_text}: the model states alone need {states / MiB:.1f} MiB even "
                         f"fully sharded over {world_size} rank(s). Use a smaller model or more ranks.")
    if precisions is None:
        bf16 = device.type == "cpu" or (device.type == "cuda" and torch.cuda.is_bf16_supported())
        precisions = ("fp32", "bf16") if bf16 else ("fp32",)
    one_device = 1 in sizes  # chapter 11's options run without tensor parallelism
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
    largest = global_batch // (world_size // max(sizes))  # the largest share of the batch a rank runs
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
    for prec, kernel, k, t in itertools.product(precisions, kernels, segment_options(meas.n_blocks), sizes):
        if kernel and t > 1:
            continue
        dp = world_size // t
        per_rank = global_batch // dp
        # TP runs with FSDP2 over the data-parallel ranks (chapter 10); plain data parallelism takes any stage
        stages = [0] if dp == 1 else [0, 1, 2, 3] if t == 1 else [3]
        for s in stages:
            for off in offloads if t == 1 and k == 1 and s < 3 else [False]:
                shape = Config(prec, 1, per_rank, k, s, t, sequence_parallel and t > 1, kernel, off)
                listed = None
                for chunks in chunk_counts if t == 1 else [1]:
                    c = _largest_fitting(meas, dataclasses.replace(shape, loss_chunks=chunks), per_rank, world_size,
                                         usable, speed)
                    # more chunks cost a matmul of the head: listed only where they let a larger micro-batch fit
                    larger = listed is None or not listed.fits or c.config.micro_batch > listed.config.micro_batch
                    if listed is None or c.fits and larger:
                        candidates.append(c)
                        listed = c
    fits = sorted((c for c in candidates if c.fits), key=lambda c: -c.samples_per_s)
    if not fits:
        small = min(candidates, key=lambda c: c.peak["total"])
        more = "ZeRO-3 divides the model states by the world size"
        if max(sizes) > 1:
            more += ", tensor parallelism what each block saves"
        raise ValueError(f"nothing fits {budget_text}: the smallest configuration ({small.config.describe()}) "
                         f"needs {small.peak['total'] / MiB:.1f} MiB ({_parts(small.peak)} MiB). Use a budget of at "
                         f"least {small.peak['total'] / (1 - headroom) / MiB:.1f} MiB, a smaller model or shorter "
                         f"samples, or more ranks ({more}).")
    best, cfg = fits[0], fits[0].config
    dp, per_rank = world_size // cfg.tp, global_batch // (world_size // cfg.tp)
    mesh = f" on {dp} data-parallel x {cfg.tp} tensor-parallel ranks" if cfg.tp > 1 else ""
    why = [f"Chosen: {cfg.describe()}{mesh}. Predicted peak {best.peak['total'] / MiB:.1f} MiB of {budget_text} "
           f"({_parts(best.peak)} MiB; the peak is in the {best.peak['where']}), about {best.samples_per_s:.0f} "
           "samples/s."]
    bigger = [m for m in range(cfg.micro_batch + 1, per_rank + 1) if per_rank % m == 0]
    if bigger:
        nxt = dataclasses.replace(cfg, micro_batch=bigger[0], accumulation_steps=per_rank // bigger[0])
        why.append(f"Micro-batch {bigger[0]} would need {predict_peak(meas, nxt, world_size)['total'] / MiB:.1f} MiB.")
    if cfg.memory_options():
        plain = dataclasses.replace(cfg, fused=False, offload=False, loss_chunks=1)
        why.append(f"Without {' and '.join(cfg.memory_options())} it would need "
                   f"{predict_peak(meas, plain, world_size)['total'] / MiB:.1f} MiB.")
    if cfg.offload:
        why.append(f"Offloading moves {offload_bytes(meas, cfg) / 1e6:.1f} MB per step over the host link (priced "
                   f"at {host_bandwidth / 1e9:.0f} GB/s)" + ("; on a CPU machine that is chapter 11's simulation: "
                                                            "the host is the same memory, nothing is saved"
                                                            if device.type == "cpu" else "") + ".")
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
