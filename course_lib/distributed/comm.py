"""Collectives that count the bytes they send (chapters 06-08).

Each wrapper forwards to ``torch.distributed`` and adds to a ``ByteCounter``
the bytes that *this rank* sends under the ring algorithm (Patarasuk & Yuan
2009; the analysis NCCL's performance notes use), for a tensor of ``B`` bytes
on ``N`` ranks:

- all-reduce:     2 (N-1)/N x B   (a reduce-scatter, then an all-gather)
- reduce-scatter:   (N-1)/N x B   (B = the full tensor, each rank keeps 1/N)
- all-gather:       (N-1)/N x B   (B = the full tensor, each rank brings 1/N)
- broadcast:        (N-1)/N x B   (a chain: N-1 links carry B; averaged over the N ranks)

So an all-reduce costs about twice the gradient per rank whatever N is: the
reason data parallelism scales. The counts are what the algorithm sends, not
what a library happens to do (gloo may pick another algorithm);
``ring_all_reduce`` is the hand-written ring whose real sends match the formula.

Flat-tensor reduce-scatter and all-gather go through ``reduce_scatter_single``
and ``all_gather_single``: the names torch 2.14 gives to what earlier releases
(and much of the literature) call ``reduce_scatter_tensor`` and
``all_gather_into_tensor``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

ReduceOp = dist.ReduceOp


@dataclass
class ByteCounter:
    """Bytes this rank sent: ``bytes`` in total, ``by_op[name]`` per collective, ``calls[name]`` per call."""

    bytes: float = 0.0
    by_op: dict[str, float] = field(default_factory=dict)
    calls: dict[str, int] = field(default_factory=dict)

    def add(self, op: str, nbytes: float) -> None:
        self.bytes += nbytes
        self.by_op[op] = self.by_op.get(op, 0.0) + nbytes
        self.calls[op] = self.calls.get(op, 0) + 1

    def reset(self) -> None:
        self.bytes, self.by_op, self.calls = 0.0, {}, {}


def nbytes(t: torch.Tensor) -> int:
    """Bytes of a tensor's elements."""
    return t.numel() * t.element_size()


def ring_factor(op: str, world: int) -> float:
    """Bytes sent per rank per byte of (full) tensor, for the ring algorithm of ``op``."""
    if world < 1:
        raise ValueError(f"world size must be >= 1, got {world}")
    per = {"all_reduce": 2.0, "reduce_scatter": 1.0, "all_gather": 1.0, "broadcast": 1.0}
    if op not in per:
        raise ValueError(f"unknown collective {op!r}; known: {', '.join(per)}")
    return per[op] * (world - 1) / world


def _world(group: dist.ProcessGroup | None) -> int:
    return dist.get_world_size(group)


def all_reduce(t: torch.Tensor, op: ReduceOp.RedOpType = ReduceOp.SUM, counter: ByteCounter | None = None,
               group: dist.ProcessGroup | None = None, async_op: bool = False):
    """``dist.all_reduce`` in place, counting 2(N-1)/N x bytes(t)."""
    if counter is not None:
        counter.add("all_reduce", ring_factor("all_reduce", _world(group)) * nbytes(t))
    return dist.all_reduce(t, op=op, group=group, async_op=async_op)


def reduce_scatter(out: torch.Tensor, inp: torch.Tensor, op: ReduceOp.RedOpType = ReduceOp.SUM,
                   counter: ByteCounter | None = None, group: dist.ProcessGroup | None = None,
                   async_op: bool = False):
    """Reduce the full flat ``inp`` over ranks; this rank keeps shard ``rank`` in ``out`` (numel = inp/N)."""
    world = _world(group)
    if inp.numel() != world * out.numel():
        raise ValueError(f"reduce_scatter: input has {inp.numel()} elements, expected world size {world} x "
                         f"output {out.numel()} = {world * out.numel()}; pad the flat tensor to a multiple of {world}")
    if counter is not None:
        counter.add("reduce_scatter", ring_factor("reduce_scatter", world) * nbytes(inp))
    return dist.reduce_scatter_single(out, inp, op=op, group=group, async_op=async_op)


def all_gather(out: torch.Tensor, inp: torch.Tensor, counter: ByteCounter | None = None,
               group: dist.ProcessGroup | None = None, async_op: bool = False):
    """Gather every rank's shard ``inp`` into the full flat ``out`` (numel = N x inp), in rank order."""
    world = _world(group)
    if out.numel() != world * inp.numel():
        raise ValueError(f"all_gather: output has {out.numel()} elements, expected world size {world} x "
                         f"input {inp.numel()} = {world * inp.numel()}")
    if counter is not None:
        counter.add("all_gather", ring_factor("all_gather", world) * nbytes(out))
    return dist.all_gather_single(out, inp, group=group, async_op=async_op)


def broadcast(t: torch.Tensor, src: int, counter: ByteCounter | None = None,
              group: dist.ProcessGroup | None = None, async_op: bool = False):
    """``dist.broadcast`` from global rank ``src``, counting (N-1)/N x bytes(t)."""
    if counter is not None:
        counter.add("broadcast", ring_factor("broadcast", _world(group)) * nbytes(t))
    return dist.broadcast(t, src, group=group, async_op=async_op)


def ring_all_reduce(t: torch.Tensor, counter: ByteCounter | None = None) -> torch.Tensor:
    """Sum ``t`` over all ranks in place with a ring of point-to-point sends; return ``t``.

    The flat tensor is cut into N chunks. Reduce-scatter: for N-1 steps each
    rank sends one chunk to its right neighbour and adds the chunk arriving
    from its left; afterwards rank r holds the full sum of chunk (r+1) mod N.
    All-gather: N-1 more steps pass the finished chunks around the ring. Every
    rank sends 2(N-1) chunks, 2(N-1)/N x bytes(t), whatever N is.
    ``counter`` counts the bytes each send really carries.
    """
    if not t.is_contiguous():
        raise ValueError("ring_all_reduce works in place on a contiguous tensor; pass t.contiguous()")
    world, rank = dist.get_world_size(), dist.get_rank()
    if world == 1:
        return t
    flat = t.view(-1)
    chunks = list(torch.tensor_split(flat, world))  # views: writing into them writes into t
    right, left = (rank + 1) % world, (rank - 1) % world
    sent = 0

    def exchange(send_idx: int, recv_idx: int) -> torch.Tensor:
        nonlocal sent
        buf = torch.empty_like(chunks[recv_idx])
        # post both at once: blocking send-then-recv on every rank would deadlock the ring
        reqs = [dist.isend(chunks[send_idx].contiguous(), right), dist.irecv(buf, left)]
        for r in reqs:
            r.wait()
        sent += nbytes(chunks[send_idx])
        return buf

    for step in range(world - 1):  # reduce-scatter
        send_idx, recv_idx = (rank - step) % world, (rank - step - 1) % world
        chunks[recv_idx].add_(exchange(send_idx, recv_idx))
    for step in range(world - 1):  # all-gather: pass on the finished chunks
        send_idx, recv_idx = (rank + 1 - step) % world, (rank - step) % world
        chunks[recv_idx].copy_(exchange(send_idx, recv_idx))
    if counter is not None:
        counter.add("ring_all_reduce", sent)
    return t
