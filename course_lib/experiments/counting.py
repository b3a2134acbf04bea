"""Bytes a rank sends, counted from outside the teaching code: ``counted`` wraps ``torch.distributed``.

Inside ``with counted(counter, group):`` every collective on ``group`` that the code under measure hands to
``torch.distributed`` adds to ``counter`` what the ring algorithm sends per rank (``collectives.ring_factor`` x the
full tensor's bytes: an all-gather's output, a reduce-scatter's input); the collectives themselves are unchanged.
Options count the all-to-alls' rows bound for other ranks and the point-to-point sends (``ring_all_reduce``).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch
import torch.distributed as dist

from course_lib.parallel.collectives import nbytes, ring_factor


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


# torch.distributed's function -> (the ring formula's name, the position of the full tensor among its arguments);
# torch 2.14 renamed the flat reduce-scatter and all-gather to *_single: both names, whichever exist
RING = {"all_reduce": ("all_reduce", 0), "broadcast": ("broadcast", 0),
        "reduce_scatter_single": ("reduce_scatter", 1), "reduce_scatter_tensor": ("reduce_scatter", 1),
        "all_gather_single": ("all_gather", 0), "all_gather_into_tensor": ("all_gather", 0)}


@functools.cache
def _signature(fn: Callable) -> inspect.Signature:
    """torch's own signature of ``fn``, computed once (a block is entered every step it measures)."""
    return inspect.signature(fn)


def add_ring(counter: ByteCounter, op: str, full: torch.Tensor, group: dist.ProcessGroup | None = None) -> None:
    """Add to ``counter`` what ``op`` on the full tensor ``full`` sends per rank of ``group`` (ring formula)."""
    counter.add(op, ring_factor(op, dist.get_world_size(group)) * nbytes(full))


def _same_group(a: dist.ProcessGroup | None, b: dist.ProcessGroup | None) -> bool:
    """``None`` is the default group (torch's own code passes ``dist.group.WORLD`` for it)."""
    return (dist.group.WORLD if a is None else a) is (dist.group.WORLD if b is None else b)


@contextlib.contextmanager
def counted(counter: ByteCounter, group: dist.ProcessGroup | None = None, all_to_all: bool = False,
            p2p: str | None = None) -> Iterator[ByteCounter]:
    """Inside the block, count in ``counter`` what this rank sends in the collectives on ``group`` (``None``: the
    default group), by the ring formulas, under the names ``all_reduce``, ``reduce_scatter``, ``all_gather``,
    ``broadcast``. ``all_to_all``: also every ``all_to_all_single``'s rows bound for other ranks (``all_to_all``;
    integer tensors, a counts exchange: ``counts``). ``p2p``: also the bytes of every send posted through
    ``batch_isend_irecv`` (what ``collectives.exchange`` posts), under that name, one call per send.

    Blocks nest (each counts its own group); a block patches ``torch.distributed``, so code that took a collective
    out of it before (``from torch.distributed import all_reduce``) is not seen.
    """
    measured, originals = group, {}  # ``group`` is also the spies' keyword argument

    def ring(name: str, fn: Callable) -> Callable:
        op, at = RING[name]
        signature = _signature(inspect.unwrap(fn))  # torch's own, under the spies of enclosing blocks

        @functools.wraps(fn)
        def spy(*args, **kwargs):
            given = signature.bind(*args, **kwargs).arguments
            if _same_group(given.get("group"), measured):
                add_ring(counter, op, list(given.values())[at], given.get("group"))
            return fn(*args, **kwargs)
        return spy

    @functools.wraps(dist.all_to_all_single)
    def all_to_all_single(out, inp, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False):
        if _same_group(group, measured):
            n = dist.get_world_size(group)
            splits = input_split_sizes or [inp.shape[0] // n] * n
            row = nbytes(inp[0]) if inp.shape[0] else 0
            counter.add("all_to_all" if inp.is_floating_point() else "counts",
                        row * (sum(splits) - splits[dist.get_rank(group)]))
        return originals["all_to_all_single"](out, inp, output_split_sizes, input_split_sizes, group=group,
                                              async_op=async_op)

    @functools.wraps(dist.batch_isend_irecv)
    def batch_isend_irecv(ops):
        for op in ops:
            if getattr(op.op, "__name__", "") == "isend" and _same_group(op.group, measured):
                counter.add(p2p, nbytes(op.tensor))
        return originals["batch_isend_irecv"](ops)

    spies = {name: ring(name, getattr(dist, name)) for name in RING if hasattr(dist, name)}
    if all_to_all:
        spies["all_to_all_single"] = all_to_all_single
    if p2p is not None:
        spies["batch_isend_irecv"] = batch_isend_irecv
    for name, spy in spies.items():
        originals[name] = getattr(dist, name)
        setattr(dist, name, spy)
    try:
        yield counter
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
