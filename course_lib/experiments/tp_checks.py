"""Tensor parallelism checked against one process (chapter 10): a block split by hand or by torch's API, and
the model trained on a (dp, tp) mesh.

``run_ops`` checks the operators f, g and the sequence pair on known values.
``run_byhand`` runs ``TPBlock`` (TP, SP, SP with Megatron's regather) and
``run_api`` the same block under ``parallelize_module``, on one micro-batch
with a linear loss; each returns a ``BlockResult``: output, input and
parameter gradients against the single-process block (``block_reference``),
bytes and calls per collective, forward and backward, and the activations
each rank saves; ``run_blocks`` runs them all, in float64 and float32.
``run_mesh`` trains the whole model a few Adam steps on a
``dp x tp`` mesh (SP where tp > 1, FSDP2 over dp) and returns a
``MeshResult`` against single-process Adam (``experiment.reference``).
``run_vocab`` runs the embedding, the LM head and the loss split over the vocabulary
(``vocab_parallel``) against one process: a ``VocabResult``.
"""

from __future__ import annotations

import copy
import dataclasses
import statistics
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from course_lib import memory, timing
from course_lib.experiments.counting import ByteCounter, counted
from course_lib.experiments.run_config import RunConfig, build_model, local_batch, reference
from course_lib.experiments.results import gather_per_rank, max_abs_diff, max_over_ranks, mean_over_ranks
from course_lib.experiments.tp_meters import CountDTensorComm, full_grads, saved_bytes_in, since, snapshot
from course_lib.parallel.tensor_parallel.layers import (SEQ, TPBlock, TPGroup, copy_to_tp, gather_from_sequence,
                                                        reduce_from_tp, reduce_scatter_to_sequence,
                                                        sync_replicated_grads)
from course_lib.parallel.tensor_parallel.torch_api import block_plan, parallelize, reduce_partial_grads
from course_lib.parallel.tensor_parallel.layers import ColumnParallelLinear
from course_lib.parallel.tensor_parallel.vocab_parallel import VocabParallelEmbedding, vocab_parallel_cross_entropy
from course_lib.experiments.zero_meters import count_fsdp_traffic, held_bytes
from course_lib.models import lm_loss


@dataclass
class BlockResult:
    """One transformer block split over ``tp`` ranks (by hand or by the API), against the single-process block.

    Differences are the largest over ranks; bytes and calls are rank 0's, per
    block and micro-batch; ``saved_bytes`` is every rank's (forward of the block).
    """

    method: str                       # "tp", "sp", "sp_regather" (by hand), "api_tp", "api_sp", "api_sp_local"
    tp: int
    dtype: str
    out_diff: float
    input_grad_diff: float
    param_grad_diff: float
    sent_forward: dict[str, float]
    sent_backward: dict[str, float]
    calls_forward: dict[str, int]
    calls_backward: dict[str, int]
    saved_bytes: list[int]
    local_shapes: dict[str, list[int]]
    sync_bytes: float = 0.0           # SP by hand: the replicated gradients' all-reduce


@dataclass
class MeshResult:
    """A few Adam steps of the tiny transformer on a (dp, tp) mesh, against single-process Adam."""

    dp: int
    tp: int
    sequence_parallel: bool
    dtype: str
    losses: list[float]
    max_loss_diff: float
    max_param_diff: float
    held: list[dict[str, int]]          # per rank: params, grads, optimizer bytes
    saved_bytes: list[int]              # per rank: what the blocks save in one forward
    tp_sent_per_step: dict[str, float]  # rank 0, by collective: DTensor's (TP) collectives
    dp_sent_per_step: dict[str, float]  # rank 0, by collective: FSDP2's
    tp_calls_per_step: dict[str, float]
    step_s: float
    param_placements: dict[str, str] = field(default_factory=dict)
    partial_grads: int = 0              # gradients still partial sums before the optimizer (reduced once)
    lazy_optimizer_calls: dict[str, int] = field(default_factory=dict)  # collectives of a step on partial ones


@dataclass
class VocabResult:
    """The embedding, head and loss split over the vocabulary on ``tp`` ranks, against one process."""

    tp: int
    dtype: str
    loss: float
    loss_diff: float                  # largest over ranks
    grad_diff: dict[str, float]       # by parameter, the largest over ranks
    sent: dict[str, float]            # rank 0's bytes by part: embedding, head, loss
    calls: dict[str, dict[str, int]]  # rank 0's calls by part


BYHAND = {"tp": (False, False), "sp": (True, False), "sp_regather": (True, True)}  # (sequence parallel, regather)


def block_inputs(cfg: RunConfig, device: torch.device):
    """The first block of the model, an input activation and the weights of a linear loss, the same on every rank."""
    block = build_model(cfg, device).blocks[0]
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    shape = (cfg.batch, cfg.seq_len, cfg.d_model)
    x = torch.randn(shape, generator=gen, dtype=torch.float64).to(device, getattr(torch, cfg.dtype))
    w = torch.randn(shape, generator=gen, dtype=torch.float64).to(device, getattr(torch, cfg.dtype))
    return block, x, w


def block_reference(block, x, w) -> tuple[torch.Tensor, torch.Tensor, dict, int]:
    """The single-process block: output, input gradient, parameter gradients, saved bytes."""
    ref, xr, holder = copy.deepcopy(block), x.clone().requires_grad_(), []
    saved = memory.saved_activation_bytes(lambda: holder.append(ref(xr)), exclude=list(ref.parameters()))
    (holder[0] * w).sum().backward()
    return holder[0].detach(), xr.grad, {n: p.grad for n, p in ref.named_parameters()}, saved


def _shard(t: torch.Tensor, sequence_parallel: bool, tp: TPGroup) -> torch.Tensor:
    return t.chunk(tp.size, dim=SEQ)[tp.rank] if sequence_parallel else t


def _checked(method: str, size: int, sp: bool, tp: TPGroup, out: torch.Tensor, xs: torch.Tensor,
             grads: dict[str, torch.Tensor], ref, counts: tuple, saved: int, local: dict, device,
             **extra) -> BlockResult:
    """One split block's run (output, input shard, full gradients, ``(forward, backward)`` counts) against ``ref``."""
    ref_out, ref_gx, ref_grads, _ = ref
    (sent_f, calls_f), (sent_b, calls_b) = counts
    return BlockResult(
        method=method, tp=size, dtype=str(xs.dtype).removeprefix("torch."),
        out_diff=max_over_ranks(max_abs_diff(out, _shard(ref_out, sp, tp)), device),
        input_grad_diff=max_over_ranks(max_abs_diff(xs.grad, _shard(ref_gx, sp, tp)), device),
        param_grad_diff=max_over_ranks(max(max_abs_diff(grads[n], ref_grads[n]) for n in ref_grads), device),
        sent_forward=sent_f, sent_backward=sent_b, calls_forward=calls_f, calls_backward=calls_b,
        saved_bytes=gather_per_rank(saved), local_shapes=local, **extra)


def run_byhand(method: str, block, x, w, ref, tp: TPGroup, device) -> BlockResult:
    """``TPBlock`` of ``method`` on the group ``tp``, checked against ``ref`` (from ``block_reference``)."""
    sp, regather = BYHAND[method]
    tpb = TPBlock(block, tp, sequence_parallel=sp, regather=regather)
    xs = _shard(x, sp, tp).clone().requires_grad_()
    counter, sync, holder = ByteCounter(), ByteCounter(), []
    with counted(counter, tp.group):
        saved = memory.saved_activation_bytes(lambda: holder.append(tpb(xs)), exclude=list(tpb.parameters()))
        fwd = snapshot(counter)
        (holder[0] * _shard(w, sp, tp)).sum().backward()
        bwd = since(fwd, counter)
    if sp:  # the LayerNorms and row biases saw only this rank's rows
        with counted(sync, tp.group):
            sync_replicated_grads(tpb, tp)
    return _checked(method, tp.size, sp, tp, holder[0], xs, full_grads(tpb), ref, (fwd, bwd), saved,
                    {n: list(p.shape) for n, p in tpb.named_parameters()}, device, sync_bytes=sync.bytes)


def run_api(method: str, block, x, w, ref, mesh, device) -> BlockResult:
    """The block under ``parallelize_module`` on the 1-D ``mesh``, checked against ``ref``.

    ``method``: ``api_tp``, ``api_sp``, or ``api_sp_local`` (SP with plain tensors between the regions).
    """
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import parallelize_module

    sp = method != "api_tp"
    hm = copy.deepcopy(block)
    parallelize_module(hm, mesh, block_plan(sp, keep_dtensor=method != "api_sp_local"))
    tp = TPGroup(mesh.get_group())
    xs = _shard(x, sp, tp).clone().requires_grad_()
    counter, holder = ByteCounter(), []
    with CountDTensorComm(counter, [mesh]):
        saved = saved_bytes_in([hm], lambda: holder.append(hm(xs)))
        fwd = snapshot(counter)
        (holder[0] * _shard(w, sp, tp)).sum().backward()
        bwd = since(fwd, counter)
    grads = {n: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
             for n, p in hm.named_parameters()}  # full_tensor: a collective outside the counter
    local = {n: list((p.to_local() if isinstance(p, DTensor) else p).shape) for n, p in hm.named_parameters()}
    return _checked(method, mesh.size(), sp, tp, holder[0], xs, grads, ref, (fwd, bwd), saved, local, device)


def run_ops(device: torch.device) -> dict:
    """f, g and the sequence pair on tensors whose sums are known: rank r holds the value r + 1."""
    tp, world, rank = TPGroup(), dist.get_world_size(), dist.get_rank()

    def ends(y: torch.Tensor, g: torch.Tensor) -> dict:
        return {"forward": y[0, 0, 0].item(), "backward": g[0, 0, 0].item()}

    checks = {  # name: (operator, the gradient sent back, what to read from its output and the input's gradient)
        "f": (copy_to_tp, rank + 1.0, ends),
        "g": (reduce_from_tp, rank + 1.0, ends),
        # (2, world * world, 3): the rank's value in its own rows
        "gather_seq": (gather_from_sequence, 1.0, lambda y, g: {
            "shape": list(y.shape), "rows_of_rank": [y[0, r * world, 0].item() for r in range(world)],
            "backward": g[0, 0, 0].item()}),
        # (2, 1, 3): the sum, this rank's row
        "reduce_scatter_seq": (reduce_scatter_to_sequence, rank + 1.0, lambda y, g: {
            "shape": list(y.shape), "forward": y[0, 0, 0].item(),
            "backward_rows": [g[0, r, 0].item() for r in range(world)]}),
    }
    out = {}
    for name, (op, grad, read) in checks.items():
        x = torch.full((2, world, 3), rank + 1.0, device=device, requires_grad=True)
        y = op(x, tp)
        y.backward(torch.full_like(y, grad))
        out[name] = read(y, x.grad)
    out["sum_of_values"] = world * (world + 1) / 2  # 1 + 2 + ... + world
    return out


_PAIRS: list = []  # the process group of this rank's pair, made once per launch


def tp_groups(world: int) -> dict[int, TPGroup]:
    """Tensor-parallel groups by size: pairs of ranks (0, 1), (2, 3), ... and the world."""
    sizes = sorted({s for s in (2, world) if s > 1 and world % s == 0})
    if 2 in sizes and world > 2 and not _PAIRS:
        _PAIRS.append(dist.new_subgroups(2)[0])  # every rank joins its pair
    return {s: TPGroup(_PAIRS[0] if s < world else None) for s in sizes}


def run_blocks(cfg: RunConfig, with_api: bool, device) -> tuple[list[BlockResult], dict[str, int]]:
    """Every ``BYHAND`` method (and with ``with_api`` every API one) in float64 and float32, on groups of 2 and of
    the whole world; and what the single-process block saves, per dtype."""
    world = dist.get_world_size()
    groups = tp_groups(world)
    sizes = sorted(groups)
    mesh = init_device_mesh(device.type, (world,)) if with_api else None
    results, ref_saved = [], {}
    for dtype in ("float64", "float32"):
        block, x, w = block_inputs(dataclasses.replace(cfg, dtype=dtype), device)
        ref = block_reference(block, x, w)
        ref_saved[dtype] = ref[3]
        for size in sizes:
            results += [run_byhand(m, block, x, w, ref, groups[size], device) for m in BYHAND]
        if with_api:
            results += [run_api(m, block, x, w, ref, mesh, device) for m in ("api_tp", "api_sp", "api_sp_local")]
    return results, ref_saved


def reference_training(cfg: RunConfig) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Single-process Adam on the whole batch (chapter 09's reference): losses and final parameters by name."""
    losses, params = reference(cfg)
    return losses, dict(zip((n for n, _ in build_model(cfg).named_parameters()), params))


def run_mesh(cfg: RunConfig, dp: int, tp: int, device, ref: tuple[list[float], dict]) -> MeshResult:
    """Train on a dp x tp mesh (SP when tp > 1, FSDP2 when dp > 1); compare with the reference (rank 0's)."""
    from torch.distributed.tensor import DTensor

    mesh = init_device_mesh(device.type, (dp, tp), mesh_dim_names=("dp", "tp"))
    sp = tp > 1
    model = parallelize(build_model(cfg, device), mesh, sequence_parallel=sp)
    tp_counter, dp_counter = ByteCounter(), ByteCounter()
    if dp > 1:
        count_fsdp_traffic(model, dp_counter)
    opt = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    dp_rank, losses, times, saved, partial = mesh["dp"].get_local_rank(), [], [], 0, 0
    for step in range(cfg.steps):
        x, y = local_batch(cfg, step, dp_rank, dp, device)  # the TP ranks of one dp group read the same rows
        holder: list = []

        def one_step(step: int = step) -> None:
            nonlocal saved, partial
            with CountDTensorComm(tp_counter, [mesh]):
                opt.zero_grad()  # here, not after the step: the gradients are part of what a rank holds
                if step == 0:
                    saved = saved_bytes_in(model.blocks, lambda: holder.append(lm_loss(model(x), y)))
                else:
                    holder.append(lm_loss(model(x), y))
                holder[0].backward()
                partial = reduce_partial_grads(model)  # the LayerNorms' gradients under SP without FSDP
                opt.step()
        dist.barrier()  # every rank starts the step together
        times.append(timing.time_s(one_step, device))
        losses.append(mean_over_ranks(holder[0].item(), device))  # TP ranks agree; the mean is over dp
    # a copy: a replicated DTensor's full_tensor() is its local tensor, which the optimizer updates in place
    full = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().cpu().clone()
            for n, p in model.named_parameters()}
    lazy = ByteCounter()
    if partial:  # once more, the optimizer reading the partial gradients itself (after the comparison)
        opt.zero_grad()
        lm_loss(model(x), y).backward()
        with CountDTensorComm(lazy, [mesh]):
            opt.step()
    ref_losses, ref_params = ref
    placements = {n: str(p.placements) for n, p in model.named_parameters()
                  if n.startswith("blocks.0.") and isinstance(p, DTensor)}
    return MeshResult(
        dp=dp, tp=tp, sequence_parallel=sp, dtype=cfg.dtype, losses=losses,
        max_loss_diff=max(abs(a - b) for a, b in zip(losses, ref_losses)),
        max_param_diff=max(max_abs_diff(full[n], ref_params[n]) for n in ref_params),
        held=gather_per_rank(held_bytes(model, opt)), saved_bytes=gather_per_rank(saved),
        tp_sent_per_step={k: v / cfg.steps for k, v in tp_counter.by_op.items()},
        dp_sent_per_step={k: v / cfg.steps for k, v in dp_counter.by_op.items()},
        tp_calls_per_step={k: v / cfg.steps for k, v in tp_counter.calls.items()},
        partial_grads=partial, lazy_optimizer_calls=dict(lazy.calls),
        step_s=statistics.median(times[1:] if len(times) > 1 else times), param_placements=placements)


def run_vocab(cfg: RunConfig, tp: TPGroup, device) -> VocabResult:
    """The model's embedding and head with no blocks between, ids -> loss, split over the vocabulary on ``tp``.

    One process: ``F.cross_entropy`` of the whole logits. Split: ``VocabParallelEmbedding``, the head's linear as a
    ``ColumnParallelLinear`` (each rank its slice of the logits) and ``vocab_parallel_cross_entropy``.
    """
    import torch.nn.functional as F

    model = build_model(cfg, device)
    x, y = local_batch(cfg, 0, 0, 1, device)
    emb, head = model.embed, model.head
    pos = torch.arange(x.shape[1], device=device)
    ref_loss = F.cross_entropy(head(emb(x)).flatten(0, 1), y.flatten())
    ref_loss.backward()
    first = tp.rank * cfg.vocab // tp.size
    rows = slice(first, first + cfg.vocab // tp.size)
    ref = {"embed.tok": emb.tok.weight.grad[rows], "embed.pos": emb.pos.weight.grad, "head.ln": head.ln.weight.grad,
           "head.out.weight": head.out.weight.grad[rows], "head.out.bias": head.out.bias.grad[rows]}

    split_emb, split_out = VocabParallelEmbedding(emb.tok, tp), ColumnParallelLinear(head.out, tp)
    pos_w, ln = copy.deepcopy(emb.pos), copy.deepcopy(head.ln)
    counter = ByteCounter()
    sent, calls, before = {}, {}, snapshot(counter)

    def part(name: str) -> None:
        nonlocal before
        sent[name], calls[name] = since(before, counter)
        sent[name] = sum(sent[name].values())
        before = snapshot(counter)

    with counted(counter, tp.group):
        h = split_emb(x) + pos_w(pos)
        part("embedding")
        logits = split_out(ln(h))                                  # (B, T, V/t): this rank's columns
        loss = vocab_parallel_cross_entropy(logits, y, tp).mean()
        part("loss")
        loss.backward()
        part("head")                                               # f's all-reduce of the head input's gradient
    got = {"embed.tok": split_emb.weight.grad, "embed.pos": pos_w.weight.grad, "head.ln": ln.weight.grad,
           "head.out.weight": split_out.weight.grad, "head.out.bias": split_out.bias.grad}
    return VocabResult(
        tp=tp.size, dtype=cfg.dtype, loss=loss.item(),
        loss_diff=max_over_ranks(abs(loss.item() - ref_loss.item()), device),
        grad_diff={n: max_over_ranks(max_abs_diff(got[n], ref[n]), device) for n in ref},
        sent=sent, calls=calls)
