"""Context parallelism: ring attention over ranks that each hold a slice of the sequence (chapter 12).

Each of ``c`` ranks holds ``T/c`` of the sequence's positions: its queries,
keys and values. Everything in a transformer layer but attention works on
positions independently, so only attention needs the others' keys and
values. Ring attention (Liu et al. 2023, "Ring Attention with Blockwise
Transformers for Near-Infinite Context") passes the key/value blocks around a
ring of ranks, ``c - 1`` hops, and each rank merges the partial results of
its queries against each block with the online softmax of chapter 11: a
partial result is an output ``o`` (already normalised) and one log-sum-exp
``L`` per query row, and two merge as softmax-weighted averages (``merge``).
The backward pass (FlashAttention's, Dao et al. 2022) rebuilds each block's
probabilities from ``q``, ``k`` and the final ``L``; the key/value blocks go
around the ring again, and one message behind each the gradient accumulators
``dK, dV`` of the block, which take one more hop to come home.

Causal masking makes a plain split unfair: rank ``r``'s queries see the keys
of ranks ``0..r`` only, so the last rank computes about ``2c - 1`` times what
the first does. The zigzag layout cuts the sequence into ``2c`` chunks and
gives rank ``r`` chunks ``r`` and ``2c-1-r``: an early and a late chunk, the
same work on every rank. This zigzag is ring-flash-attention's, Megatron-LM's
context parallelism's and Llama 3's (Dubey et al. 2024, section 3.3.2), and
torch's ``context_parallel`` does the same by default; Striped Attention
(Brandon et al. 2023) balances differently, dealing tokens round-robin.

Only the visible part of a block is computed (``Tile``), as ring-flash-attention
does: under the zigzag, rank ``i`` against the block of rank ``j < i`` computes
all its queries against that block's first chunk of keys, against ``j > i``
its second chunk of queries against all the keys, both without a mask; only its
own block (``j = i``) is computed whole, under the causal mask. That is
``(c+1)/2 (T/c)^2`` scores per rank, sequence and head instead of the
``c (T/c)^2`` of whole blocks (``tile_scores``, ``full_block_scores``).

Overlap: each hop is posted before the tile it travels behind is computed, and
waited for after it, so the transfer can run behind the computation. Forward: K, V.
Backward: K, V as one message, and the block's ``dK, dV`` sums as another,
posted once this rank's terms are added and waited for only after the next
tile; the last ``dK, dV`` hop, home, has no tile left to hide behind.

Bytes each rank sends per layer, elements of ``b (T/c) h`` each: the forward
sends K and V ``c - 1`` times; the backward sends K, V ``c - 1`` times and
dK, dV ``c`` times: ``2(c-1)/c`` and ``(4c-2)/c`` times ``T b h`` elements.

Precision: under bf16 (or fp16) each block is computed in float32 (scores,
products, the log-sum-exp ``L``), and the merged output and the gradient sums
(``dQ``, and the ``dK, dV`` that travel) stay in float32, as FlashAttention
keeps its statistics and accumulators; outputs and gradients leave in the input
dtype. An ``L`` rounded to bf16's 8 bits weighs a block wrong by up to
``exp(2^-9 |L|)``, and a sum rounded at every hop loses bits at each. The cost:
float32 products, and dK, dV travel as 4 bytes an element instead of 2.
"""

from __future__ import annotations

import bisect
import math
import time
from dataclasses import dataclass, field
from typing import Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from course_lib.parallel.collectives import ByteCounter, Exchange, Message, exchange, nbytes

LAYOUTS = ("plain", "zigzag")
Positions = Sequence[int] | torch.Tensor  # global positions: host integers, or a tensor of them on the host


def check_layout(T: int, c: int, layout: str = "zigzag") -> None:
    """Raise a clear ``ValueError`` unless ``T`` positions can be laid out over ``c`` ranks as ``layout``.

    Both layouts cut the sequence into ``2c`` equal chunks (the zigzag needs
    them; the plain split uses the same chunks, so the two compare tile for tile).
    """
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; choose one of {', '.join(LAYOUTS)}")
    if not isinstance(c, int) or c < 1:
        raise ValueError(f"the context-parallel size must be a positive int, got {c!r}")
    if not isinstance(T, int) or T < 1 or T % (2 * c):
        raise ValueError(f"sequence length {T!r} is not divisible by 2c = {2 * c}: each of the {c} ranks holds two "
                         f"chunks of T/(2c) positions; pad the sequence to a multiple of {2 * c} or choose another c")


def position_list(T: int, c: int, rank: int, layout: str = "zigzag") -> list[int]:
    """The global positions rank ``rank`` holds, in order, as host integers: ``T/c`` contiguous ones (``plain``),
    or chunks ``rank`` and ``2c-1-rank`` of ``T/(2c)`` each (``zigzag``)."""
    check_layout(T, c, layout)
    if not 0 <= rank < c:
        raise ValueError(f"rank {rank} is not in 0..{c - 1}")
    n, m = T // c, T // (2 * c)
    if layout == "plain":
        return list(range(rank * n, (rank + 1) * n))
    return [*range(rank * m, (rank + 1) * m), *range((2 * c - 1 - rank) * m, (2 * c - rank) * m)]


def positions(T: int, c: int, rank: int, layout: str = "zigzag") -> torch.Tensor:
    """``position_list`` as a tensor on the host (an index: callers move it where they index)."""
    return torch.tensor(position_list(T, c, rank, layout))  # host


def shard(x: torch.Tensor, c: int, rank: int, layout: str = "zigzag", dim: int = 1) -> torch.Tensor:
    """Rank ``rank``'s positions of ``x`` along ``dim`` (the sequence dimension)."""
    return x.index_select(dim, positions(x.shape[dim], c, rank, layout).to(x.device))


def unshard(parts: list[torch.Tensor], layout: str = "zigzag", dim: int = 1) -> torch.Tensor:
    """The whole tensor from every rank's part, in rank order (the inverse of ``shard``)."""
    c = len(parts)
    T = parts[0].shape[dim] * c
    out = torch.empty(*parts[0].shape[:dim], T, *parts[0].shape[dim + 1:], dtype=parts[0].dtype,
                      device=parts[0].device)
    for r, p in enumerate(parts):
        out.index_copy_(dim, positions(T, c, r, layout).to(p.device), p)
    return out


def causal_pairs(T: int, c: int, layout: str = "zigzag") -> list[int]:
    """Query-key pairs each rank's queries attend to under the causal mask: the position p sees p + 1 keys."""
    return [int((positions(T, c, r, layout) + 1).sum()) for r in range(c)]


def _finite(lse: torch.Tensor) -> torch.Tensor:
    # a row that saw no key has L = -inf; subtracting it would give nan, and its probabilities are 0 anyway
    return torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)


def merge(o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor, lse2: torch.Tensor
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Two partial attention results of the same queries over disjoint key sets, as one: the online softmax.

    ``o_i`` is softmax-weighted over its keys, ``L_i`` the log of its sum of
    exponentials; the merged result weights each by ``exp(L_i - L)`` with
    ``L = log(exp L_1 + exp L_2)``, computed against the running maximum so no
    exponential overflows. A row that saw no key (``L = -inf``) weighs nothing.
    """
    m = _finite(torch.maximum(lse1, lse2))
    w1, w2 = torch.exp(lse1 - m), torch.exp(lse2 - m)
    total = w1 + w2
    lse = m + torch.log(total)  # log 0 = -inf: still no key seen
    o = (o1 * w1 + o2 * w2) / torch.where(total == 0, torch.ones_like(total), total)
    return o, lse


def _visible(q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
    return k_pos[None, :] <= q_pos[:, None]  # (queries, keys): causal, by global position


def _span(qs: list[int], ks: list[int]) -> tuple[int, int, bool]:
    """Where a block's visible pairs lie: queries ``a:``, keys ``:b``, and whether every pair in there is visible.

    With both position lists ascending (every layout's are), the queries that see
    some key are those at or after the first key, a suffix of the list; the keys
    some query sees are those at or before the last query, a prefix. Unsorted
    positions keep the whole block, masked.
    """
    if qs != sorted(qs) or ks != sorted(ks):
        return 0, len(ks), False
    a, b = bisect.bisect_left(qs, ks[0]), bisect.bisect_right(ks, qs[-1])
    return a, b, a < len(qs) and qs[a] >= ks[b - 1]  # the tile's first query comes after its last key


@dataclass(frozen=True)
class Tile:
    """The part of one query block against one key block that holds its visible pairs, and its causal mask.

    Under the zigzag, rank ``i``'s tile against the keys of rank ``j`` is: all
    queries against the first chunk of keys (``j < i``), the second chunk of
    queries against all keys (``j > i``), both wholly visible (``visible`` is
    ``None``: no mask); its own block whole, masked (``j = i``). Built from the
    positions on the host, once (a ring keeps one per hop for every layer and
    step): counting a mask's pairs on a GPU would make the host wait at every hop.
    """

    rows: slice                    # the queries computed
    cols: slice                    # the keys computed
    visible: torch.Tensor | None   # (rows, cols) bool on the device, or None: every pair visible
    pairs: int                     # visible query-key pairs; 0: nothing to compute
    scores: int                    # score elements computed, rows x cols (the work, visible or not)

    @classmethod
    def of(cls, q_pos: Positions, k_pos: Positions, device: torch.device | str) -> "Tile":
        """The tile of queries at ``q_pos`` against keys at ``k_pos``; pairs counted in Python, the mask (where one
        is needed) made on ``device`` from the positions (a copy of two index lists, no wait for the device)."""
        # tensors are read on the host: positions live there (``positions``); a ring passes lists
        qs, ks = (pos.tolist() if torch.is_tensor(pos) else [int(p) for p in pos] for pos in (q_pos, k_pos))
        ordered = sorted(ks)
        pairs = sum(bisect.bisect_right(ordered, q) for q in qs)  # keys at or before each query
        a, b, whole = _span(qs, ks)
        mask = None
        if pairs and not whole:
            mask = _visible(torch.tensor(qs[a:], device=device), torch.tensor(ks[:b], device=device))
        return cls(slice(a, len(qs)), slice(0, b), mask, pairs, (len(qs) - a) * b if pairs else 0)


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the scores, ``L`` and the sums: at least float32 (FlashAttention's under bf16), float64 stays."""
    return torch.promote_types(dtype, torch.float32)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor | None
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of one tile's queries over its keys: ``(o, L)`` in the accumulation dtype; ``visible=None``: no mask.

    A bf16 tile is computed in float32, its products too: scores rounded to bf16
    would be off by up to ``2^-9 |s|`` before the exponential. The cost: float32
    matrix products (slower than bf16's on a GPU) and float32 copies of the tile.
    """
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
    """One tile's terms of ``dq, dk, dv`` (its rows, its keys), in the accumulation dtype; see
    ``block_attention_backward`` for the formulas."""
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
    """Causal attention of queries (``.., n_q, d``) at ``q_pos`` over keys at ``k_pos``: ``(o, L, pairs)``.

    ``o`` normalised over these keys only, ``L`` the row's log-sum-exp (``-inf``
    where no key is visible), ``pairs`` the visible query-key pairs. Only the
    block's ``Tile`` is computed: a block no query can see costs nothing, and
    the rows outside the tile get ``o = 0``, ``L = -inf``.
    """
    tile = Tile.of(q_pos, k_pos, q.device)
    acc = accumulation_dtype(q.dtype)
    o = torch.zeros(q.shape, dtype=acc, device=q.device)
    lse = torch.full((*q.shape[:-1], 1), -math.inf, dtype=acc, device=q.device)
    if tile.pairs:
        rows, cols = tile.rows, tile.cols
        o[..., rows, :], lse[..., rows, :] = attend(q[..., rows, :], k[..., cols, :], v[..., cols, :], tile.visible)
    return o, lse, tile.pairs


def block_attention_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor, lse: torch.Tensor,
                             delta: torch.Tensor, q_pos: Positions, k_pos: Positions
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This block's terms of ``dq, dk, dv``, given the *final* ``L`` and ``delta = rowsum(dO * O)``.

    With ``P = exp(S - L)`` the block's share of the full softmax:
    ``dV = P^T dO``, ``dS = P * (dO V^T - delta)``, ``dQ = dS K / sqrt(d)``, ``dK = dS^T Q / sqrt(d)``;
    computed on the block's ``Tile`` only, zero elsewhere.
    """
    tile = Tile.of(q_pos, k_pos, q.device)
    acc = accumulation_dtype(q.dtype)
    dq, dk, dv = (torch.zeros(t.shape, dtype=acc, device=t.device) for t in (q, k, v))
    if tile.pairs:
        rows, cols = tile.rows, tile.cols
        dq[..., rows, :], dk[..., cols, :], dv[..., cols, :] = attend_backward(
            q[..., rows, :], k[..., cols, :], v[..., cols, :], do[..., rows, :], lse[..., rows, :],
            delta[..., rows, :], tile.visible)
    return dq, dk, dv


def tile_scores(T: int, c: int, layout: str = "zigzag") -> list[int]:
    """Score elements each rank's forward computes per sequence and head, tiles only: under the zigzag
    ``n^2 + (c-1) n^2/2`` (own block whole, the others' half), ``n = T/c``."""
    return [sum(Tile.of(position_list(T, c, r, layout), position_list(T, c, j, layout), "cpu").scores
                for j in range(c)) for r in range(c)]


def full_block_scores(T: int, c: int, layout: str = "zigzag") -> list[int]:
    """The same count for whole ``n x n`` blocks, masked, every block with a visible pair computed: ``c n^2`` per
    rank under the zigzag (what a kernel that masks but never slices computes)."""
    n = T // c
    return [n * n * sum(Tile.of(position_list(T, c, r, layout), position_list(T, c, j, layout), "cpu").pairs > 0
                        for j in range(c)) for r in range(c)]


@dataclass
class HopTimes:
    """Seconds per ring step of one pass: computing the step's tile, and waiting for its messages afterwards
    (the part of the transfer the computation did not hide)."""

    compute: list[float] = field(default_factory=list)
    wait: list[float] = field(default_factory=list)


class _Timer:
    """Adds laps of the host clock to a ``HopTimes``; does nothing without one (an untimed ring)."""

    def __init__(self, times: HopTimes | None, device: torch.device) -> None:
        self.times, self.device, self.t = times, device, 0.0

    def _now(self) -> float:
        if self.device.type == "cuda":  # the device's queued work done: a sync, paid only when timing
            torch.cuda.current_stream(self.device).synchronize()
        return time.perf_counter()

    def step(self) -> None:
        if self.times is not None:
            self.times.compute.append(0.0)
            self.times.wait.append(0.0)
            self.t = self._now()

    def lap(self, kind: str) -> None:  # "compute" or "wait": the time since the last lap goes there
        if self.times is not None:
            t = self._now()
            getattr(self.times, kind)[-1] += t - self.t
            self.t = t


@dataclass
class Ring:
    """The ring one rank is in: ``world`` ranks of ``group`` laid out as ``layout`` over ``T`` positions.

    ``counter`` counts the bytes this rank sends (``ring_kv`` forward,
    ``ring_kv_bwd`` and ``ring_dkv`` backward); ``pairs`` and ``scores`` collect
    the visible query-key pairs and the score elements each forward computed.
    ``timed``: each pass's ``HopTimes`` go to ``times[direction]`` (on a GPU at
    the cost of a sync per step). ``Ring.of(T)`` joins the default group;
    ``Ring(T, world=1)`` is one process, for references. The ring keeps each
    hop's ``Tile`` once built: one mask of ``(T/c)^2`` bytes on the device, its own block's.
    """

    T: int
    layout: str = "zigzag"
    world: int = 1
    rank: int = 0
    group: dist.ProcessGroup | None = None
    counter: ByteCounter = field(default_factory=ByteCounter)
    pairs: list[int] = field(default_factory=list)
    scores: list[int] = field(default_factory=list)
    timed: bool = False
    times: dict[str, list[HopTimes]] = field(default_factory=dict)
    _tiles: dict[tuple[int, torch.device], Tile] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        check_layout(self.T, self.world, self.layout)

    @classmethod
    def of(cls, T: int, layout: str = "zigzag", group: dist.ProcessGroup | None = None) -> "Ring":
        return cls(T, layout, dist.get_world_size(group), dist.get_rank(group), group)

    def positions(self, rank: int | None = None) -> torch.Tensor:
        return positions(self.T, self.world, (self.rank if rank is None else rank) % self.world, self.layout)

    def position_list(self, rank: int | None = None) -> list[int]:
        return position_list(self.T, self.world, (self.rank if rank is None else rank) % self.world, self.layout)

    def tile(self, source: int, device: torch.device) -> Tile:
        """This rank's queries against the keys of rank ``source``, on ``device``: built on the first hop only."""
        key = (source % self.world, torch.device(device))
        if key not in self._tiles:
            self._tiles[key] = Tile.of(self.position_list(), self.position_list(source), device)
        return self._tiles[key]

    def timer(self, direction: str, device: torch.device) -> _Timer:
        """A timer of one pass (``forward``, ``backward``): a no-op unless the ring is ``timed``."""
        times = None
        if self.timed:
            times = HopTimes()
            self.times.setdefault(direction, []).append(times)
        return _Timer(times, torch.device(device))

    def _peer(self, r: int) -> int:
        r %= self.world
        return r if self.group is None else dist.get_global_rank(self.group, r)

    def pass_on(self, tensors: list[torch.Tensor], op: str, tag: int = 0) -> tuple[Exchange, list[torch.Tensor]]:
        """Post: send ``tensors`` to the right neighbour, receive the left's; return (the exchange, the buffers).

        One hop, counted once (all its bytes), however many tensors it carries.
        ``tag`` tells apart two kinds of message in flight between the same ranks.
        """
        bufs = [torch.empty_like(t) for t in tensors]
        self.counter.add(op, sum(nbytes(t) for t in tensors))
        right, left = self._peer(self.rank + 1), self._peer(self.rank - 1)
        return (exchange([Message(t, right, tag) for t in tensors], [Message(b, left, tag) for b in bufs], self.group),
                bufs)


_DP_GROUPS: dict[int, list[dist.ProcessGroup]] = {}  # dp -> its rings' groups, made once per process


def data_parallel_ring(T: int, dp: int) -> Ring:
    """This rank's ring when the ranks form ``dp`` data-parallel groups of ``world / dp`` consecutive ranks,
    each group one ring over the whole sequence. Every rank makes every group, once, as ``new_group`` requires."""
    world = dist.get_world_size()
    if dp < 1 or world % dp:
        raise ValueError(f"{dp} data-parallel groups do not divide the {world} ranks")
    if dp == 1:
        return Ring.of(T)
    c = world // dp
    if dp not in _DP_GROUPS:
        _DP_GROUPS[dp] = [dist.new_group(list(range(g * c, (g + 1) * c))) for g in range(dp)]
    return Ring.of(T, group=_DP_GROUPS[dp][dist.get_rank() // c])


KV_TAG, DKV_TAG = 0, 1  # the backward has a K, V and a dK, dV message in flight at once
PASS_OPS = {"forward": ("ring_kv",), "backward": ("ring_kv_bwd", "ring_dkv")}  # the counter's names, per pass


def sent_per_pass(counter: ByteCounter) -> dict[str, float]:
    """The bytes a ring's ``counter`` counted, forward and backward (``ring_bytes_per_layer``'s two keys)."""
    return {name: sum(counter.by_op.get(op, 0.0) for op in ops) for name, ops in PASS_OPS.items()}


class _RingAttention(torch.autograd.Function):
    """Causal attention over the ring: forward merges c partial results, backward sends dK, dV home; every hop is
    posted before the tile it travels behind and waited for after it (but the backward's last, home)."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: Ring) -> torch.Tensor:
        acc = accumulation_dtype(q.dtype)
        o = torch.zeros(q.shape, dtype=acc, device=q.device)  # no key seen yet: o = 0, L = -inf
        lse = torch.full((*q.shape[:-1], 1), -math.inf, dtype=acc, device=q.device)
        kv = torch.stack([k, v])  # one message per hop
        timer = ring.timer("forward", q.device)
        pairs = scores = 0
        for step in range(ring.world):
            timer.step()
            pending = None
            if step < ring.world - 1:  # post the next block's transfer first: it travels while this one computes
                pending, (incoming,) = ring.pass_on([kv], "ring_kv", KV_TAG)
            tile = ring.tile(ring.rank - step, q.device)
            if tile.pairs:  # the tile only, merged into its rows (in the accumulation dtype)
                rows, cols = tile.rows, tile.cols
                ob, lb = attend(q[..., rows, :], kv[0][..., cols, :], kv[1][..., cols, :], tile.visible)
                o[..., rows, :], lse[..., rows, :] = merge(o[..., rows, :], lse[..., rows, :], ob, lb)
            pairs, scores = pairs + tile.pairs, scores + tile.scores
            timer.lap("compute")
            if pending is not None:
                pending.wait()
                kv = incoming
            timer.lap("wait")
        ring.pairs.append(pairs)
        ring.scores.append(scores)
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
        kv = torch.stack([k, v])
        grads = torch.zeros((2, *k.shape), dtype=acc, device=k.device)  # dK, dV of the block held: its sums so far
        grads_hop = grads_in = None  # the sums sent on last step, and the buffer the left neighbour's arrive in
        timer = ring.timer("backward", q.device)
        for step in range(ring.world):
            timer.step()
            kv_hop = None
            if step < ring.world - 1:  # the next K, V travel while this block is computed
                kv_hop, (kv_next,) = ring.pass_on([kv], "ring_kv_bwd", KV_TAG)
            tile = ring.tile(ring.rank - step, q.device)
            rows, cols = tile.rows, tile.cols
            if tile.pairs:
                dqb, dkb, dvb = attend_backward(q[..., rows, :], kv[0][..., cols, :], kv[1][..., cols, :],
                                                do[..., rows, :], lse[..., rows, :], delta[..., rows, :], tile.visible)
                dq[..., rows, :] += dqb
            timer.lap("compute")
            if grads_hop is not None:  # this block's sums from the ranks before: they travelled during the tile
                grads_hop.wait()
                grads = grads_in
            timer.lap("wait")
            if tile.pairs:
                grads[0][..., cols, :] += dkb
                grads[1][..., cols, :] += dvb
            if ring.world > 1:  # on to the next rank, waited for after the next tile (after the last: home)
                grads_hop, (grads_in,) = ring.pass_on([grads], "ring_dkv", DKV_TAG)
            timer.lap("compute")
            if kv_hop is not None:
                kv_hop.wait()
                kv = kv_next
            timer.lap("wait")
        if grads_hop is not None:
            # after c - 1 hops this rank held the right neighbour's dK, dV: the last hop took them home, and no
            # tile is left to hide it behind
            grads_hop.wait()
            grads = grads_in
            timer.lap("wait")
        return dq.to(q.dtype), grads[0].to(k.dtype), grads[1].to(v.dtype), None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: Ring) -> torch.Tensor:
    """Causal attention of this rank's ``q`` (``B, H, T/c, d``) over every rank's keys and values."""
    n = ring.T // ring.world
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.shape[-2] != n:
            raise ValueError(f"{name} has {t.shape[-2]} positions; each of {ring.world} ranks holds T/c = {n}")
    return _RingAttention.apply(q, k, v, ring)


def attention_forward(attn: nn.Module, x: torch.Tensor, ring: Ring) -> torch.Tensor:
    """``models.CausalSelfAttention``'s computation on this rank's positions, attention over the ring."""
    B, n, C = x.shape
    H = attn.n_heads
    qkv = attn.qkv(x).view(B, n, H, 3, C // H)  # head-major, as in the model
    q, k, v = (qkv[..., i, :].transpose(1, 2).contiguous() for i in range(3))
    y = ring_attention(q, k, v, ring)
    return attn.proj(y.transpose(1, 2).reshape(B, n, C))


def block_forward(block: nn.Module, x: torch.Tensor, ring: Ring) -> torch.Tensor:
    """A ``models.TransformerBlock`` on this rank's positions ``x`` (``B, T/c, C``): attention over the ring,
    every other layer position-wise, as in one process."""
    x = x + attention_forward(block.attn, block.ln1(x), ring)
    return x + block.mlp(block.ln2(x))


def model_forward(model: nn.Module, idx: torch.Tensor, ring: Ring) -> torch.Tensor:
    """A ``models.TinyTransformer``'s logits for this rank's tokens ``idx`` (``B, T/c``), its own weights.

    Every layer but attention is position-wise: the rank's tokens, with their
    global positions' embeddings, go through the same modules as in one process.
    """
    pos = ring.positions().to(idx.device)
    x = model.embed.tok(idx) + model.embed.pos(pos)
    for block in model.blocks:
        x = block_forward(block, x, ring)
    return model.head(x)


def cp_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor, ring: Ring) -> torch.Tensor:
    """This rank's share of the mean next-token loss of the batch ``x, y`` (whole sequences, every rank the same):
    the sum over its tokens / all tokens of the batch. The shares of the ring's ranks add up to the mean."""
    local_x, local_y = (shard(t, ring.world, ring.rank, ring.layout) for t in (x, y))
    return cp_local_loss(model, local_x, local_y, ring, y.numel())


def cp_local_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor, ring: Ring, tokens: int) -> torch.Tensor:
    """``cp_loss`` of this rank's positions ``x``, ``y`` (already sharded) over a batch of ``tokens`` tokens."""
    logits = model_forward(model, x, ring)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), reduction="sum") / tokens


def sum_grads(model: nn.Module) -> None:
    """Sum every parameter's gradient over the ranks: each rank's tokens gave one term (uncounted here)."""
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)


def ring_bytes_per_layer(T: int, b: int, h: int, c: int, act_bytes: int = 4,
                         grad_bytes: int | None = None) -> dict[str, float]:
    """Bytes one rank sends per attention layer: K, V ``c - 1`` hops forward; K, V ``c - 1`` and dK, dV ``c`` hops
    backward; each hop a ``(b, T/c, h)`` tensor per matrix. ``grad_bytes``: dK, dV's element, by default the
    accumulation dtype's (at least 4: they travel in float32 under bf16)."""
    grad_bytes = max(act_bytes, 4) if grad_bytes is None else grad_bytes
    block = T / c * b * h
    if c == 1:
        return {"forward": 0.0, "backward": 0.0}
    return {"forward": 2 * (c - 1) * block * act_bytes,
            "backward": (2 * (c - 1) * act_bytes + 2 * c * grad_bytes) * block}
