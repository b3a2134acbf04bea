"""Measure a model once, for the planner (chapter 09).

Memory at micro-batches 1 and 2 (each part is affine in the micro-batch, so
two points give exact lines), what one block saves for backward, the time of
a pass at two micro-batch sizes and of the optimizer step, and the share of
the forward FLOPs spent in the blocks (what checkpointing reruns).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from course_lib import memory
from course_lib.checkpointing import fastest_times
from course_lib.models import lm_loss
from course_lib.step import LossFn, autocast

BatchFn = Callable[[int], "tuple[torch.Tensor, torch.Tensor]"]


@dataclass
class Measurements:
    """What ``calibrate`` measured; the inputs of ``predict_peak`` and ``predict_step_time``."""

    n_blocks: int
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    unit_bytes: int                          # parameters of the largest block (ZeRO-2/3 hold it whole in flight)
    batch_bytes_per_sample: int              # inputs + targets
    fb: dict[str, tuple[float, float]]       # precision -> (c, d): forward+backward peak above the states
    block: dict[str, tuple[float, float]]    # precision -> (c, d): bytes one block saves for backward
    boundary_per_sample: dict[str, float]    # precision -> bytes of one block's output per sample
    time: dict[str, tuple[float, float]]     # precision -> (alpha, beta): seconds of one micro-batch
    timing_micro: int                        # the second micro-batch the time line was measured at
    optimizer_tmp_bytes: int
    optimizer_s: float
    block_flop_share: float                  # fraction of the forward FLOPs spent in ``model.blocks``


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
    with torch.no_grad():
        classes = model(torch.zeros(1, *sample_shape, device=device)).shape[-1]
    return (lambda m: (torch.randn(m, *sample_shape, generator=gen).to(device),
                       torch.randint(0, classes, (m,), generator=gen).to(device))), F.cross_entropy


def _line(x1: float, y1: float, x2: float, y2: float) -> tuple[float, float]:
    d = (y2 - y1) / (x2 - x1)
    return y1 - d * x1, d


def calibrate(model: nn.Module, make_batch: BatchFn, loss_fn: LossFn, device: torch.device,
              precisions: tuple[str, ...], max_micro: int, budget: int) -> Measurements:
    """Measure ``model`` in place on ``device`` (Adam with ``lr=0`` leaves the weights, buffers are restored).

    Memory at micro-batches 1 and 2; time at 1 and at the largest power of two up
    to ``max_micro`` whose predicted peak fits ``budget`` (in every precision).
    """
    blocks = model.blocks if isinstance(getattr(model, "blocks", None), nn.Sequential) else nn.Sequential()
    was_training = model.training
    buffers = {k: v.clone() for k, v in model.named_buffers()}  # BatchNorm's running statistics
    model.train()
    opt = torch.optim.Adam(model.parameters(), lr=0.0)  # lr=0: the same state and temporaries, no update
    x1, y1 = make_batch(1)
    fb, blk, bnd, passes = {}, {}, {}, {}
    try:
        for prec in precisions:
            def fwd_bwd(x, y, prec=prec):
                with autocast(prec, device):
                    loss = loss_fn(model(x), y)
                loss.backward()
            fwd_bwd(x1, y1)
            opt.step()  # gradients and Adam's state exist from here on: measured above them
            peaks, saved = [], []
            for m in (1, 2):
                x, y = make_batch(m)
                peaks.append(memory.peak_bytes(lambda: fwd_bwd(x, y), device))
                if len(blocks):  # what one block saves, and its output (a segment boundary)
                    h = []
                    hook = blocks.register_forward_pre_hook(lambda mod, args: h.append(args[0].detach()))
                    with torch.no_grad():
                        model(x)
                    hook.remove()
                    with autocast(prec, device):
                        saved.append(memory.saved_activation_bytes(lambda: blocks[0](h[0]), blocks[0].parameters()))
                        bnd[prec] = memory.tensor_bytes(blocks[0](h[0])) / m
            fb[prec] = _line(1, peaks[0], 2, peaks[1])
            blk[prec] = _line(1, saved[0], 2, saved[1]) if saved else (0.0, 0.0)
            passes[prec] = fwd_bwd
        opt_tmp = memory.peak_bytes(opt.step, device)
        states = memory.param_bytes(model) + memory.grad_bytes(model) + memory.optimizer_state_bytes(opt)
        batch_bytes = sum(memory.tensor_bytes(t) for t in (x1, y1))
        fits = lambda m: all(states + batch_bytes * m + c + d * m <= budget for c, d in fb.values())  # noqa: E731
        tm = max([2**i for i in range(int(math.log2(max_micro)) + 1) if fits(2**i)], default=1)
        xt, yt = make_batch(tm)
        sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
        steps = {"opt": lambda: (opt.step(), sync())}
        for prec, f in passes.items():
            steps[f"{prec}/1"] = lambda f=f: (f(x1, y1), sync())
            steps[f"{prec}/{tm}"] = lambda f=f: (f(xt, yt), sync())
        best = fastest_times(steps, repeats=3)  # in turns, fastest of three: the least disturbed run
        share = 0.0
        if len(blocks):  # the FLOP share of the blocks: what checkpointing reruns
            h = []
            hook = blocks.register_forward_pre_hook(lambda mod, args: h.append(args[0]))
            with torch.no_grad(), FlopCounterMode(display=False) as total_flops:
                model(x1)
            hook.remove()
            with torch.no_grad(), FlopCounterMode(display=False) as block_flops:
                blocks(h[0])
            share = block_flops.get_total_flops() / max(total_flops.get_total_flops(), 1)
        counts = dict(param_bytes=memory.param_bytes(model), grad_bytes=memory.grad_bytes(model),
                      optimizer_bytes=memory.optimizer_state_bytes(opt))
    finally:
        opt.zero_grad(set_to_none=True)
        del opt
        with torch.no_grad():
            for k, v in model.named_buffers():
                v.copy_(buffers[k])
        model.train(was_training)
    times = {}
    for prec in precisions:
        t1, tb = best[f"{prec}/1"], best[f"{prec}/{tm}"]
        alpha, beta = _line(1, t1, tm, tb) if tm > 1 else (0.0, t1)
        # noise can make the slope <= 0: keep it positive, so a larger micro-batch never looks slower
        times[prec] = (max(alpha, 0.0), max(beta, 1e-3 * tb / tm))
    units = [memory.param_bytes(b) for b in blocks] or [memory.param_bytes(c) for c in model.children()] or [0]
    return Measurements(n_blocks=len(blocks), **counts, unit_bytes=max(units), batch_bytes_per_sample=batch_bytes,
                        fb=fb, block=blk, boundary_per_sample=bnd, time=times, timing_micro=tm,
                        optimizer_tmp_bytes=opt_tmp, optimizer_s=best["opt"], block_flop_share=share)

