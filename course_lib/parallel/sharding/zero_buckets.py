"""ZeroOptimizer's flat layout: which parameters share which bucket, and each rank's shard (chapter 09).

Every trainable parameter becomes a view into one flat buffer, cut into buckets as ``ddp.assign_buckets`` cuts DDP's
gradients: in reverse order (the order the backward produces them), at most ``bucket_cap_mb`` per bucket. Each bucket is
padded to a multiple of the N ranks, so that it splits into N equal slices of ``slots`` elements, as reduce-scatter and
all-gather need; rank r owns slice r of every bucket (``zero.shard_bounds``, bucket by bucket).

What it costs: at most N-1 padding elements per bucket (zero gradients, zero updates), and one collective per bucket in
each reduce-scatter and all-gather: small buckets mean many collectives, each with a fixed overhead. Why buckets at
all: stage 2 can send one bucket while the backward fills the next.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch
from torch import nn

from course_lib import memory
from course_lib.parallel.data_parallel.ddp import MiB, assign_buckets

DEFAULT_BUCKET_MB = 25.0  # PyTorch DDP's bucket_cap_mb (MiB)


def bucket_sizes(params: list[torch.Tensor], bucket_cap_mb: float = DEFAULT_BUCKET_MB) -> list[int]:
    """Bytes of each bucket ``ZeroOptimizer`` (and ``ddp.BucketedDDP``) makes of ``params``, before padding."""
    nbytes = [memory.tensor_bytes(p) for p in params]
    return [sum(nbytes[i] for i in b) for b in assign_buckets(nbytes, bucket_cap_mb * MiB)]


@dataclass(eq=False)
class Bucket:
    """Parameters ``params`` (indices) at ``offsets`` inside a region of ``world`` x ``slots`` elements."""

    params: list[int]
    offsets: list[int]      # where each parameter starts, relative to the region
    start: int              # where the region starts in the flat buffer
    slots: int              # elements per rank: the region is padded to world x slots
    world: int              # the number of ranks, N
    piece: nn.Parameter | None = None  # this rank's slice of the region: what the inner optimizer updates

    def region(self, flat: torch.Tensor) -> torch.Tensor:
        """The bucket's elements (padding included) in a flat buffer laid out as the parameters are."""
        return flat[self.start:self.start + self.slots * self.world]

    def shard(self, flat: torch.Tensor, rank: int) -> torch.Tensor:
        """Rank ``rank``'s slice of the bucket's region: ``slots`` elements."""
        return self.region(flat)[rank * self.slots:(rank + 1) * self.slots]

    def zeros(self) -> torch.Tensor:
        """A zero gradient for the whole region."""
        return self.piece.new_zeros(self.slots * self.world)


class FlatLayout:
    """Where each of ``params`` lives in the flat buffer: ``buckets`` in backward order, ``bucket_of[i]``."""

    def __init__(self, params: list[torch.Tensor], world: int, bucket_cap_mb: float = DEFAULT_BUCKET_MB):
        self.params = params
        self.buckets: list[Bucket] = []
        self.bucket_of: dict[int, tuple[int, int]] = {}  # parameter index -> (its bucket, its offset there)
        start = 0
        for idx in assign_buckets([memory.tensor_bytes(p) for p in params], bucket_cap_mb * MiB):
            sizes = [params[i].numel() for i in idx]
            offsets = list(itertools.accumulate(sizes[:-1], initial=0))
            self.bucket_of.update({i: (len(self.buckets), o) for i, o in zip(idx, offsets)})
            self.buckets.append(Bucket(idx, offsets, start, math.ceil(sum(sizes) / world), world))
            start += self.buckets[-1].slots * world
        self.numel = start  # the flat buffer's length, padding included

    def view(self, flat: torch.Tensor, i: int) -> torch.Tensor:
        """Parameter ``i``'s elements in a flat buffer laid out as the parameters are."""
        k, o = self.bucket_of[i]
        at = self.buckets[k].start + o
        return flat[at:at + self.params[i].numel()]

    @torch.no_grad()
    def flatten(self) -> torch.Tensor:
        """A new flat buffer holding the parameters' values; each parameter becomes a view of it. The model keeps
        working unchanged (the same tensors, their storage moved). Costs one copy of the parameters, once."""
        first = self.params[0]
        flat = torch.zeros(self.numel, dtype=first.dtype, device=first.device)
        for i, p in enumerate(self.params):
            self.view(flat, i).copy_(p.reshape(-1))
            p.data = self.view(flat, i).view_as(p)
        return flat

    def cut_pieces(self, flat: torch.Tensor, rank: int) -> list[nn.Parameter]:
        """Give every bucket its ``piece``, rank ``rank``'s slice of ``flat``, and return them: views, so an optimizer
        that updates them in place writes straight into the model's weights (this rank's slice of them)."""
        for b in self.buckets:
            b.piece = nn.Parameter(b.shard(flat, rank))
        return [b.piece for b in self.buckets]
