"""Megatron-LM's tensor parallelism written by hand (chapter 10): every matrix of a block split over t ranks.

A column-parallel linear ``Y = X A`` keeps a block of A's output columns (rows of ``nn.Linear.weight``): rank r
computes ``Y_r = X A_r`` from the full input, no communication. A row-parallel linear keeps a block of A's input
rows and takes the matching slice of its input: ``Y = sum_r X_r A_r``, a sum over ranks. Column then row (the MLP;
the attention with its heads split) needs one all-reduce forward and one backward, done by two conjugate operators
(Shoeybi et al. 2019, section 3): ``f`` (identity forward, all-reduce backward) before the column-parallel linear,
``g`` (all-reduce forward, identity backward) after the row-parallel one. ``TPBlock`` splits a ``TransformerBlock``
so; with ``sequence_parallel`` its LayerNorm regions run on sequence shards (``sequence_parallel.py``).
Activations are (batch, sequence, features).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from course_lib.parallel import collectives as comm
from course_lib.parallel.tensor_parallel.sequence_parallel import SEQ, _GatherLinear
from course_lib.models import TransformerBlock


@dataclass
class TPGroup:
    """The ranks that share one layer (``group=None``: all of them)."""

    group: dist.ProcessGroup | None = None

    @property
    def size(self) -> int:
        return dist.get_world_size(self.group)

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group)  # the rank inside the group

    def all_reduce(self, x: torch.Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> torch.Tensor:
        """The sum (or ``op``) of ``x`` over the group, in a new tensor (autograd may still need ``x``)."""
        out = x.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(out, op, group=self.group)
        return out

    def all_gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """Every rank's ``x`` concatenated along ``dim``, in rank order."""
        x = x.contiguous()
        out = x.new_empty((self.size * x.shape[0], *x.shape[1:]))  # gloo wants the ranks' parts along dim 0
        comm.all_gather(out, x, group=self.group)
        return torch.cat(out.chunk(self.size), dim=dim)

    def reduce_scatter(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """The sum of ``x`` over the group, cut in ``size`` chunks along ``dim``: this rank keeps chunk ``rank``."""
        if x.shape[dim] % self.size:
            raise ValueError(f"dimension {dim} of size {x.shape[dim]} does not split over {self.size} ranks; "
                             f"choose a sequence length divisible by {self.size}")
        stacked = torch.cat(x.chunk(self.size, dim=dim))  # the ranks' chunks along dim 0: chunk r goes to rank r
        out = x.new_empty(stacked.shape[0] // self.size, *stacked.shape[1:])
        comm.reduce_scatter(out, stacked, group=self.group)
        return out


# ----- the conjugate operators ------------------------------------------------------------------


class Conjugate(torch.autograd.Function):
    """``op(x)`` forward, ``conjugate(grad)`` backward: a collective and its transpose, as one autograd step.

    Megatron's f is (identity, all-reduce) and g the reverse; sequence parallelism's pair is (all-gather,
    reduce-scatter) and the reverse.
    """

    @staticmethod
    def forward(ctx, x, op, conjugate):
        ctx.conjugate = conjugate
        return op(x)

    @staticmethod
    def backward(ctx, grad):
        return ctx.conjugate(grad), None, None


def _same(t: torch.Tensor) -> torch.Tensor:
    return t.view_as(t)  # the identity, as a new tensor for autograd


def copy_to_tp(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """f: identity forward; backward, the sum of every rank's gradient (each rank's slice of the next layer's
    output depends on all of x, so x's gradient has a part from every rank)."""
    return Conjugate.apply(x, _same, tp.all_reduce)


def reduce_from_tp(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """g: forward, the sum of the ranks' partial outputs; backward, identity (the sum's gradient with respect
    to each term is the sum's gradient, already the same on every rank)."""
    return Conjugate.apply(x, tp.all_reduce, _same)


def gather_from_sequence(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """Sequence parallelism's f (``sequence_parallel``): all-gather the sequence forward, reduce-scatter backward."""
    return Conjugate.apply(x, lambda t: tp.all_gather(t, SEQ), lambda g: tp.reduce_scatter(g, SEQ))


def reduce_scatter_to_sequence(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """Sequence parallelism's g: reduce-scatter forward (each rank keeps its rows of the sum), all-gather backward."""
    return Conjugate.apply(x, lambda t: tp.reduce_scatter(t, SEQ), lambda g: tp.all_gather(g, SEQ))


# ----- the parallel layers --------------------------------------------------------------------


class ColumnParallelLinear(nn.Module):
    """Rank r keeps block r of ``full``'s output rows (contiguous), and their biases.

    Input: the full activation (or, with ``sequence_parallel``, this rank's sequence shard, gathered here); output:
    this rank's slice of the features. ``regather`` (sequence parallel only) saves the shard instead of the
    gathered input and gathers it again in the backward (``_GatherLinear``).
    """

    def __init__(self, full: nn.Linear, tp: TPGroup, sequence_parallel: bool = False, regather: bool = False):
        super().__init__()
        if full.out_features % tp.size:
            raise ValueError(f"{full.out_features} output features do not split over {tp.size} ranks")
        if regather and not sequence_parallel:
            raise ValueError("regather saves a sequence shard: it needs sequence_parallel=True")
        self.tp, self.sequence_parallel, self.regather = tp, sequence_parallel, regather
        self.weight = nn.Parameter(full.weight.detach().chunk(tp.size)[tp.rank].clone())  # (out/t, in)
        self.bias = nn.Parameter(full.bias.detach().chunk(tp.size)[tp.rank].clone()) if full.bias is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.sequence_parallel:
            return F.linear(copy_to_tp(x, self.tp), self.weight, self.bias)
        if self.regather:
            return _GatherLinear.apply(x, self.weight, self.bias, self.tp)
        return F.linear(gather_from_sequence(x, self.tp), self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """Rank r keeps input columns ``r`` of ``full``'s weight; the bias is whole, added once after the sum.

    Input: this rank's slice of the features; output: the full activation (``g``), or with ``sequence_parallel``
    this rank's sequence shard of it.
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


# ----- a transformer block split over the ranks ------------------------------------------------


class TPBlock(nn.Module):
    """A ``TransformerBlock`` split over ``tp``: heads and MLP columns per rank, the rest replicated.

    Built from the single-process block's weights, with the same parameter names. With ``sequence_parallel`` its
    input and output are this rank's sequence shard and the replicated parameters (LayerNorms, row-parallel biases)
    see only their shard's rows: sum their gradients with ``sync_replicated_grads``.

    Dropout raises in training: a copied ``nn.Dropout`` draws from the same random state on every rank, so each
    rank's heads would get the masks of the other ranks' heads, correlated where they must be independent. The fix
    is a second random stream per rank, kept apart from the shared one that replicated regions need (Megatron-LM's
    model-parallel RNG tracker) and restored for every recomputation: more machinery than the course's blocks, which
    use no dropout, justify. Inference (``eval()``) runs, since dropout is off there.
    """

    def __init__(self, block: TransformerBlock, tp: TPGroup, sequence_parallel: bool = False, regather: bool = False):
        super().__init__()
        attn = block.attn
        if attn.n_heads % tp.size:
            raise ValueError(f"{attn.n_heads} heads do not split over {tp.size} ranks; choose a tensor-parallel "
                             f"size that divides the number of heads")
        sp = sequence_parallel
        self.ln1, self.ln2 = copy.deepcopy(block.ln1), copy.deepcopy(block.ln2)
        # qkv is stored head by head ([q_0 k_0 v_0 | q_1 k_1 v_1 | ...]): a contiguous block of rows is whole
        # heads, and CausalSelfAttention reads the number of heads from qkv's output, so it runs rank r's heads
        self.attn = copy.deepcopy(attn)
        self.attn.qkv = ColumnParallelLinear(attn.qkv, tp, sp, regather)
        self.attn.proj = RowParallelLinear(attn.proj, tp, sp)
        self.mlp = nn.Sequential(ColumnParallelLinear(block.mlp[0], tp, sp, regather),
                                 copy.deepcopy(block.mlp[1]), RowParallelLinear(block.mlp[2], tp, sp))
        self.dropout = float(getattr(attn, "dropout", 0.0) or 0.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and self.dropout > 0:
            raise ValueError(f"TPBlock does not train with dropout (p={self.dropout}): every rank would draw the "
                             "same masks for different heads. Build the model with dropout=0, or call eval() "
                             "for inference")
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


def sync_replicated_grads(module: nn.Module, tp: TPGroup) -> None:
    """Sum the replicated parameters' gradients over ``tp`` under sequence parallelism, in one message.

    Without sequence parallelism every rank saw the whole sequence: those gradients are complete and equal on every
    rank already, and a sum would multiply them by t. Then this does nothing.
    """
    linears = [m for m in module.modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear))]
    if len({m.sequence_parallel for m in linears}) > 1:
        raise ValueError("the module mixes sequence-parallel and plain tensor-parallel layers: the replicated "
                         "gradients of the two parts need different treatment; sync each part on its own")
    # replicated: all but the linears' split weights and the column-parallel (split) biases
    split = {id(m.weight) for m in linears} | {id(m.bias) for m in linears if isinstance(m, ColumnParallelLinear)}
    params = [p for p in module.parameters() if id(p) not in split and p.grad is not None]
    if not (params and linears and linears[0].sequence_parallel):
        return
    flat = torch.cat([p.grad.reshape(-1) for p in params])
    dist.all_reduce(flat, group=tp.group)
    for p, g in zip(params, flat.split([p.numel() for p in params])):
        p.grad.copy_(g.view_as(p.grad))
