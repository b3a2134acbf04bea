"""Tensor parallelism through torch's API: a block's plan, and a model on a 2-D (dp, tp) mesh (chapter 10).

The real API splits a module by *plan*: ``parallelize_module(block, mesh, {"attn.qkv": ColwiseParallel(), ...})``
replaces each named submodule's parameters by DTensors (a local shard plus its placement on the mesh) and wraps
its forward so inputs and outputs are redistributed as the plan says. The model stores ``attn.qkv`` head by head,
so ``ColwiseParallel``'s contiguous shards are whole heads, as the hand-written ``layers`` cut them.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, PrepareModuleOutput,
                                               RowwiseParallel, SequenceParallel, parallelize_module)

from course_lib.parallel.tensor_parallel.sequence_parallel import SEQ
from course_lib.models import TinyTransformer


def block_plan(sequence_parallel: bool = False, keep_dtensor: bool = True) -> dict:
    """The plan of one ``TransformerBlock``; Colwise/Rowwise pairs give Megatron's TP. Under ``sequence_parallel`` the
    LayerNorms run on sequence shards (``SequenceParallel``); before attention and MLP the shard is all-gathered
    (``PrepareModuleInput``: Shard(1) -> Replicate), and the row-parallel outputs are reduce-scattered back to shards
    (``output_layouts=Shard(1)``). ``keep_dtensor``: the gathered input stays a DTensor; as a plain tensor (``False``)
    its gradient must be whole on every rank as it re-enters DTensor: an all-reduce where a reduce-scatter would do."""
    if not sequence_parallel:
        return {"attn.qkv": ColwiseParallel(), "attn.proj": RowwiseParallel(),
                "mlp.0": ColwiseParallel(), "mlp.2": RowwiseParallel()}
    gather = dict(input_layouts=(Shard(SEQ),), desired_input_layouts=(Replicate(),), use_local_output=not keep_dtensor)
    return {"ln1": SequenceParallel(), "attn": PrepareModuleInput(**gather),
            "attn.qkv": ColwiseParallel(), "attn.proj": RowwiseParallel(output_layouts=Shard(SEQ)),
            "ln2": SequenceParallel(), "mlp": PrepareModuleInput(**gather),
            "mlp.0": ColwiseParallel(), "mlp.2": RowwiseParallel(output_layouts=Shard(SEQ))}


def parallelize(model: TinyTransformer, mesh, sequence_parallel: bool = False) -> TinyTransformer:
    """TP (and SP) over ``mesh["tp"]`` inside every block, then FSDP2 over ``mesh["dp"]``; in place. Order matters (as
    in torchtitan): TP first turns the block weights into DTensors on the TP mesh; ``fully_shard`` then shards each
    rank's TP shard again along dimension 0 over the data-parallel ranks. The embedding and the head stay whole on every
    TP rank (sharded over dp only). Under SP the embedding's output is cut into sequence shards (no communication: every
    TP rank holds it whole) and gathered again before the head."""
    from torch.distributed.fsdp import fully_shard

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
    """Sum, once, every gradient that is still a partial sum over ranks; return how many there were. Under SP the
    LayerNorms see one sequence shard per rank: their gradients are DTensors placed ``Partial``. FSDP2 sums them in its
    gradient reduction; without FSDP they would reach the optimizer partial, and Adam would all-reduce one each time it
    reads it (the chapter measures how often)."""
    count = 0
    for p in model.parameters():
        g = p.grad
        if isinstance(g, DTensor) and any(pl.is_partial() for pl in g.placements):
            p.grad = g.redistribute(g.device_mesh, [Replicate() if pl.is_partial() else pl for pl in g.placements])
            count += 1
    return count
