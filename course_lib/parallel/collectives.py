"""The collectives' costs, and the ring all-reduce by hand (chapters 07-10 and 12).

For a tensor of ``B`` bytes on ``N`` ranks, the bytes *each rank* sends under the ring algorithm (Patarasuk &
Yuan 2009), ``ring_factor`` x B:

- all-reduce:                 2 (N-1)/N x B   (a reduce-scatter, then an all-gather)
- reduce-scatter, all-gather:   (N-1)/N x B   (B = the full tensor; each rank keeps, or brings, 1/N)
- broadcast:                    (N-1)/N x B   (a chain: N-1 links carry B; averaged over the N ranks)

So an all-reduce costs about twice the gradient per rank whatever N is: the reason data parallelism scales.
The counts are the algorithm's, not what gloo happens to run; ``ring_all_reduce`` is the ring by hand, whose
real sends match the formula. The teaching code calls ``torch.distributed`` (``reduce_scatter`` and ``all_gather``
check the shapes first); ``course_lib.experiments.counting.counted`` counts what it sends. ``exchange`` posts
point-to-point messages as one batch, as NCCL needs.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, NamedTuple, Sequence

import torch
import torch.distributed as dist


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


def collective(name: str, older: str) -> Callable:
    """``dist.<name>``, or ``dist.<older>`` on an older torch (a hosted notebook's own): torch 2.14 renamed the
    flat-tensor ``reduce_scatter_tensor`` and ``all_gather_into_tensor`` to ``*_single``."""
    fn = getattr(dist, name, None) or getattr(dist, older, None)
    if fn is None:
        raise RuntimeError(f"this torch ({torch.__version__}) has neither dist.{name} nor dist.{older}; "
                           "install the torch version pinned in pyproject.toml")
    return fn


def reduce_scatter(out: torch.Tensor, inp: torch.Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
                   group: dist.ProcessGroup | None = None, async_op: bool = False):
    """Reduce the full flat ``inp`` over ranks; this rank keeps shard ``rank`` in ``out`` (numel = inp/N)."""
    world = dist.get_world_size(group)
    if inp.numel() != world * out.numel():
        raise ValueError(f"reduce_scatter: input has {inp.numel()} elements, expected world size {world} x "
                         f"output {out.numel()} = {world * out.numel()}; pad the flat tensor to a multiple of {world}")
    return collective("reduce_scatter_single", "reduce_scatter_tensor")(out, inp, op=op, group=group,
                                                                         async_op=async_op)


def all_gather(out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup | None = None,
               async_op: bool = False):
    """Gather every rank's shard ``inp`` into the full flat ``out`` (numel = N x inp), in rank order."""
    world = dist.get_world_size(group)
    if out.numel() != world * inp.numel():
        raise ValueError(f"all_gather: output has {out.numel()} elements, expected world size {world} x "
                         f"input {inp.numel()} = {world * inp.numel()}")
    return collective("all_gather_single", "all_gather_into_tensor")(out, inp, group=group, async_op=async_op)


class Message(NamedTuple):
    """One point-to-point message: the tensor to send (or to receive into), the other rank, a tag."""

    tensor: torch.Tensor
    peer: int
    tag: int = 0


@dataclass
class Exchange:
    """A batch of point-to-point messages in flight.

    ``wait_received`` before reading the receive buffers, ``wait`` before reusing the send buffers. On NCCL both
    return once the GPU stream waits for the messages, before the data is there; work queued on the stream
    afterwards runs after it (time it with CUDA events, not the CPU clock).
    """

    received: list[dist.Work] = field(default_factory=list)
    sent: list[dist.Work] = field(default_factory=list)
    _waited: set[int] = field(default_factory=set, repr=False)

    def _wait(self, works: list[dist.Work]) -> None:
        for w in works:
            # each work once: a second wait on a gloo receive waits for another message, which never comes
            if id(w) not in self._waited:
                w.wait()
                self._waited.add(id(w))

    def wait_received(self) -> None:
        self._wait(self.received)

    def wait(self) -> None:
        self._wait([*self.received, *self.sent])  # on NCCL the same single work is in both lists


def exchange(sends: Sequence[Message], recvs: Sequence[Message],
             group: dist.ProcessGroup | None = None) -> Exchange:
    """Post ``sends`` and ``recvs`` together as one ``dist.batch_isend_irecv``; return what to wait for.

    Posting a send and a receive to the same peer one after the other works on gloo, whose sends do not wait, but
    hangs on NCCL, whose send waits for the matching receive: both ranks would sit in their send. One batch is one
    NCCL group, so both directions progress together.
    """
    ops = ([dist.P2POp(dist.isend, m.tensor, m.peer, group, m.tag) for m in sends]
           + [dist.P2POp(dist.irecv, m.tensor, m.peer, group, m.tag) for m in recvs])
    if not ops:
        return Exchange()
    works = dist.batch_isend_irecv(ops)
    if len(works) == len(ops):  # one work per message (gloo): a receive need not wait for the sends
        return Exchange(received=works[len(sends):], sent=works[:len(sends)])
    return Exchange(received=works, sent=works)  # one work for the whole group (NCCL coalesces)


def ring_all_reduce(t: torch.Tensor) -> torch.Tensor:
    """Sum ``t`` over all ranks in place with a ring of point-to-point sends; return ``t``.

    The flat tensor is cut into N chunks. Reduce-scatter: for N-1 steps each rank sends one chunk to its right
    neighbour and adds the chunk arriving from its left; afterwards rank r holds the full sum of chunk (r+1) mod N.
    All-gather: N-1 more steps pass the finished chunks around the ring. Every rank sends 2(N-1) chunks,
    2(N-1)/N x bytes(t), whatever N is (``counted(..., p2p=...)`` counts what each send really carries).
    """
    if not t.is_contiguous():
        raise ValueError("ring_all_reduce works in place on a contiguous tensor; pass t.contiguous()")
    world, rank = dist.get_world_size(), dist.get_rank()
    if world == 1:
        return t
    chunks = list(torch.tensor_split(t.view(-1), world))  # views: writing into them writes into t
    right, left = (rank + 1) % world, (rank - 1) % world
    for step in range(2 * (world - 1)):
        # step s sends chunk rank - s and receives chunk rank - s - 1 (mod N): in the all-gather's steps the one
        # sent is the one finished (or received) the step before
        out, into = chunks[(rank - step) % world], chunks[(rank - step - 1) % world]
        buf = torch.empty_like(into)
        # the send and the receive in one batch: blocking send-then-recv on every rank would deadlock
        # the ring, and at N = 2 both go to the same peer, which NCCL only runs as one group
        exchange([Message(out.contiguous(), right)], [Message(buf, left)]).wait()
        if step < world - 1:
            into.add_(buf)   # reduce-scatter: add the left neighbour's partial sum
        else:
            into.copy_(buf)  # all-gather: take the finished chunk
    return t
