"""Chapter 12's context-parallel experiment: ring attention over the launch's ranks, against one process.

    torchrun --nproc-per-node 4 -m course_lib.workers.cp_compare --tasks exact,saved,train,api,overlap

Tasks (``--tasks``, in this order, in one launch):

- ``exact``: for each layout (plain, zigzag), in float64: ring attention of
  random ``q, k, v`` (output and the three gradients, every rank's part
  gathered) and the tiny transformer's loss and parameter gradients (summed
  over the ranks), against one process; the query-key pairs and the score
  elements each rank computed; in float32, the bytes each rank sends per layer
  (forward, backward);
- ``saved``: the bytes one block saves for the backward on each rank, against
  the same code in one process and the course's block (naive and fused attention);
- ``train``: ``--steps`` Adam steps of the whole model in float32 (zigzag),
  losses against one process, seconds per step, bytes sent per step, the peak and the states per rank;
  ``--dp`` data-parallel groups of rings, ``--zero-stage`` 0-2 over all the ranks;
- ``api``: torch's ``context_parallel`` on the same model with fused
  attention: losses and gradients against one process, or the error it raises;
- ``overlap``: ring attention alone at the model's sizes (float32, zigzag),
  timed: per pass, the seconds spent computing tiles and waiting for hops,
  forward and backward, and a hop alone (sent and waited for, nothing computed).

Every rank builds the same model and batch from the same seed; the
single-process reference runs on every rank (it is small).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F

from course_lib import memory, timing
from course_lib.distributed import context_parallel as cp
from course_lib.distributed import launch
from course_lib.distributed.experiment import RunConfig, build_model, global_batch, local_batch, reference
from course_lib.distributed.results import WorkerResult, gather_per_rank, max_abs_diff
from course_lib.distributed.zero import ZeroOptimizer, held_bytes
from course_lib.env import seed_everything
from course_lib.models import TransformerBlock, lm_loss

TASKS = ("exact", "saved", "train", "api", "overlap")
OVERLAP_REPEATS = 10  # timed passes per rank: the median of ten steadies a busy machine's noise


@dataclass
class LayoutResult(WorkerResult):
    """One layout's checks; lists hold one entry per rank."""

    layout: str
    attn_out_diff: float         # float64, max |ring - one process| of the output
    attn_grad_diff: float        # ... of dq, dk, dv
    loss_diff: float             # float64 model: the loss
    grad_diff: float             # ... every parameter's gradient, summed over ranks
    pairs: list[int]             # query-key pairs each rank's forward computed (one attention)
    scores: list[int]            # score elements each rank's forward computed (its tiles), per sequence and head
    blocks: list[int]            # key/value blocks each rank computed (masked-out blocks skipped)
    sent_forward: float          # bytes rank 0 sent per layer, float32 model
    sent_backward: float
    calls: dict[str, int]        # messages rank 0 sent per layer


@dataclass
class CPReport(WorkerResult):
    world: int
    seq_len: int
    layouts: list[LayoutResult] = field(default_factory=list)
    saved: dict[str, list[int]] = field(default_factory=dict)  # per rank: cp; one value: one_process, naive, fused
    train: dict = field(default_factory=dict)
    api: dict = field(default_factory=dict)
    overlap: dict = field(default_factory=dict)

    def layout(self, name: str) -> LayoutResult:
        return next(r for r in self.layouts if r.layout == name)


def _gathered(t: torch.Tensor, layout: str, dim: int) -> torch.Tensor:
    return cp.unshard([p.cpu() for p in gather_per_rank(t.detach().cpu())], layout, dim)


def _summed_diffs(model: torch.nn.Module, loss: torch.Tensor, one: torch.nn.Module,
                  ref_loss: torch.Tensor) -> tuple[float, float]:
    """The ranks' loss shares and gradients summed, against one process's: (loss difference, gradient difference)."""
    cp.sum_grads(model)
    total = loss.detach().clone()
    dist.all_reduce(total)
    grads = max_abs_diff([p.grad for p in model.parameters()], [r.grad for r in one.parameters()])
    return abs(total.item() - ref_loss.item()), grads


def exact_task(cfg: RunConfig, layout: str, device: torch.device) -> LayoutResult:
    rank, world = dist.get_rank(), dist.get_world_size()
    T, C, H = cfg.seq_len, cfg.d_model, cfg.n_heads
    # attention alone, float64
    g = torch.Generator().manual_seed(cfg.seed)
    q, k, v, grad_out = (torch.randn(cfg.batch, H, T, C // H, generator=g, dtype=torch.float64)  # host
                         for _ in range(4))
    ref_q, ref_k, ref_v = (t.clone().requires_grad_() for t in (q, k, v))
    ref = F.scaled_dot_product_attention(ref_q, ref_k, ref_v, is_causal=True)
    ref.backward(grad_out)
    ring = cp.Ring.of(T, layout)
    local = [cp.shard(t, world, rank, layout, dim=2).to(device).requires_grad_() for t in (q, k, v)]
    out = cp.ring_attention(*local, ring)
    out.backward(cp.shard(grad_out, world, rank, layout, dim=2).to(device))
    attn_out = max_abs_diff(_gathered(out, layout, 2), ref)
    attn_grad = max_abs_diff([_gathered(t.grad, layout, 2) for t in local], [ref_q.grad, ref_k.grad, ref_v.grad])
    pairs, scores = gather_per_rank(ring.pairs[0]), gather_per_rank(ring.scores[0])
    blocks = gather_per_rank(sum(int(cp.positions(T, world, rank, layout).max() >= cp.positions(T, world, j, layout).min())
                                 for j in range(world)))
    # the whole model, float64
    c64 = dataclasses.replace(cfg, dtype="float64")
    x, y = global_batch(c64, 0)
    one = build_model(c64)
    ref_loss = lm_loss(one(x), y)
    ref_loss.backward()
    model = build_model(c64, device)
    loss = cp.cp_loss(model, x.to(device), y.to(device), cp.Ring.of(T, layout))
    loss.backward()
    loss_diff, grad_diff = _summed_diffs(model, loss, one, ref_loss)
    # bytes per layer, float32
    model32 = build_model(cfg, device)
    ring32 = cp.Ring.of(T, layout)
    cp.cp_loss(model32, x.to(device), y.to(device), ring32).backward()
    sent = cp.sent_per_pass(ring32.counter)
    return LayoutResult(layout, attn_out, attn_grad, loss_diff, grad_diff, pairs, scores,
                        blocks, sent["forward"] / cfg.n_layers, sent["backward"] / cfg.n_layers,
                        {op: n // cfg.n_layers for op, n in ring32.counter.calls.items()})


def saved_task(cfg: RunConfig, device: torch.device, dp: int = 1) -> dict[str, list[int]]:
    """Bytes one block saves: on each rank under CP, and in one process (same code; the course's block). With
    ``dp`` data-parallel groups (``cp.data_parallel_ring``), a group's ``batch / dp`` sequences around its ring."""
    ring = cp.data_parallel_ring(cfg.seq_len, dp)
    rank, world = ring.rank, ring.world
    block = build_model(cfg, device).blocks[0]
    params = list(block.parameters())
    x = torch.randn(cfg.batch // dp, cfg.seq_len, cfg.d_model, device=device, requires_grad=True)

    local = cp.shard(x.detach(), world, rank, "zigzag").requires_grad_()
    # the block's input counts: in a model it is the previous block's output, kept for this block's backward
    per_rank = gather_per_rank(memory.saved_activation_bytes(lambda: cp.block_forward(block, local, ring), exclude=params))
    one = memory.saved_activation_bytes(lambda: cp.block_forward(block, x, cp.Ring(cfg.seq_len)), exclude=params)
    naive = memory.saved_activation_bytes(lambda: block(x), exclude=params)
    fused = TransformerBlock(cfg.d_model, cfg.n_heads, cfg.seq_len, fused=True).to(device)
    fused.load_state_dict(block.state_dict())
    fused_bytes = memory.saved_activation_bytes(lambda: fused(x), exclude=list(fused.parameters()))
    return {"cp": per_rank, "one_process": [one], "naive": [naive], "fused": [fused_bytes]}


def train_task(cfg: RunConfig, device: torch.device, dp: int = 1, zero_stage: int = 0) -> dict:
    """Adam steps of the whole model with CP (zigzag) against one process: losses, time, bytes, peak.

    The ranks form ``dp`` data-parallel groups of ``c = world / dp`` consecutive ranks; each group runs its rows
    of the batch around its own ring. Every rank keeps the whole model, so the gradients are summed over all the
    ranks: by an all-reduce (``zero_stage`` 0), or by ``ZeroOptimizer`` (stages 1, 2: Adam's state, and at
    stage 2 the gradients, sharded over all the ranks). ZeroOptimizer averages over its ranks, as DDP does, and
    a rank's loss is its share of a sum: the backward runs on the share times the world, whose mean is the sum.

    The peak is measured as ``dp_methods.measure_step`` measures it: what the rank holds at the start of the step (its
    states and its shard of the batch, counted tensor by tensor) plus the highest transient above that (from
    step 1 on, when Adam's state exists; the lower of the measured steps kept). Gradients are zeroed, not
    freed, so that nothing allocated before the CPU profiler started is freed inside its window.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    if zero_stage not in (0, 1, 2):
        raise ValueError(f"the train task runs ZeRO stages 0-2, got {zero_stage}")
    ring = cp.data_parallel_ring(cfg.seq_len, dp)
    c = ring.world
    ref_losses, _ = reference(cfg)  # one process, the whole batch: what the ring must equal
    model = build_model(cfg, device)
    if zero_stage:
        zopt = ZeroOptimizer(model, torch.optim.Adam, zero_stage, bucket_cap_mb=cfg.bucket_mb, lr=cfg.lr)
        zero_grad, update, held = zopt.zero_grad, zopt.step, zopt.state_bytes
    else:
        opt = torch.optim.Adam(model.parameters(), lr=cfg.lr)

        def zero_grad() -> None:
            opt.zero_grad(set_to_none=False)

        def update() -> None:
            cp.sum_grads(model)
            opt.step()

        def held() -> dict[str, int]:  # the states this rank holds, as chapter 01 counts them
            return held_bytes(model, opt)
    scale = world if zero_stage else 1
    losses, seconds, peak = [], [], None
    for step in range(cfg.steps):
        x, y = local_batch(cfg, step, rank // c, dp)  # this data-parallel group's rows
        x, y = (cp.shard(t, c, ring.rank, ring.layout).to(device) for t in (x, y))  # this rank's positions
        zero_grad()
        parts: list[torch.Tensor] = []

        def cp_step() -> None:
            part = cp.cp_local_loss(model, x, y, ring, cfg.batch * cfg.seq_len)
            (part * scale).backward()
            update()
            parts.append(part.detach())

        def timed_step(step: int = step) -> None:
            nonlocal peak
            if step >= 1:  # measured (Adam's state exists from step 1 on)
                resident = sum(held().values()) + memory.tensor_bytes(x) + memory.tensor_bytes(y)
                p = resident + memory.peak_bytes(cp_step, device)
                peak = p if peak is None else min(peak, p)
            else:
                cp_step()
        dist.barrier()
        seconds.append(timing.time_s(timed_step, device))
        total = parts[0].clone()
        dist.all_reduce(total)
        losses.append(total.item())
    return {"ref_losses": ref_losses, "losses": losses, "seconds": gather_per_rank(seconds),
            "sent_per_step": ring.counter.bytes / cfg.steps, "peak": gather_per_rank(peak),
            "held": gather_per_rank(held()), "dp": dp, "zero_stage": zero_stage, "device": device.type,
            "batch_bytes": gather_per_rank(memory.tensor_bytes(x) + memory.tensor_bytes(y))}


def api_task(cfg: RunConfig, device: torch.device) -> dict:
    """torch's ``context_parallel`` on the model with fused attention: losses and gradients, or its error."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel

    world = dist.get_world_size()
    x, y = global_batch(cfg, 0)
    fcfg = dict(vocab=cfg.vocab, d_model=cfg.d_model, n_heads=cfg.n_heads, n_layers=cfg.n_layers, max_len=cfg.seq_len)
    seed_everything(cfg.seed)
    one = build_model(cfg)
    ref = lm_loss(one(x), y)
    ref.backward()
    model = build_model(cfg, device)
    for blk in model.blocks:
        blk.attn.fused = True  # F.scaled_dot_product_attention: what context_parallel replaces
    mesh = init_device_mesh(device.type, (world,))
    idx, tgt = x.to(device), y.to(device)
    pos = torch.arange(cfg.seq_len, device=device).expand_as(idx).contiguous()
    try:
        with context_parallel(mesh, buffers=[idx, tgt, pos], buffer_seq_dims=[1, 1, 1]):
            h = model.embed.tok(idx) + model.embed.pos(pos)  # pos: this rank's global positions
            logits = model.head(model.blocks(h))
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1), reduction="sum") / y.numel()
            loss.backward()
    except Exception as exc:  # noqa: BLE001 - the point is to report what this torch does on this backend
        return {"ran": False, "error": f"{type(exc).__name__}: {str(exc).splitlines()[0]}", "backend": dist.get_backend()}
    loss_diff, grad_diff = _summed_diffs(model, loss, one, ref)
    return {"ran": True, "loss_diff": loss_diff, "grad_diff": grad_diff, "backend": dist.get_backend(),
            "positions_rank0": pos[0].tolist()}


def overlap_task(cfg: RunConfig, device: torch.device, repeats: int = OVERLAP_REPEATS) -> dict:
    """Ring attention alone (float32, zigzag, ``batch x heads x T/c x d``), timed ``repeats`` times after one untimed
    pass: per pass and rank, the seconds computing tiles and waiting for hops (``cp.HopTimes`` summed over the
    steps), forward and backward; and a K, V hop and a dK, dV hop alone, sent and waited for with nothing to compute.
    Lists: one per rank, one value per repeat."""
    world = dist.get_world_size()
    T, C, H = cfg.seq_len, cfg.d_model, cfg.n_heads
    g = torch.Generator().manual_seed(cfg.seed + dist.get_rank())
    q, k, v, grad = (torch.randn(cfg.batch, H, T // world, C // H, generator=g).to(device) for _ in range(4))
    ring = cp.Ring.of(T)

    def one_pass() -> None:
        mine = [t.clone().requires_grad_() for t in (q, k, v)]
        cp.ring_attention(*mine, ring).backward(grad)
    one_pass()  # untimed: the tiles and the first messages' set-up
    ring.timed = True
    for _ in range(repeats):
        dist.barrier()  # every rank starts the pass together: a wait is then the hop's, not a late neighbour's
        one_pass()
    alone: dict[str, list[float]] = {"kv": [], "dkv": []}
    messages = {"kv": (torch.stack([k, v]), cp.KV_TAG), "dkv": (torch.zeros((2, *k.shape), device=device), cp.DKV_TAG)}
    for _ in range(repeats if world > 1 else 0):  # one rank has no neighbour to send to
        for name, (tensor, tag) in messages.items():
            def hop_alone(tensor: torch.Tensor = tensor, name: str = name, tag: int = tag) -> None:
                hop, _ = ring.pass_on([tensor], f"alone_{name}", tag)
                hop.wait()  # on a GPU: the stream waits for NCCL's copy, and the end event comes after it
            dist.barrier()
            alone[name].append(timing.time_s(hop_alone, device))
    out: dict = {f"{d}_{kind}": gather_per_rank([sum(getattr(t, kind)) for t in ring.times[d]])
                 for d in ("forward", "backward") for kind in ("compute", "wait")}
    out |= {f"alone_{name}": gather_per_rank(ts) for name, ts in alone.items()}
    out["hops"] = {"forward": world - 1, "backward_kv": world - 1, "backward_dkv": world if world > 1 else 0}
    return out


def _check(a: argparse.Namespace) -> None:
    """Refuse ``--dp`` before any rank waits for another (from the launch's ``WORLD_SIZE``)."""
    launch.pick(a.tasks, TASKS)
    world, batch = int(os.environ.get("WORLD_SIZE", "1")), RunConfig.from_json(a.cfg).batch
    if a.dp < 1 or world % a.dp or batch % a.dp:
        raise ValueError(f"--dp {a.dp} must divide the {world} ranks and the batch of {batch} sequences")


def run_tasks(a: argparse.Namespace, rank: int, world: int, device: torch.device) -> CPReport:
    """Every task of ``a.tasks``, in order: one ``CPReport``."""
    cfg, tasks = RunConfig.from_json(a.cfg), launch.pick(a.tasks, TASKS)
    # a clear error on every rank before any message: the saved and train tasks' rings have world/dp ranks
    for ring_ranks in {world // a.dp if t in ("saved", "train") else world for t in tasks}:
        cp.check_layout(cfg.seq_len, ring_ranks)
    seed_everything(cfg.seed)
    report = CPReport(world=world, seq_len=cfg.seq_len)
    if "exact" in tasks:
        report.layouts = [exact_task(cfg, layout, device) for layout in cp.LAYOUTS]
    if "saved" in tasks:
        report.saved = saved_task(cfg, device, a.dp)
    if "train" in tasks:
        report.train = train_task(cfg, device, a.dp, a.zero_stage)
    if "api" in tasks:
        report.api = api_task(cfg, device)
    if "overlap" in tasks:
        report.overlap = overlap_task(cfg, device)
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", default=",".join(TASKS), help=f"comma-separated: {', '.join(TASKS)}")
    parser.add_argument("--cfg", default=RunConfig().to_json(), help="RunConfig as JSON (seq_len: the whole sequence)")
    parser.add_argument("--dp", type=int, default=1, help="saved, train: data-parallel groups of world/dp ring ranks")
    parser.add_argument("--zero-stage", type=int, default=0, help="train: 0 (all-reduce), 1 or 2 (ZeroOptimizer)")
    launch.serve(parser, run_tasks, check=_check)


if __name__ == "__main__":
    main()
