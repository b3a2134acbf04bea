"""Which positions each rank of the ring holds, and which part of a block its queries can see (chapter 12).

Causal masking makes a plain split unfair: rank ``r``'s queries see the keys of ranks ``0..r`` only, so the last rank
computes about ``2c - 1`` times what the first does. The zigzag cuts the sequence into ``2c`` chunks and gives rank
``r`` chunks ``r`` and ``2c-1-r``, an early and a late one: the same work on every rank (the layout of
ring-flash-attention, Megatron-LM, Llama 3, torch's ``context_parallel``; Striped Attention deals tokens round-robin).

Under the zigzag a rank's queries see a wholly visible rectangle of another rank's block: all queries against its first
chunk (``j < i``), or the second chunk of queries against all keys (``j > i``). Only the own block needs a causal mask.
``Tile`` is that rectangle: ``(c+1)/2 (T/c)^2`` scores per rank, sequence and head, against whole blocks' ``c (T/c)^2``.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Sequence

import torch

LAYOUTS = ("plain", "zigzag")
Positions = Sequence[int] | torch.Tensor  # global positions: host integers, or a tensor of them on the host


def check_layout(T: int, c: int, layout: str = "zigzag") -> None:
    """Raise a ``ValueError`` unless ``T`` positions lay out over ``c`` ranks as ``layout``: both layouts cut the
    sequence into ``2c`` equal chunks (the zigzag needs them; the plain split too, so the two compare tile for tile)."""
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
    c, T = len(parts), parts[0].shape[dim] * len(parts)
    out = parts[0].new_empty(*parts[0].shape[:dim], T, *parts[0].shape[dim + 1:])
    for r, p in enumerate(parts):
        out.index_copy_(dim, positions(T, c, r, layout).to(p.device), p)
    return out


def _visible(q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
    return k_pos[None, :] <= q_pos[:, None]  # (queries, keys): causal, by global position


def _span(qs: list[int], ks: list[int]) -> tuple[int, int, bool]:
    """Where a block's visible pairs lie: queries ``a:``, keys ``:b``, and whether every pair in there is visible.
    With both lists ascending (every layout's are), the queries that see some key are a suffix (at or after the
    first key), the keys some query sees a prefix (at or before the last query). Unsorted: the whole block, masked."""
    if qs != sorted(qs) or ks != sorted(ks):
        return 0, len(ks), False
    a, b = bisect.bisect_left(qs, ks[0]), bisect.bisect_right(ks, qs[-1])
    return a, b, a < len(qs) and qs[a] >= ks[b - 1]  # the tile's first query comes after its last key


@dataclass(frozen=True)
class Tile:
    """The part of one query block against one key block that holds its visible pairs, and its causal mask (under
    the zigzag the own block's only). Built from the positions on the host, once per hop (the ring keeps it):
    counting a mask's pairs on a GPU would make the host wait at every hop."""

    rows: slice                    # the queries computed
    cols: slice                    # the keys computed
    visible: torch.Tensor | None   # (rows, cols) bool on the device, or None: every pair visible
    pairs: int                     # visible query-key pairs; 0: nothing to compute
    scores: int                    # score elements computed, rows x cols (the work, visible or not)

    @classmethod
    def of(cls, q_pos: Positions, k_pos: Positions, device: torch.device | str) -> "Tile":
        """The tile of queries at ``q_pos`` against keys at ``k_pos`` (host positions); pairs counted in Python, the
        mask (where one is needed) made on ``device`` from the positions (two index lists copied, no wait)."""
        qs, ks = (pos.tolist() if torch.is_tensor(pos) else [int(p) for p in pos] for pos in (q_pos, k_pos))
        ordered = sorted(ks)
        pairs = sum(bisect.bisect_right(ordered, q) for q in qs)  # keys at or before each query
        a, b, whole = _span(qs, ks)
        mask = None if whole or not pairs else _visible(torch.tensor(qs[a:], device=device),
                                                         torch.tensor(ks[:b], device=device))
        return cls(slice(a, len(qs)), slice(0, b), mask, pairs, (len(qs) - a) * b if pairs else 0)
