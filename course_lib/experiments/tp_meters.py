"""Meters for chapter 10's tensor-parallel runs: bytes DTensor sends, bytes autograd saves, whole gradients.

The teaching code (``course_lib.parallel.tensor_parallel``) computes; this measures it from outside.
DTensor runs its collectives as torch's functional collectives (``torch.ops._c10d_functional``);
``CountDTensorComm`` counts those with the ring formulas of ``collectives``, as ``counting.counted`` counts
the hand-written layers' ``torch.distributed`` calls. ``saved_bytes_in`` is ``memory.saved_activation_bytes`` for
DTensors and FSDP2. ``full_grads`` gathers a hand-split module's gradients into the single-process shapes.
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode  # no public API counts the ops DTensor dispatches

from course_lib.experiments.counting import ByteCounter
from course_lib.parallel import collectives as comm
from course_lib.parallel.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear


class CountDTensorComm(TorchDispatchMode):
    """Inside ``with CountDTensorComm(counter, meshes):`` count the collectives DTensor runs, by the ring formulas.

    ``meshes`` name the process groups that may appear (a collective on any
    other group raises). An all-gather's input is this rank's shard; the
    counted size is the gathered tensor's, as ``counting.counted`` counts ``comm.all_gather``.
    """

    def __init__(self, counter: ByteCounter, meshes: Iterable):
        super().__init__()
        self.counter = counter
        self.sizes = {m.get_group(d).group_name: m.size(d) for m in meshes for d in range(m.ndim)}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # let DTensor turn itself into local ops and collectives first
        funcol = torch.ops._c10d_functional
        packet = func._overloadpacket
        if packet in (funcol.all_reduce, funcol.all_gather_into_tensor, funcol.reduce_scatter_tensor):
            group = args[-1]
            if group not in self.sizes:
                raise RuntimeError(f"a DTensor collective on process group {group!r}, not on the meshes counted")
            n, size = self.sizes[group], comm.nbytes(args[0])
            if packet is funcol.all_reduce:
                self.counter.add("all_reduce", comm.ring_factor("all_reduce", n) * size)
            elif packet is funcol.all_gather_into_tensor:
                self.counter.add("all_gather", comm.ring_factor("all_gather", n) * n * size)
            else:
                self.counter.add("reduce_scatter", comm.ring_factor("reduce_scatter", n) * size)
        return func(*args, **(kwargs or {}))


def _storage(t: torch.Tensor) -> tuple[tuple[str, int], int]:
    """(key, bytes) of the storage this rank holds for ``t``: a DTensor's local shard, else ``t``'s own."""
    if isinstance(t, DTensor):
        with torch.no_grad():
            t = t.to_local()
    return (str(t.device), t.untyped_storage().data_ptr()), t.untyped_storage().nbytes()


def saved_bytes_in(modules: Iterable[nn.Module], fn: Callable[[], object]) -> int:
    """Bytes autograd saves while one of ``modules`` runs its forward inside ``fn()``, parameters left out.

    ``memory.saved_activation_bytes`` for DTensors and FSDP2: a DTensor counts
    its local shard, and the parameters excluded are those registered on the
    module *while it runs* (FSDP2 registers the gathered ones then).
    """
    state: dict = {"inside": 0, "params": set()}
    seen: dict[tuple[str, int], int] = {}
    keep: list[torch.Tensor] = []  # no storage address is reused while we count

    def enter(module, args):
        state["inside"] += 1
        state["params"] = {_storage(p)[0] for p in module.parameters()}

    def leave(module, args, out):
        state["inside"] -= 1

    def pack(t: torch.Tensor) -> torch.Tensor:
        if state["inside"]:
            key, nbytes = _storage(t)
            if key not in state["params"]:
                seen[key] = nbytes
                keep.append(t)
        return t

    mods = list(modules)
    handles = [m.register_forward_pre_hook(enter) for m in mods] + [m.register_forward_hook(leave) for m in mods]
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            fn()
    finally:
        for h in handles:
            h.remove()
    return sum(seen.values())


def snapshot(counter: ByteCounter) -> tuple[dict[str, float], dict[str, int]]:
    """A copy of the counter's bytes and calls by collective."""
    return dict(counter.by_op), dict(counter.calls)


def since(before: tuple[dict, dict], counter: ByteCounter) -> tuple[dict[str, float], dict[str, int]]:
    """Bytes and calls by collective added to ``counter`` after ``before = snapshot(counter)``."""
    b, c = before
    return ({k: v - b.get(k, 0.0) for k, v in counter.by_op.items() if v - b.get(k, 0.0)},
            {k: v - c.get(k, 0) for k, v in counter.calls.items() if v - c.get(k, 0)})


def full_grads(module: nn.Module) -> dict[str, torch.Tensor]:
    """Every gradient of a hand-split module as the single-process layer has it (a collective, uncounted).

    Column-parallel shards are gathered along dimension 0 (rank r held block r of the rows), row-parallel
    weights along dimension 1; the rest is whole.
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
        out[name] = torch.cat(parts, dim=dim)
    return out
