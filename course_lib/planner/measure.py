"""Measure a model once: ``calibrate`` gives the ``Measurements`` every prediction reads (chapter 13, section 3).

A step peaks in the forward/backward pass (states + saved activations + the running op's temporaries: affine in
the micro-batch ``m``) or in the optimizer step (states + Adam's temporaries: constant). A line through
whole-step peaks at ``m = 1, 2`` would see the optimizer moment (a maximum of two lines is not a line), so the
two are measured apart (section 2 shows why): the forward/backward peak with the gradients allocated, at
``m = 1, 2``, for each precision and attention kernel; what one block saves (chapters 01 and 05) and its output;
with a chunkable loss the head's loss alone (chapter 11); with offloading the bytes the hooks pack (chapter 11);
the time of a pass at two micro-batches; the optimizer step; the share of the FLOPs in the blocks. ``Layers``
and ``LmHead`` say what tensor parallelism (chapter 10) and a chunked loss (chapter 11) can do with the model.
"""

from __future__ import annotations

import copy
import math
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from course_lib import memory, offload
from course_lib.checkpointing import fastest_times
from course_lib.parallel.tensor_parallel import costs as tp_costs
from course_lib.parallel.sharding.zero import DEFAULT_BUCKET_MB
from course_lib.parallel.sharding.zero_buckets import bucket_sizes
from course_lib.models import TransformerBlock, lm_loss
from course_lib.planner.config import pass_key
from course_lib.planner.step import LossFn, attention_kernel, autocast, bf16_kernels, precision

BatchFn = Callable[[int], "tuple[torch.Tensor, torch.Tensor]"]


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
            idx = torch.randint(0, emb.num_embeddings, (m, sample_shape[0] + 1), generator=gen)  # host: moved below
            return idx[:, :-1].to(device), idx[:, 1:].to(device)
        return tokens, lm_loss
    with _left_as_it_was(model), torch.no_grad():  # one forward for the number of classes
        classes = model(torch.zeros(1, *sample_shape, device=device)).shape[-1]
    return (lambda m: (torch.randn(m, *sample_shape, generator=gen).to(device),
                       torch.randint(0, classes, (m,), generator=gen).to(device))), F.cross_entropy


def _line(x1: float, y1: float, x2: float, y2: float) -> tuple[float, float]:
    d = (y2 - y1) / (x2 - x1)
    return y1 - d * x1, d


def _inputs_of(model: nn.Module, modules: list[nn.Module], x: torch.Tensor, prec: str, fused: bool,
               device: torch.device) -> list[torch.Tensor]:
    """What each of ``modules`` receives in one forward of ``model`` on ``x``, detached (no graph is kept)."""
    got: dict[int, torch.Tensor] = {}
    hooks = [mod.register_forward_pre_hook(lambda mod, args, i=i: got.update({i: args[0].detach()}))
             for i, mod in enumerate(modules)]
    try:
        with torch.no_grad(), attention_kernel(model, fused), precision(model, prec, device):
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
                with bf16_kernels(prec, device):
                    with attention_kernel(model, kernel), precision(model, prec, device):
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
                with attention_kernel(model, kernel), precision(model, prec, device):
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
                        with bf16_kernels(prec, device):
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
