"""Cross-entropy over a large vocabulary without the whole logits tensor (chapter 11).

A language model's head maps ``N = B * T`` hidden vectors of width ``d`` to ``V`` logits. The plain loss holds the
``(N, V)`` logits, ``cross_entropy`` saves their log-softmax and the backward makes its gradient: about ``3 N V``
values at once (GPT-2, ``V = 50,257``, ``N = 8 x 1,024``: 4.9 GB in fp32, more than the 124M model's weights,
gradients and Adam state). Chunk the tokens: the loss ``N / k`` tokens at a time, keeping only the hidden vectors,
one chunk's logits remade at a time in the backward. One more matmul of the head per step; the peak falls about
``k``-fold, down to what the head's weight gradient needs.

- ``ChunkedLinearCrossEntropy``: by hand, an ``autograd.Function`` with its own backward (``softmax - onehot``);
- ``chunked_cross_entropy``: the same with ``torch.utils.checkpoint`` around each chunk, autograd's backward;
- ``transformer_loss``: either one on ``models.TinyTransformer``;
- ``predict_loss_peak``: the bytes of the loss's peak, for a planner.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint


def _logits(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """One slice's logits, in fp32 at least: a softmax over tens of thousands of classes in 16 bits loses too much.

    Hidden states and weight may differ in precision (bf16 activations, an fp32 head): both are taken to the
    wider one, a slice at a time (under autocast, autocast's cast comes first).
    """
    ct = torch.promote_types(h.dtype, weight.dtype)
    z = F.linear(h.to(ct), weight.to(ct), None if bias is None else bias.to(ct))
    return z.to(torch.promote_types(z.dtype, torch.float32))


def _check(hidden: torch.Tensor, targets: torch.Tensor, chunks: int) -> None:
    if hidden.dim() != 2 or targets.shape != hidden.shape[:1]:
        raise ValueError(f"expected hidden (N, d) and targets (N,); got {tuple(hidden.shape)} and "
                         f"{tuple(targets.shape)} (flatten batch and time first)")
    if not 1 <= chunks <= len(hidden):
        raise ValueError(f"chunks must be between 1 and the number of tokens ({len(hidden)}), got {chunks}")


class ChunkedLinearCrossEntropy(torch.autograd.Function):
    """``mean cross_entropy(hidden @ weight.T + bias, targets)``, ``chunks`` token slices at a time (by hand).

    Saves only its inputs. The backward pass recomputes each slice's logits and
    turns them into their gradient in place: ``(softmax - onehot) / N``.

    Under autocast the forward's matmuls run in bf16; autograd runs a backward
    with autocast off, so a recomputation there would give fp32 logits, the
    gradient of another function. ``torch.amp.custom_fwd``/``custom_bwd``
    record the forward's autocast state and restore it for the backward. They
    take one device type, fixed when the class is defined: this class is the
    CUDA one, and ``apply`` hands CPU tensors to its twin for the CPU.
    """

    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda")
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor,
                chunks: int) -> torch.Tensor:
        return _forward(ctx, hidden, weight, bias, targets, chunks)

    @staticmethod
    @torch.amp.custom_bwd(device_type="cuda")
    def backward(ctx, grad: torch.Tensor):
        return _backward(ctx, grad)

    @classmethod
    def apply(cls, hidden: torch.Tensor, *args):  # type: ignore[override]
        if cls is ChunkedLinearCrossEntropy and hidden.device.type == "cpu":
            return _ChunkedLinearCrossEntropyCPU.apply(hidden, *args)
        return super().apply(hidden, *args)


class _ChunkedLinearCrossEntropyCPU(ChunkedLinearCrossEntropy):
    """The same function, its autocast state recorded and restored for the CPU."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cpu")
    def forward(ctx, hidden, weight, bias, targets, chunks):
        return _forward(ctx, hidden, weight, bias, targets, chunks)

    @staticmethod
    @torch.amp.custom_bwd(device_type="cpu")
    def backward(ctx, grad):
        return _backward(ctx, grad)


def _forward(ctx, hidden, weight, bias, targets, chunks: int) -> torch.Tensor:
    _check(hidden, targets, chunks)
    total = 0.0
    for h, y in zip(hidden.chunk(chunks), targets.chunk(chunks)):
        total = total + F.cross_entropy(_logits(h, weight, bias), y, reduction="sum")
    ctx.save_for_backward(hidden, weight, bias, targets)
    ctx.chunks = chunks
    return total / len(hidden)


def _backward(ctx, grad: torch.Tensor):
    hidden, weight, bias, targets = ctx.saved_tensors
    ct = torch.promote_types(hidden.dtype, weight.dtype)  # the precision the slices are computed in
    scale = grad / len(hidden)
    grad_h = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
    # accumulated in the wider precision, returned in each input's own
    grad_w = torch.zeros(weight.shape, dtype=ct, device=weight.device) if ctx.needs_input_grad[1] else None
    grad_b = torch.zeros(bias.shape, dtype=ct, device=bias.device) if bias is not None and ctx.needs_input_grad[2] \
        else None
    w = weight.to(ct)
    start = 0
    for h, y in zip(hidden.chunk(ctx.chunks), targets.chunk(ctx.chunks)):
        h = h.to(ct)
        p = _logits(h, w, bias).softmax(dim=-1)                # one slice's logits, then its softmax
        p[torch.arange(len(y), device=y.device), y] -= 1       # d loss / d logits = softmax - onehot
        p = p.mul_(scale).to(ct)
        if grad_h is not None:
            grad_h[start:start + len(h)] = p @ w
        if grad_w is not None:
            grad_w.addmm_(p.t(), h)                            # in place: no second weight-sized tensor
        if grad_b is not None:
            grad_b += p.sum(0)
        start += len(h)
    return (grad_h, None if grad_w is None else grad_w.to(weight.dtype),
            None if grad_b is None else grad_b.to(bias.dtype), None, None)


def _chunk_loss(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(_logits(h, weight, bias), y, reduction="sum")


def chunked_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                          targets: torch.Tensor, chunks: int) -> torch.Tensor:
    """The same loss, each token slice under ``torch.utils.checkpoint``: kept are its inputs, not its logits."""
    _check(hidden, targets, chunks)
    if chunks == 1:
        return _chunk_loss(hidden, weight, bias, targets) / len(hidden)
    total = sum(checkpoint(_chunk_loss, h, weight, bias, y, use_reentrant=False)
                for h, y in zip(hidden.chunk(chunks), targets.chunk(chunks)))
    return total / len(hidden)


def transformer_loss(model: nn.Module, idx: torch.Tensor, targets: torch.Tensor, chunks: int,
                     by_hand: bool = False) -> torch.Tensor:
    """``models.lm_loss(model(idx), targets)`` for a ``TinyTransformer``, its head's loss computed in chunks."""
    hidden = model.head.ln(model.blocks(model.embed(idx)))            # (B, T, d): the head's input
    hidden, flat = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
    out = model.head.out
    if by_hand:
        return ChunkedLinearCrossEntropy.apply(hidden, out.weight, out.bias, flat, chunks)
    return chunked_cross_entropy(hidden, out.weight, out.bias, flat, chunks)


def predict_loss_peak(tokens: int, vocab: int, d_model: int, chunks: int, itemsize: int = 4) -> int:
    """Peak bytes of ``chunked_cross_entropy`` forward and backward, above its inputs (fp32 logits).

    One slice of ``n = ceil(N / k)`` tokens is alive at a time. While its loss
    runs backward it holds its logits, their log-softmax and its gradient,
    ``3 n V``; from the second slice on, the head's gradients (``V d`` weight,
    ``V`` bias) and the hidden vectors' (``N d``) exist too. Adding a slice's
    weight gradient into the head's holds three weight-sized tensors at once
    (the sum, the slice's gradient as autograd computes it, transposed, and a
    copy in the weight's layout), which bounds the peak from below as ``k``
    grows. Within a few percent of chapter 11's measurements.
    """
    if min(tokens, vocab, d_model, itemsize) < 1 or not 1 <= chunks <= tokens:
        raise ValueError(f"need positive sizes and 1 <= chunks <= tokens, got tokens={tokens}, vocab={vocab}, "
                         f"d_model={d_model}, chunks={chunks}, itemsize={itemsize}")
    n = math.ceil(tokens / chunks)
    logits = n * vocab * max(itemsize, 4)                   # one slice's logits: fp32 at least
    weight, bias, hidden = vocab * d_model * itemsize, vocab * itemsize, tokens * d_model * itemsize
    if chunks == 1:
        return 3 * logits
    return max(3 * logits + weight + bias, 3 * weight + 2 * bias) + hidden
