"""Sequence parallelism (chapter 10): the LayerNorm regions of a tensor-parallel block split on the sequence.

Plain tensor parallelism keeps the LayerNorms and the residual adds whole on every rank: t copies of the same
activations. Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models", section 4.2.2)
cut those regions along the sequence: ``g``'s all-reduce becomes a reduce-scatter (each rank keeps its rows of the sum)
and ``f`` an all-gather, their conjugates in the backward. An all-reduce *is* a reduce-scatter then an all-gather, so
the bytes stay the same and those activations fall to 1/t. The pair is written beside f and g, as the same
``layers.Conjugate``: ``layers.gather_from_sequence`` and ``layers.reduce_scatter_to_sequence``; the parallel linears
use them when built with ``sequence_parallel=True``. ``_GatherLinear`` goes further, as Megatron-LM does: it saves this
rank's shard of a column-parallel linear's input and gathers it again in the backward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

SEQ = 1  # the sequence dimension of (batch, sequence, features)


class _GatherLinear(torch.autograd.Function):
    """All-gather the sequence, then a linear layer, saving only this rank's shard of the input. Autograd would save
    the gathered input, t times the shard. Megatron-LM saves the shard and gathers it again in the backward (its
    ``LinearWithGradAccumulationAndAsyncCommunication``): one more all-gather per linear per step (which it overlaps
    with the gradient matmul), for the 1/t activation memory of Korthikanti et al.'s Table 2."""

    @staticmethod
    def forward(ctx, x, weight, bias, tp):
        ctx.tp, ctx.has_bias = tp, bias is not None
        ctx.save_for_backward(x, weight)
        return F.linear(tp.all_gather(x, SEQ), weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        # under autocast the forward's product ran in grad's dtype (bf16); the backward runs outside autocast, so
        # it casts as autocast did (autograd casts each gradient back to its input's dtype)
        weight = weight.to(grad.dtype)
        full = ctx.tp.all_gather(x.to(grad.dtype), SEQ)  # the extra all-gather
        grad_x = ctx.tp.reduce_scatter(grad @ weight, SEQ)
        grad_w = grad.flatten(0, -2).T @ full.flatten(0, -2)
        grad_b = grad.flatten(0, -2).sum(0) if ctx.has_bias else None
        return grad_x, grad_w, grad_b, None
