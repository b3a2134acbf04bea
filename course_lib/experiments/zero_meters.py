"""Meters for chapter 09's sharded methods: bytes held, collectives issued and bytes sent, when ZeRO's buckets leave.

Plugged in from outside the algorithms (``course_lib.parallel.sharding``): hooks, wrappers of ``torch.distributed``
and FSDP2's public custom-collective interface. ``dp_methods``, ``tp_checks``, ``cp_checks`` and the workers use them.

- ``held_bytes``, ``held_bytes_by_device``: the model states a rank holds (DTensor-aware);
- ``count_fsdp_traffic``: FSDP2's bytes in a ``ByteCounter`` (``counting.add_ring`` for each of its collectives);
- ``count_collectives``: every collective handed to ``torch.distributed`` in a block, whoever calls it;
- ``bucket_timeline``: how many of ``ZeroOptimizer``'s buckets had left as each gradient of a backward was computed.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from course_lib import memory
from course_lib.experiments.counting import RING, ByteCounter, add_ring, counted
from course_lib.parallel import collectives as comm
from course_lib.parallel.sharding.zero import ZeroOptimizer


def local_bytes(t: torch.Tensor | None) -> int:
    """Bytes this rank stores for ``t``: a DTensor's local shard, else the tensor itself."""
    if t is None:
        return 0
    if hasattr(t, "to_local"):  # a DTensor (FSDP2's sharded parameters, gradients and Adam moments)
        t = t.to_local()
    return memory.tensor_bytes(t)


def held_bytes(model: nn.Module, optimizer: object) -> dict[str, int]:
    """Bytes of ``params``, ``grads`` and ``optimizer`` state this rank holds (DTensor-aware)."""
    inner = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer keeps the local one in .optim
    return {"params": sum(local_bytes(p) for p in model.parameters()),
            "grads": sum(local_bytes(p.grad) for p in model.parameters()),
            "optimizer": sum(local_bytes(v) for s in inner.state.values() for v in s.values() if torch.is_tensor(v))}


def held_bytes_by_device(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """The same bytes (parameters, gradients, optimizer state) by the device type that holds them, ``cpu`` or
    ``cuda``: where FSDP2's ``CPUOffloadPolicy`` keeps a rank's shards (chapter 11)."""
    out = {"cpu": 0, "cuda": 0}
    states = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    for t in [*model.parameters(), *(p.grad for p in model.parameters() if p.grad is not None), *states]:
        kind = (t.to_local() if hasattr(t, "to_local") else t).device.type
        out[kind] = out.get(kind, 0) + local_bytes(t)
    return out


def count_fsdp_traffic(model: nn.Module, counter: ByteCounter) -> int:
    """Route every FSDP2 all-gather and reduce-scatter in ``model`` through ``comm``, counting the bytes.

    Uses FSDP2's public hooks ``set_custom_all_gather`` / ``set_custom_reduce_scatter``; each collective is counted
    on the group FSDP2 hands it (a mesh's, whichever), and is otherwise unchanged (same ``torch.distributed`` calls).
    Returns how many FSDP modules were instrumented.
    """
    from torch.distributed.fsdp import FSDPModule
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
    except ImportError as exc:  # the interface lives in a private module; say so if it moves
        raise RuntimeError(f"this torch ({torch.__version__}) has no FSDP2 custom-collective interface") from exc

    class CountingAllGather(AllGather):
        def allocate(self, size, *, dtype, device):
            return torch.empty(*size, dtype=dtype, device=device)

        def __call__(self, output_tensor, input_tensor, group, async_op=False):
            add_ring(counter, "all_gather", output_tensor, group)
            return comm.all_gather(output_tensor, input_tensor, group=group, async_op=async_op)

    class CountingReduceScatter(ReduceScatter):
        def allocate(self, size, *, dtype, device):
            return torch.empty(*size, dtype=dtype, device=device)

        def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
            add_ring(counter, "reduce_scatter", input_tensor, group)
            return comm.reduce_scatter(output_tensor, input_tensor, op=op, group=group, async_op=async_op)

    modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if not modules:
        raise ValueError("no FSDP2 module in the model: call fully_shard on it first")
    for m in modules:
        m.set_custom_all_gather(CountingAllGather())
        m.set_custom_reduce_scatter(CountingReduceScatter())
    return len(modules)


# torch.distributed's collectives, by the name the ring formulas know them (``None``: no formula, counted only)
COLLECTIVES = {**{name: op for name, (op, _) in RING.items()}, "reduce_scatter": None,
               "all_gather": None, "barrier": None, "reduce": None, "gather": None, "scatter": None,
               "all_to_all_single": None, "all_gather_object": None, "broadcast_object_list": None,
               "batch_isend_irecv": None, "send": None, "recv": None, "isend": None, "irecv": None}


@dataclass
class Issued:
    """One collective handed to ``torch.distributed``: its name and the bytes this rank sends (ring formula)."""

    op: str
    sent: float | None  # None: a collective without a ring formula here (a barrier, a send, ...)


@contextlib.contextmanager
def count_collectives() -> Iterator[list[Issued]]:
    """Record every collective handed to ``torch.distributed`` inside the block, by this rank, whoever calls it.

    A wider meter than ``counting.counted``: every kind of collective, on every group (a hidden barrier or flag
    all-reduce shows here). A collective calling another inside counts once. Bytes: the
    ring formulas of ``collectives`` for the full tensor (the output of an all-gather, the input of a
    reduce-scatter).
    """
    seen: list[Issued] = []
    depth = [0]
    originals = {name: getattr(dist, name) for name in COLLECTIVES if hasattr(dist, name)}

    def spy(name: str, fn: Callable) -> Callable:
        def counted(*args, **kwargs):
            if depth[0] == 0:
                op, sent = COLLECTIVES[name] or name, None
                if COLLECTIVES[name] is not None:
                    full = [*args, *kwargs.values()][RING[name][1]]  # the position counting.counted reads
                    group = kwargs.get("group")
                    sent = comm.ring_factor(op, dist.get_world_size(group)) * comm.nbytes(full)
                seen.append(Issued(op, sent))
            depth[0] += 1
            try:
                return fn(*args, **kwargs)
            finally:
                depth[0] -= 1
        return counted

    for name, fn in originals.items():
        setattr(dist, name, spy(name, fn))
    try:
        yield seen
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


@dataclass
class BucketTimeline:
    """When ZeroOptimizer's buckets leave, seen from each parameter's gradient as the backward computes it."""

    stage: int
    buckets: int
    names: list[str]                 # parameters in the order their gradients were computed
    reduce_scatters_seen: list[int]  # reduce-scatters already issued when that gradient was computed
    after_backward: int              # reduce-scatters issued by the end of the backward
    full_grad_bytes_after_backward: int  # bytes of the parameters' .grad left after the backward
    slice_grad_bytes: int            # bytes of this rank's averaged gradient slices after the backward


def bucket_timeline(zopt: ZeroOptimizer, model: nn.Module, loss_fn: Callable[[], torch.Tensor]) -> BucketTimeline:
    """One backward of ``loss_fn()`` under ``zopt``: how many buckets had left as each gradient was computed.

    Stage 2 reduce-scatters a bucket from the hooks as soon as it is full, stage 1 only in ``step``. The caller
    then calls ``zopt.step()`` on every rank (it takes part in the same collectives).
    """
    names: list[str] = []
    seen: list[int] = []
    counter = ByteCounter()
    for name, p in model.named_parameters():
        def computed(grad: torch.Tensor, name: str = name) -> None:  # before autograd accumulates it
            names.append(name)
            seen.append(counter.calls.get("reduce_scatter", 0))
        p.register_hook(computed)
    zopt.zero_grad()
    with counted(counter):
        loss_fn().backward()
    return BucketTimeline(
        stage=zopt.stage, buckets=len(zopt.buckets), names=names, reduce_scatters_seen=seen,
        after_backward=counter.calls.get("reduce_scatter", 0),
        full_grad_bytes_after_backward=memory.grad_bytes(model),
        slice_grad_bytes=sum(memory.tensor_bytes(b.piece.grad) for b in zopt.buckets if b.piece.grad is not None))
