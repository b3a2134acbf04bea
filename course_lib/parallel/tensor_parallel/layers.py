"""Tensor and sequence parallelism written by hand (chapter 10).

Megatron-LM (Shoeybi et al. 2019, "Megatron-LM: Training Multi-Billion
Parameter Language Models Using Model Parallelism", section 3) splits every
weight matrix of a transformer block over the t ranks of a tensor-parallel group:

- a column-parallel linear ``Y = X A`` keeps a block of A's output columns
  (rows of ``nn.Linear.weight``): rank r computes ``Y_r = X A_r`` from the
  full input, no communication;
- a row-parallel linear keeps a block of A's input rows and takes the matching
  slice of its input: ``Y = sum_r X_r A_r``, a sum over ranks (all-reduce).

Column then row (the MLP; the attention with its heads split) needs one
all-reduce forward and one backward, done by two conjugate operators:
``f`` (identity forward, all-reduce backward) before the column-parallel
linear and ``g`` (all-reduce forward, identity backward) after the row-parallel one.

Sequence parallelism (Korthikanti et al. 2022, "Reducing Activation
Recomputation in Large Transformer Models", section 4.2.2) also splits the
LayerNorm and dropout regions, on the sequence: ``g``'s all-reduce becomes a
reduce-scatter (each rank keeps its rows of the sum) and ``f`` an all-gather;
their conjugates run in the backward. Same bytes, 1/t of those activations.

Each collective goes through ``comm`` and is counted in ``TPGroup.counter``. The same split
through torch's API (``parallelize_module``, DTensor) is in ``tp_api``.
Activations are (batch, sequence, features): the sequence is dimension 1.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from course_lib.parallel import collectives as comm
from course_lib.models import CausalSelfAttention, TransformerBlock

SEQ = 1  # the sequence dimension of (batch, sequence, features)


@dataclass
class TPGroup:
    """The ranks that share one layer (``group=None``: all of them), and the bytes this rank sends in it."""

    group: dist.ProcessGroup | None = None
    counter: comm.ByteCounter = field(default_factory=comm.ByteCounter)

    @property
    def size(self) -> int:
        return dist.get_world_size(self.group)

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group)  # the rank inside the group

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of ``x`` over the group, in a new tensor (autograd may still need ``x``)."""
        out = x.clone(memory_format=torch.contiguous_format)
        comm.all_reduce(out, counter=self.counter, group=self.group)
        return out

    def all_gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """Every rank's ``x`` concatenated along ``dim``, in rank order."""
        x = x.contiguous()
        out = x.new_empty((self.size * x.shape[0], *x.shape[1:]))  # gloo wants the ranks' parts along dim 0
        comm.all_gather(out, x, counter=self.counter, group=self.group)
        return torch.cat(out.chunk(self.size), dim=dim)

    def reduce_scatter(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """The sum of ``x`` over the group, cut in ``size`` chunks along ``dim``: this rank keeps chunk ``rank``."""
        if x.shape[dim] % self.size:
            raise ValueError(f"dimension {dim} of size {x.shape[dim]} does not split over {self.size} ranks; "
                             f"choose a sequence length divisible by {self.size}")
        stacked = torch.cat(x.chunk(self.size, dim=dim))  # the ranks' chunks along dim 0: chunk r goes to rank r
        out = x.new_empty(stacked.shape[0] // self.size, *stacked.shape[1:])
        comm.reduce_scatter(out, stacked, counter=self.counter, group=self.group)
        return out


# ----- the conjugate operators ----------------------------------------------------------------


class _CopyToTP(torch.autograd.Function):
    """f: identity forward; backward, the sum of every rank's gradient (each rank's slice of the
    next layer's output depends on all of x, so x's gradient has a part from every rank)."""

    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return ctx.tp.all_reduce(grad), None


class _ReduceFromTP(torch.autograd.Function):
    """g: forward, the sum of the ranks' partial outputs; backward, identity (the sum's gradient
    with respect to each term is the sum's gradient, already the same on every rank)."""

    @staticmethod
    def forward(ctx, x, tp):
        return tp.all_reduce(x)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherFromSequence(torch.autograd.Function):
    """Sequence parallelism's f: all-gather the sequence forward, reduce-scatter the gradient backward."""

    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        return tp.all_gather(x, SEQ)

    @staticmethod
    def backward(ctx, grad):
        return ctx.tp.reduce_scatter(grad, SEQ), None


class _ReduceScatterToSequence(torch.autograd.Function):
    """Sequence parallelism's g: reduce-scatter forward (each rank keeps its rows of the sum), all-gather backward."""

    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        return tp.reduce_scatter(x, SEQ)

    @staticmethod
    def backward(ctx, grad):
        return ctx.tp.all_gather(grad, SEQ), None


def copy_to_tp(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """f: identity forward, all-reduce backward."""
    return _CopyToTP.apply(x, tp)


def reduce_from_tp(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """g: all-reduce forward, identity backward."""
    return _ReduceFromTP.apply(x, tp)


def gather_from_sequence(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """All-gather along the sequence forward, reduce-scatter backward."""
    return _GatherFromSequence.apply(x, tp)


def reduce_scatter_to_sequence(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """Reduce-scatter along the sequence forward, all-gather backward."""
    return _ReduceScatterToSequence.apply(x, tp)


class _GatherLinear(torch.autograd.Function):
    """All-gather the sequence, then a linear layer, saving only this rank's shard of the input.

    Autograd would save the gathered input, t times the shard. Megatron-LM
    saves the shard and gathers it again in the backward (its
    ``LinearWithGradAccumulationAndAsyncCommunication``): one more all-gather
    per linear per step (which it overlaps with the gradient matmul), for the
    1/t activation memory of Korthikanti et al.'s Table 2.
    """

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


# ----- the parallel layers --------------------------------------------------------------------


class ColumnParallelLinear(nn.Module):
    """Rank r keeps output rows ``order.chunk(t)[r]`` of ``full`` (default: the natural order), and their biases.

    Input: the full activation (or, with ``sequence_parallel``, this rank's
    sequence shard, gathered here); output: this rank's slice of the features.
    ``regather`` (sequence parallel only) saves the shard instead of the
    gathered input and gathers it again in the backward (``_GatherLinear``).
    """

    def __init__(self, full: nn.Linear, tp: TPGroup, order: torch.Tensor | None = None,
                 sequence_parallel: bool = False, regather: bool = False):
        super().__init__()
        if full.out_features % tp.size:
            raise ValueError(f"{full.out_features} output features do not split over {tp.size} ranks")
        if regather and not sequence_parallel:
            raise ValueError("regather saves a sequence shard: it needs sequence_parallel=True")
        self.tp, self.sequence_parallel, self.regather = tp, sequence_parallel, regather
        self.order = torch.arange(full.out_features) if order is None else order.cpu()  # host: an index, moved
        mine = self.order.chunk(tp.size)[tp.rank].to(full.weight.device)
        self.weight = nn.Parameter(full.weight.detach()[mine].clone())  # (out/t, in)
        self.bias = nn.Parameter(full.bias.detach()[mine].clone()) if full.bias is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.sequence_parallel:
            return F.linear(copy_to_tp(x, self.tp), self.weight, self.bias)
        if self.regather:
            return _GatherLinear.apply(x, self.weight, self.bias, self.tp)
        return F.linear(gather_from_sequence(x, self.tp), self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """Rank r keeps input columns ``r`` of ``full``'s weight; the bias is whole, added once after the sum.

    Input: this rank's slice of the features; output: the full activation
    (``g``), or with ``sequence_parallel`` this rank's sequence shard of it.
    """

    def __init__(self, full: nn.Linear, tp: TPGroup, sequence_parallel: bool = False):
        super().__init__()
        if full.in_features % tp.size:
            raise ValueError(f"{full.in_features} input features do not split over {tp.size} ranks")
        self.tp, self.sequence_parallel = tp, sequence_parallel
        self.weight = nn.Parameter(full.weight.detach().chunk(tp.size, dim=1)[tp.rank].clone())  # (out, in/t)
        self.bias = nn.Parameter(full.bias.detach().clone()) if full.bias is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        partial = F.linear(x, self.weight)  # this rank's term of the sum
        y = (reduce_scatter_to_sequence if self.sequence_parallel else reduce_from_tp)(partial, self.tp)
        return y if self.bias is None else y + self.bias


# ----- attention with its heads split ---------------------------------------------------------


def head_major_order(n_heads: int, d_model: int) -> torch.Tensor:
    """Rows of a fused ``[q | k | v]`` weight reordered head by head: ``[q_0 k_0 v_0 | q_1 k_1 v_1 | ...]``.

    Then any contiguous block of rows holds whole heads with their q, k and v,
    so a column-parallel split gives each rank whole heads (Megatron-LM keeps
    its fused QKV weight in this layout for that reason).
    """
    if d_model % n_heads:
        raise ValueError(f"d_model={d_model} is not divisible by n_heads={n_heads}")
    return torch.arange(3 * d_model).view(3, n_heads, d_model // n_heads).transpose(0, 1).reshape(-1)  # host


class HeadMajorAttention(nn.Module):
    """Causal self-attention on a head-major fused ``qkv``; it runs on whatever whole heads ``qkv`` returns.

    ``CausalSelfAttention`` computes with the full width; this forward takes
    the number of heads from ``qkv``'s output, so the same code runs one rank's
    heads (by hand, or under ``parallelize_module``) and all of them.
    """

    def __init__(self, qkv: nn.Module, proj: nn.Module, head_dim: int, mask: torch.Tensor, attn_drop: nn.Module):
        super().__init__()
        self.qkv, self.proj, self.head_dim, self.attn_drop = qkv, proj, head_dim, attn_drop
        self.register_buffer("mask", mask.clone(), persistent=False)

    @classmethod
    def from_attention(cls, attn: CausalSelfAttention) -> "HeadMajorAttention":
        """The same attention in one process, its ``qkv`` rows reordered by ``head_major_order``."""
        d_model = attn.proj.in_features
        qkv = copy.deepcopy(attn.qkv)
        order = head_major_order(attn.n_heads, d_model).to(qkv.weight.device)
        with torch.no_grad():
            qkv.weight.copy_(attn.qkv.weight[order])
            qkv.bias.copy_(attn.qkv.bias[order])
        return cls(qkv, copy.deepcopy(attn.proj), d_model // attn.n_heads, attn.mask, copy.deepcopy(attn.attn_drop))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv(x)
        B, T = qkv.shape[:2]  # T from the output: under sequence parallelism x holds a shard of the sequence
        qkv = qkv.view(B, T, -1, 3, self.head_dim)                       # (B, T, heads here, 3, hd)
        q, k, v = (qkv[..., i, :].transpose(1, 2).contiguous() for i in range(3))  # each (B, heads, T, hd)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(self.head_dim))
        att = att.masked_fill(~self.mask[:T, :T], float("-inf")).softmax(dim=-1)
        y = self.attn_drop(att) @ v
        return self.proj(y.transpose(1, 2).reshape(B, T, -1))           # (B, T, heads here x hd)


class TPBlock(nn.Module):
    """A ``TransformerBlock`` split over ``tp``: heads and MLP columns per rank, the rest replicated.

    Built from the single-process block's weights, with the same parameter
    names (``ln1``, ``attn.qkv``, ``attn.proj``, ``ln2``, ``mlp.0``, ``mlp.2``).
    With ``sequence_parallel`` its input and output are this rank's sequence
    shard and the replicated parameters (LayerNorms, row-parallel biases) see
    only their shard's rows: sum their gradients with ``sync_replicated_grads``.

    Dropout raises in training: a copied ``nn.Dropout`` draws from the same
    random state on every rank, so each rank's heads would get the masks of
    the other ranks' heads, correlated where they must be independent. The fix
    is a second random stream per rank, kept apart from the shared one that
    replicated regions need (Megatron-LM's model-parallel RNG tracker), and
    restored for every recomputation under checkpointing: more machinery
    than the course's blocks, which use no dropout, justify. Inference
    (``eval()``) runs, since dropout is off there.
    """

    def __init__(self, block: TransformerBlock, tp: TPGroup, sequence_parallel: bool = False, regather: bool = False):
        super().__init__()
        attn, d_model = block.attn, block.attn.proj.in_features
        if attn.n_heads % tp.size:
            raise ValueError(f"{attn.n_heads} heads do not split over {tp.size} ranks; choose a tensor-parallel "
                             f"size that divides the number of heads")
        sp = sequence_parallel
        self.ln1, self.ln2 = copy.deepcopy(block.ln1), copy.deepcopy(block.ln2)
        qkv = ColumnParallelLinear(attn.qkv, tp, head_major_order(attn.n_heads, d_model), sp, regather)
        self.attn = HeadMajorAttention(qkv, RowParallelLinear(attn.proj, tp, sp), d_model // attn.n_heads,
                                       attn.mask, copy.deepcopy(attn.attn_drop))
        self.mlp = nn.Sequential(ColumnParallelLinear(block.mlp[0], tp, None, sp, regather),
                                 copy.deepcopy(block.mlp[1]), RowParallelLinear(block.mlp[2], tp, sp))
        self.tp = tp
        self.dropout = float(getattr(attn, "dropout", 0.0) or 0.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and self.dropout > 0:
            raise ValueError(f"TPBlock does not train with dropout (p={self.dropout}): every rank would draw the "
                             "same masks for different heads. Build the model with dropout=0, or call eval() "
                             "for inference")
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


def replicated_params(module: nn.Module) -> list[nn.Parameter]:
    """Parameters every rank holds whole: all but the split weights (and split biases) of the parallel linears."""
    split = {id(m.weight) for m in module.modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear))}
    split |= {id(m.bias) for m in module.modules() if isinstance(m, ColumnParallelLinear) and m.bias is not None}
    return [p for p in module.parameters() if id(p) not in split]


def sync_replicated_grads(module: nn.Module, tp: TPGroup, counter: comm.ByteCounter | None = None) -> None:
    """Sum the replicated parameters' gradients over ``tp`` under sequence parallelism, in one message.

    Without sequence parallelism every rank saw the whole sequence: those
    gradients are complete and equal on every rank already, and a sum would
    multiply them by t. Then this does nothing.
    """
    modes = {m.sequence_parallel for m in module.modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear))}
    if len(modes) > 1:
        raise ValueError("the module mixes sequence-parallel and plain tensor-parallel layers: the replicated "
                         "gradients of the two parts need different treatment; sync each part on its own")
    if modes != {True}:
        return
    params = [p for p in replicated_params(module) if p.grad is not None]
    if not params:
        return
    flat = torch.cat([p.grad.reshape(-1) for p in params])
    comm.all_reduce(flat, counter=counter, group=tp.group)
    for p, g in zip(params, flat.split([p.numel() for p in params])):
        p.grad.copy_(g.view_as(p.grad))


def full_grads(module: nn.Module) -> dict[str, torch.Tensor]:
    """Every gradient of a hand-split module as the single-process layer has it (a collective, uncounted).

    Column-parallel shards are gathered along dimension 0 and put back in the
    layer's row order; row-parallel weights along dimension 1; the rest is whole.
    """
    split: dict[int, tuple[nn.Module, int]] = {}
    for m in module.modules():
        if isinstance(m, ColumnParallelLinear):
            split |= {id(p): (m, 0) for p in (m.weight, m.bias) if p is not None}
        elif isinstance(m, RowParallelLinear):
            split[id(m.weight)] = (m, 1)
    out = {}
    for name, p in module.named_parameters():
        if id(p) not in split:
            out[name] = p.grad
            continue
        layer, dim = split[id(p)]
        parts = [torch.empty_like(p.grad) for _ in range(layer.tp.size)]
        dist.all_gather(parts, p.grad.contiguous(), group=layer.tp.group)
        full = torch.cat(parts, dim=dim)
        if dim == 0:  # rank r held rows order.chunk(t)[r]: put every row back in its place
            full = full[torch.argsort(layer.order).to(full.device)]
        out[name] = full
    return out
