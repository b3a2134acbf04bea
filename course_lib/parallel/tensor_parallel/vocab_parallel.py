"""The vocabulary split over the ranks (chapter 10): Megatron-LM's embedding and cross-entropy by hand.

The LM head is a model's largest matrix, (V, h) with V of 32k-256k, and its logits the largest activation, (B, T, V).
Split them over the vocabulary: rank r holds rows ``[r V/t, (r+1) V/t)`` of the embedding and of the head (a
``ColumnParallelLinear``, which gives rank r its (B, T, V/t) slice of the logits).

- ``VocabParallelEmbedding``: an id outside this rank's rows reads zeros; ``g``'s all-reduce then gives every rank
  the one row that some rank holds.
- ``vocab_parallel_cross_entropy``: three all-reduces of B*T scalars (the max and the sum of exp over all V columns, the
  target's logit from the rank that holds it) instead of gathering B*T*V logits; the backward (softmax minus one-hot, on
  this rank's columns) sends nothing.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from course_lib.parallel.tensor_parallel.layers import TPGroup, reduce_from_tp


def vocab_range(vocab: int, tp: TPGroup) -> tuple[int, int]:
    """``(first, end)``: the ids whose rows this rank holds, block ``tp.rank`` of ``vocab`` split ``tp.size`` ways."""
    if vocab % tp.size:
        raise ValueError(f"a vocabulary of {vocab} does not split over {tp.size} ranks; pad it to a multiple "
                         f"of {tp.size} (Megatron-LM pads to a multiple of 128 x t)")
    per_rank = vocab // tp.size
    return tp.rank * per_rank, (tp.rank + 1) * per_rank


class VocabParallelEmbedding(nn.Module):
    """Rank r keeps rows ``vocab_range`` of ``full``; the lookup is masked, then summed over the ranks. Input: the
    full (B, T) ids, the same on every rank; output: the full (B, T, h) embeddings. The backward is ``g``'s identity:
    each rank's rows get the gradient of the positions that read them, no message."""

    def __init__(self, full: nn.Embedding, tp: TPGroup):
        super().__init__()
        self.tp = tp
        self.first, self.end = vocab_range(full.num_embeddings, tp)
        self.weight = nn.Parameter(full.weight.detach()[self.first:self.end].clone())  # (V/t, h)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        outside = (ids < self.first) | (ids >= self.end)
        local = (ids - self.first).masked_fill(outside, 0)            # any valid row: its result is zeroed
        rows = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tp(rows, self.tp)                          # (B, T, h): one rank's row, the rest 0


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token cross-entropy of logits split over the vocabulary; forward three all-reduces, backward none."""

    @staticmethod
    def forward(ctx, logits, targets, tp):
        first = tp.rank * logits.shape[-1]
        # 1. the max over all V, for a softmax that cannot overflow: local max, all-reduce MAX
        top = tp.all_reduce(logits.detach().amax(dim=-1), dist.ReduceOp.MAX)
        shifted = logits - top.unsqueeze(-1)
        # 2. the target's (shifted) logit: its owner reads it, every other rank contributes 0; all-reduce SUM
        local = targets - first
        mine = (local >= 0) & (local < logits.shape[-1])
        local = local.masked_fill(~mine, 0)
        target_logit = tp.all_reduce(shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(~mine, 0.0))
        # 3. the sum of exp over all V: local sum, all-reduce SUM
        exp = shifted.exp()
        sum_exp = tp.all_reduce(exp.sum(dim=-1))
        # softmax over this rank's columns: the backward's only input, (N, V/t) as the logits were
        ctx.save_for_backward(exp.div_(sum_exp.unsqueeze(-1)), local, mine)
        return sum_exp.log() - target_logit                          # -log p(target), per token

    @staticmethod
    def backward(ctx, grad):
        softmax, local, mine = ctx.saved_tensors
        # d(-log p_y)/d z_j = softmax_j - [j == y]: the one-hot is on the owner's columns only, no message
        grad_logits = softmax.clone()
        grad_logits.scatter_add_(-1, local.unsqueeze(-1), -mine.unsqueeze(-1).to(softmax.dtype))
        return grad_logits * grad.unsqueeze(-1), None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """Per-token ``-log p(target)`` from this rank's ``(..., V/t)`` slice of the logits and the full targets;
    ``.mean()`` of it is ``F.cross_entropy`` of the whole logits, which never exist on any rank."""
    flat = logits.reshape(-1, logits.shape[-1])
    return _VocabParallelCrossEntropy.apply(flat, targets.reshape(-1), tp).view(targets.shape)
