"""Tensor parallelism through torch's API: plans, a 2-D mesh, and meters for DTensor (chapter 10).

The real API splits a module by *plan*: ``parallelize_module(block, mesh,
{"attn.qkv": ColwiseParallel(), ...})`` replaces each named submodule's
parameters by DTensors (a local shard plus its placement on the mesh) and
wraps its forward so inputs and outputs are redistributed as the plan says.
DTensor runs its collectives as torch's functional collectives
(``torch.ops._c10d_functional``); ``CountDTensorComm`` counts those with the
ring formulas of ``comm``, as ``comm``'s wrappers do for the hand-written
layers of ``tensor_parallel``.
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, PrepareModuleOutput,
                                               RowwiseParallel, SequenceParallel, parallelize_module)
from torch.utils._python_dispatch import TorchDispatchMode

from course_lib.parallel import collectives as comm
from course_lib.parallel.tensor_parallel.layers import SEQ, HeadMajorAttention, head_major_order
from course_lib.models import TinyTransformer


# ----- plans -------------------------------------------------------------------------------------


def block_plan(sequence_parallel: bool = False, keep_dtensor: bool = True) -> dict:
    """The plan of one ``TransformerBlock`` whose attention is a ``HeadMajorAttention``.

    Colwise/Rowwise pairs give Megatron's TP. With ``sequence_parallel`` the
    LayerNorms run on sequence shards (``SequenceParallel``); before attention
    and MLP the shard is gathered (``PrepareModuleInput``: Shard(1) ->
    Replicate, an all-gather) and the row-parallel outputs are reduce-scattered
    back to shards (``output_layouts=Shard(1)``). ``keep_dtensor``: the
    gathered input stays a DTensor. Turned into a plain tensor
    (``keep_dtensor=False``), its gradient must be whole on every rank when it
    re-enters DTensor: an all-reduce where a reduce-scatter would do.
    """
    if not sequence_parallel:
        return {"attn.qkv": ColwiseParallel(), "attn.proj": RowwiseParallel(),
                "mlp.0": ColwiseParallel(), "mlp.2": RowwiseParallel()}
    gather = dict(input_layouts=(Shard(SEQ),), desired_input_layouts=(Replicate(),),
                  use_local_output=not keep_dtensor)
    return {"ln1": SequenceParallel(), "attn": PrepareModuleInput(**gather),
            "attn.qkv": ColwiseParallel(), "attn.proj": RowwiseParallel(output_layouts=Shard(SEQ)),
            "ln2": SequenceParallel(), "mlp": PrepareModuleInput(**gather),
            "mlp.0": ColwiseParallel(), "mlp.2": RowwiseParallel(output_layouts=Shard(SEQ))}


def to_head_major(model: nn.Module) -> nn.Module:
    """Give every block of ``model`` (a ``TinyTransformer`` or one block) a ``HeadMajorAttention``, in place."""
    blocks = list(model.blocks) if isinstance(model, TinyTransformer) else [model]
    for block in blocks:
        block.attn = HeadMajorAttention.from_attention(block.attn)
    return model


def parallelize(model: TinyTransformer, mesh, sequence_parallel: bool = False) -> TinyTransformer:
    """TP (and SP) over ``mesh["tp"]`` inside every block, then FSDP2 over ``mesh["dp"]``; in place.

    Order matters (as in torchtitan): TP first turns the block weights into
    DTensors on the TP mesh; ``fully_shard`` then shards each rank's TP shard
    again along dimension 0 over the data-parallel ranks. The embedding and
    the head stay whole on every TP rank (sharded over dp only). Under SP the
    embedding's output is cut into sequence shards (no communication: every
    TP rank holds it whole) and gathered again before the head.
    """
    from torch.distributed.fsdp import fully_shard

    to_head_major(model)
    tp_mesh, dp_mesh = mesh["tp"], mesh["dp"]
    if tp_mesh.size() > 1:
        for block in model.blocks:
            parallelize_module(block, tp_mesh, block_plan(sequence_parallel))
        if sequence_parallel:
            parallelize_module(model, tp_mesh, {
                "embed": PrepareModuleOutput(output_layouts=(Replicate(),), desired_output_layouts=(Shard(SEQ),),
                                             use_local_output=True),
                "head": PrepareModuleInput(input_layouts=(Shard(SEQ),), desired_input_layouts=(Replicate(),),
                                           use_local_output=True)})
    if dp_mesh.size() > 1:
        for part in [model.embed, *model.blocks, model.head]:
            fully_shard(part, mesh=dp_mesh)
        fully_shard(model, mesh=dp_mesh)
    return model


def reduce_partial_grads(model: nn.Module) -> int:
    """Sum, once, every gradient that is still a partial sum over ranks; return how many there were.

    Under SP the LayerNorms see one sequence shard per rank: their gradients
    are DTensors placed ``Partial``. FSDP2 sums them in its gradient
    reduction; without FSDP they would reach the optimizer partial, and Adam
    would all-reduce one each time it reads it (the chapter measures how often).
    """
    count = 0
    for p in model.parameters():
        g = p.grad
        if isinstance(g, DTensor) and any(pl.is_partial() for pl in g.placements):
            p.grad = g.redistribute(g.device_mesh, [Replicate() if pl.is_partial() else pl for pl in g.placements])
            count += 1
    return count


def original_layout(name: str, tensor: torch.Tensor, n_heads: int) -> torch.Tensor:
    """A head-major model's ``tensor`` named ``name`` back in ``TinyTransformer``'s row order."""
    if not name.endswith(("attn.qkv.weight", "attn.qkv.bias")):
        return tensor
    order = head_major_order(n_heads, tensor.shape[0] // 3).to(tensor.device)
    return tensor[torch.argsort(order)]


# ----- meters ------------------------------------------------------------------------------------


class CountDTensorComm(TorchDispatchMode):
    """Inside ``with CountDTensorComm(counter, meshes):`` count the collectives DTensor runs, by the ring formulas.

    ``meshes`` name the process groups that may appear (a collective on any
    other group raises). An all-gather's input is this rank's shard; the
    counted size is the gathered tensor's, as in ``comm.all_gather``.
    """

    def __init__(self, counter: comm.ByteCounter, meshes: Iterable):
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


def snapshot(counter: comm.ByteCounter) -> tuple[dict[str, float], dict[str, int]]:
    """A copy of the counter's bytes and calls by collective."""
    return dict(counter.by_op), dict(counter.calls)


def since(before: tuple[dict, dict], counter: comm.ByteCounter) -> tuple[dict[str, float], dict[str, int]]:
    """Bytes and calls by collective added to ``counter`` after ``before = snapshot(counter)``."""
    b, c = before
    return ({k: v - b.get(k, 0.0) for k, v in counter.by_op.items() if v - b.get(k, 0.0)},
            {k: v - c.get(k, 0) for k, v in counter.calls.items() if v - c.get(k, 0)})

