"""The tiny transformer with its attention over the ring: each rank runs its ``T/c`` positions (chapter 12).

Every layer but attention is position-wise, so a rank runs its own tokens through the same modules as one process (the
position embedding reads their *global* positions) and only attention goes round the ring. A rank's loss is the sum over
its tokens divided by all tokens of the batch, so the ranks' shares add up to the mean; the weights are replicated, and
each gradient is summed over the ranks afterwards, as in data parallelism (``experiments.cp_checks.sum_grads``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from course_lib.parallel.context_parallel.layout import shard
from course_lib.parallel.context_parallel.ring_attention import Ring, ring_attention


def attention_forward(attn: nn.Module, x: torch.Tensor, ring: Ring) -> torch.Tensor:
    """``models.CausalSelfAttention``'s computation on this rank's positions, attention over the ring."""
    B, n, C = x.shape
    H = attn.n_heads
    qkv = attn.qkv(x).view(B, n, H, 3, C // H)  # head-major, as in the model
    q, k, v = (qkv[..., i, :].transpose(1, 2).contiguous() for i in range(3))
    y = ring_attention(q, k, v, ring)
    return attn.proj(y.transpose(1, 2).reshape(B, n, C))


def block_forward(block: nn.Module, x: torch.Tensor, ring: Ring) -> torch.Tensor:
    """A ``models.TransformerBlock`` on this rank's positions ``x`` (``B, T/c, C``), its attention over the ring."""
    x = x + attention_forward(block.attn, block.ln1(x), ring)
    return x + block.mlp(block.ln2(x))


def model_forward(model: nn.Module, idx: torch.Tensor, ring: Ring) -> torch.Tensor:
    """A ``models.TinyTransformer``'s logits for this rank's tokens ``idx`` (``B, T/c``), its own weights."""
    pos = ring.positions().to(idx.device)
    x = model.embed.tok(idx) + model.embed.pos(pos)
    for block in model.blocks:
        x = block_forward(block, x, ring)
    return model.head(x)


def cp_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor, ring: Ring) -> torch.Tensor:
    """This rank's share of the mean next-token loss of the batch ``x, y`` (whole sequences, every rank the same)."""
    local_x, local_y = (shard(t, ring.world, ring.rank, ring.layout) for t in (x, y))
    return cp_local_loss(model, local_x, local_y, ring, y.numel())


def cp_local_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor, ring: Ring, tokens: int) -> torch.Tensor:
    """``cp_loss`` of this rank's positions ``x``, ``y`` (already sharded) over a batch of ``tokens`` tokens."""
    logits = model_forward(model, x, ring)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), reduction="sum") / tokens
