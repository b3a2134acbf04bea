"""Ring attention: causal attention over ``c`` ranks that each hold ``T/c`` of the sequence (chapter 12).

Only attention needs the other positions. The key/value blocks go round a ring of ranks, ``c - 1`` hops, and each rank
merges the partial results of its queries against each block with the online softmax (``merge``): a partial result is
an output ``o`` (normalised over its keys) and a log-sum-exp ``L`` per row (Liu et al. 2023). The backward
(FlashAttention's, Dao et al. 2022) rebuilds each block's probabilities from ``q``, ``k`` and the final ``L``: the K, V
blocks go round again, and one message behind each its ``dK, dV`` sums, which take one more hop home. Every hop is
posted before the tile it travels behind and waited for after it (only the last hop home has no tile to hide it).
Under bf16 the scores, ``L`` and the sums are float32, as FlashAttention keeps them. Which positions a rank holds and
which part of a block it computes: ``layout``; the transformer around it: ``model``.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Iterator

import torch
import torch.distributed as dist

from course_lib.parallel.collectives import Exchange, Message, exchange
from course_lib.parallel.context_parallel.layout import Positions, Tile, check_layout, position_list, positions


def merge(o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor, lse2: torch.Tensor
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Two partial attention results of the same queries over disjoint key sets, as one: the online softmax.
    Each ``o_i`` weighs ``exp(L_i - L)`` with ``L = log(exp L_1 + exp L_2)``, taken against the running maximum so
    that no exponential overflows; a row that saw no key (``L = -inf``) weighs nothing."""
    m = _finite(torch.maximum(lse1, lse2))
    w1, w2 = torch.exp(lse1 - m), torch.exp(lse2 - m)
    total = w1 + w2
    lse = m + torch.log(total)  # log 0 = -inf: still no key seen
    o = (o1 * w1 + o2 * w2) / torch.where(total == 0, torch.ones_like(total), total)
    return o, lse


KV_TAG, KV_BACK_TAG, DKV_TAG = 0, 1, 2  # one tag per kind of message: the backward has two kinds in flight at once


class _RingAttention(torch.autograd.Function):
    """Causal attention over the ring: forward merges c partial results, backward sends dK, dV home."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: Ring) -> torch.Tensor:
        o, lse = _no_keys(q)  # o = 0, L = -inf, in the accumulation dtype
        for source, kv in ring.circulate(torch.stack([k, v]), KV_TAG):  # one message per hop
            _merge_tile(o, lse, q, kv[0], kv[1], ring.tile(source, q.device))
        ctx.ring = ring
        o = o.to(q.dtype)
        ctx.save_for_backward(q, k, v, o, lse)  # all T/c long: no (T, T) matrix is kept
        return o

    @staticmethod
    def backward(ctx, do: torch.Tensor):
        q, k, v, o, lse = ctx.saved_tensors
        ring: Ring = ctx.ring
        acc = accumulation_dtype(q.dtype)
        delta = (do.to(acc) * o.to(acc)).sum(dim=-1, keepdim=True)
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        grads = torch.zeros((2, *k.shape), dtype=acc, device=k.device)  # dK, dV of the block held: its sums so far
        grads_hop = grads_in = None  # the sums sent on last step, and the buffer the left neighbour's arrive in
        for source, kv in ring.circulate(torch.stack([k, v]), KV_BACK_TAG):  # the next K, V travel meanwhile
            tile = ring.tile(source, q.device)
            rows, cols = tile.rows, tile.cols
            if tile.pairs:
                dqb, dkb, dvb = attend_backward(q[..., rows, :], kv[0][..., cols, :], kv[1][..., cols, :],
                                                do[..., rows, :], lse[..., rows, :], delta[..., rows, :], tile.visible)
                dq[..., rows, :] += dqb
            if grads_hop is not None:  # this block's sums from the ranks before: they travelled during the tile
                grads_hop.wait()
                grads = grads_in
            if tile.pairs:
                grads[0][..., cols, :] += dkb
                grads[1][..., cols, :] += dvb
            if ring.world > 1:  # on to the next rank, waited for after the next tile (after the last: home)
                grads_hop, (grads_in,) = ring.pass_on([grads], DKV_TAG)
        if grads_hop is not None:  # we hold the right neighbour's dK, dV: the last hop home, no tile to hide it
            grads_hop.wait()
            grads = grads_in
        return dq.to(q.dtype), grads[0].to(k.dtype), grads[1].to(v.dtype), None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: Ring) -> torch.Tensor:
    """Causal attention of this rank's ``q`` (``B, H, T/c, d``) over every rank's keys and values."""
    n = ring.T // ring.world
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.shape[-2] != n:
            raise ValueError(f"{name} has {t.shape[-2]} positions; each of {ring.world} ranks holds T/c = {n}")
    return _RingAttention.apply(q, k, v, ring)


@dataclass
class Ring:
    """The ring one rank is in: ``world`` ranks of ``group`` laid out as ``layout`` over ``T`` positions.
    ``Ring.of(T)`` joins the default group; ``Ring(T, world=1)`` is one process, for references. It keeps each hop's
    ``Tile`` once built: one mask of ``(T/c)^2`` bytes on the device, its own block's."""

    T: int
    layout: str = "zigzag"
    world: int = 1
    rank: int = 0
    group: dist.ProcessGroup | None = None
    _tiles: dict[tuple[int, torch.device], Tile] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        check_layout(self.T, self.world, self.layout)

    @classmethod
    def of(cls, T: int, layout: str = "zigzag", group: dist.ProcessGroup | None = None) -> Ring:
        return cls(T, layout, dist.get_world_size(group), dist.get_rank(group), group)

    def positions(self, rank: int | None = None) -> torch.Tensor:
        return positions(self.T, self.world, (self.rank if rank is None else rank) % self.world, self.layout)

    def tile(self, source: int, device: torch.device) -> Tile:
        """This rank's queries against the keys of rank ``source``, on ``device``: built on the first hop only."""
        key = (source % self.world, torch.device(device))
        if key not in self._tiles:
            pos = functools.partial(position_list, self.T, self.world, layout=self.layout)
            self._tiles[key] = Tile.of(pos(self.rank), pos(key[0]), device)
        return self._tiles[key]

    def circulate(self, block: torch.Tensor, tag: int) -> Iterator[tuple[int, torch.Tensor]]:
        """Yield ``(source, block)`` for the ``world`` blocks in turn, ours first (``source``: the rank whose block
        it is). The next block's transfer is posted before each is yielded and waited for after the caller's tile."""
        for step in range(self.world):
            hop = None
            if step < self.world - 1:  # posted first: it travels while this block computes
                hop, (incoming,) = self.pass_on([block], tag)
            yield self.rank - step, block  # we hold the block of rank - step
            if hop is not None:
                hop.wait()
                block = incoming

    def pass_on(self, tensors: list[torch.Tensor], tag: int) -> tuple[Exchange, list[torch.Tensor]]:
        """Post: send ``tensors`` to the right neighbour, receive the left's into new buffers; return both."""
        bufs = [torch.empty_like(t) for t in tensors]
        right, left = self._peer(self.rank + 1), self._peer(self.rank - 1)
        return (exchange([Message(t, right, tag) for t in tensors], [Message(b, left, tag) for b in bufs], self.group),
                bufs)

    def _peer(self, r: int) -> int:
        r %= self.world
        return r if self.group is None else dist.get_global_rank(self.group, r)


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the scores, ``L`` and the sums: at least float32 (FlashAttention's under bf16), float64 stays."""
    return torch.promote_types(dtype, torch.float32)


def _finite(lse: torch.Tensor) -> torch.Tensor:
    # a row that saw no key has L = -inf; subtracting it would give nan, and its probabilities are 0 anyway
    return torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)


def _no_keys(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The result of ``q``'s rows before any key: ``o = 0``, ``L = -inf``, in the accumulation dtype."""
    acc = accumulation_dtype(q.dtype)
    return (torch.zeros(q.shape, dtype=acc, device=q.device),
            torch.full((*q.shape[:-1], 1), -math.inf, dtype=acc, device=q.device))


def _merge_tile(o: torch.Tensor, lse: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tile: Tile
                ) -> None:
    """Merge ``tile``'s part of the block ``k, v`` into the rows ``o, L`` it holds, in place (nothing if empty)."""
    if tile.pairs:
        rows, cols = tile.rows, tile.cols
        ob, lb = attend(q[..., rows, :], k[..., cols, :], v[..., cols, :], tile.visible)
        o[..., rows, :], lse[..., rows, :] = merge(o[..., rows, :], lse[..., rows, :], ob, lb)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor | None
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of one tile's queries over its keys: ``(o, L)`` in the accumulation dtype; ``visible=None``: no mask.
    A bf16 tile is computed in float32, its products too: scores rounded to bf16 would be off by up to ``2^-9 |s|``
    before the exponential, and an ``L`` so rounded weighs a block wrong by up to ``exp(2^-9 |L|)``. The cost: float32
    matrix products (slower than bf16's on a GPU) and float32 copies of the tile."""
    acc = accumulation_dtype(q.dtype)
    q, k, v = (t.to(acc) for t in (q, k, v))
    s = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    if visible is not None:
        s = s.masked_fill(~visible, -math.inf)
    lse = torch.logsumexp(s, dim=-1, keepdim=True)
    return torch.exp(s - _finite(lse)) @ v, lse


def attend_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor, lse: torch.Tensor,
                    delta: torch.Tensor, visible: torch.Tensor | None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One tile's terms of ``dq, dk, dv`` (its rows, its keys) in the accumulation dtype, from the *final* ``L``.
    With ``P = exp(S - L)`` the tile's share of the full softmax and ``delta = rowsum(dO * O)``: ``dV = P^T dO``,
    ``dS = P * (dO V^T - delta)``, ``dQ = dS K / sqrt(d)``, ``dK = dS^T Q / sqrt(d)``."""
    acc = accumulation_dtype(q.dtype)
    q, k, v, do = (t.to(acc) for t in (q, k, v, do))
    scale = 1.0 / math.sqrt(q.shape[-1])
    s = (q @ k.transpose(-2, -1)) * scale
    if visible is not None:
        s = s.masked_fill(~visible, -math.inf)
    p = torch.exp(s - _finite(lse))
    ds = p * (do @ v.transpose(-2, -1) - delta)
    return ds @ k * scale, ds.transpose(-2, -1) @ q * scale, p.transpose(-2, -1) @ do


def block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: Positions, k_pos: Positions
                    ) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Causal attention of queries (``.., n_q, d``) at ``q_pos`` over keys at ``k_pos``: ``(o, L, pairs)``, one block
    as a rank computes it: only the block's ``Tile``; the rows outside it get ``o = 0``, ``L = -inf``."""
    tile = Tile.of(q_pos, k_pos, q.device)
    o, lse = _no_keys(q)
    _merge_tile(o, lse, q, k, v, tile)
    return o, lse, tile.pairs


def ring_bytes_per_layer(T: int, b: int, h: int, c: int, act_bytes: int = 4,
                         grad_bytes: int | None = None) -> dict[str, float]:
    """Bytes one rank sends per attention layer: K, V ``c - 1`` hops forward; K, V ``c - 1`` and dK, dV ``c`` hops
    backward; each hop a ``(b, T/c, h)`` tensor per matrix: ``2(c-1)/c`` and ``(4c-2)/c`` times ``T b h`` elements.
    ``grad_bytes``: dK, dV's element, by default the accumulation dtype's (at least 4: a sum rounded to bf16 at
    every hop would lose bits at each, so under bf16 they travel as 4 bytes an element instead of 2)."""
    grad_bytes = max(act_bytes, 4) if grad_bytes is None else grad_bytes
    block = T / c * b * h
    if c == 1:
        return {"forward": 0.0, "backward": 0.0}
    return {"forward": 2 * (c - 1) * block * act_bytes,
            "backward": (2 * (c - 1) * act_bytes + 2 * c * grad_bytes) * block}
