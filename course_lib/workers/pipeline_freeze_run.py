"""Freeze training on a real pipeline, then the pipeline repacked (chapter 08; ``pipeline_freeze``).

    torchrun --nproc-per-node 4 -m course_lib.workers.pipeline_freeze_run --frozen-stages 2 --microbatches 8

Chapter 08 runs ``freeze_steps`` inside ``pipeline_run``'s launch (``--freeze-stages``), sparing the
start of another group of processes. On ``p`` ranks, with the first ``k`` stages of the chapter's
``TinyTransformer`` frozen:

1. **frozen in place**: one step of ``pipeline_freeze.frozen_schedule`` (1F1B, the first ``k`` stages
   forwards only) with ``pipeline_exec.run_stage``, once with every op's ATen ops counted (``m = p``,
   unpadded) and then padded, timed, the fastest of ``--repeats``;
2. **repacked**: the active layers in ``pipeline_freeze.repack``'s fewer stages, the freed ranks as
   data-parallel replicas (each a pipeline of its own on its ranks, over its share of the micro-batches),
   the gradients all-reduced between the replicas' matching stages; the first stage of each replica
   reads the frozen prefix's outputs from an ``ActivationCache`` filled once, before the first step.

Both are checked against one sequential step of the same model with the prefix frozen.
"""

from __future__ import annotations

import argparse
import copy
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from course_lib.data import make_tokens
from course_lib.distributed import launch
from course_lib.distributed.clock import Clock, clock_for
from course_lib.distributed.pipeline import make_schedule, simulate
from course_lib.distributed.pipeline_exec import (StageRun, boundary_shapes, fastest_of, grad_diff, micro_batches,
                                                  run_stage, split_sequential, timeline)
from course_lib.distributed.pipeline_freeze import ActivationCache, freeze, frozen_schedule, repack
from course_lib.distributed.results import WorkerResult, gather_on_first
from course_lib.env import seed_everything
from course_lib.models import TinyTransformer, lm_loss


@dataclass
class FreezeRun(WorkerResult):
    """Rank 0's figures of the frozen and the repacked steps (times in seconds)."""

    p: int
    m: int
    frozen_stages: int
    loss_reference: float
    # 1. frozen in place: p stages, the first k forwards only
    counted_ops: list[tuple[int, str, int, dict[str, int]]]   # (stage, op, micro-batch, ATen ops), m = p
    makespan_s: float
    makespan_simulated_s: float
    bubble_measured: float
    bubble_simulated: float
    busy_s: list[float]                      # per stage
    peak_activation_bytes: list[int]         # per stage
    sent_messages: int
    sent_bytes: int
    grad_max_abs_diff: float                 # trainable stages against the sequential step
    frozen_grads_none: bool                  # the frozen stages' parameters got no gradient
    loss: float
    overruns: int
    timings: list[tuple[int, str, int, float, float]]        # (stage, op, micro-batch, start, end) from the start
    # 2. repacked, with the activation cache
    stages: int = 0
    replicas: int = 0
    layers_per_stage: list[int] = field(default_factory=list)
    repacked_makespan_s: float = 0.0         # pipelines plus the gradients' all-reduce
    repacked_pipeline_s: float = 0.0         # until the last pipeline op
    repacked_makespan_simulated_s: float = 0.0
    repacked_bubble_measured: list[float] = field(default_factory=list)  # per replica, pipeline part
    repacked_bubble_simulated: float = 0.0
    repacked_grad_max_abs_diff: float = 0.0
    repacked_loss: float = 0.0
    repacked_peak_activation_bytes: list[int] = field(default_factory=list)   # per rank
    allreduce_bytes: int = 0                 # gradient bytes each rank all-reduces
    cache_bytes: int = 0                     # on each replica's first stage
    cache_samples: int = 0                   # samples it holds
    cache_computed: int = 0                  # samples the prefix ran on, over every repeat
    cache_hits: int = 0
    repacked_timings: list[tuple[int, str, int, float, float]] = field(default_factory=list)


def tiny_model(a: argparse.Namespace, stages: int, seed: int | None = None) -> TinyTransformer:
    """The chapter's ``TinyTransformer`` at ``add_model_args``'s sizes, seeded (``a.seed`` unless ``seed``), the
    same on every rank: ``--layers`` blocks, or two modules per stage (of ``stages``, virtual ones included)."""
    seed_everything(a.seed if seed is None else seed)
    layers = getattr(a, "layers", 0)
    return TinyTransformer(vocab=a.vocab, d_model=a.d_model, n_heads=a.heads,
                           n_layers=layers if layers > 0 else max(1, 2 * stages - 2), max_len=a.seq_len)


def _clear(mods: list[nn.Module]) -> None:
    for mod in mods:
        for p in mod.parameters():
            p.grad = None


def freeze_steps(a: argparse.Namespace, k: int, m: int, repeats: int, rank: int, world: int, device: torch.device,
                 clock: Clock) -> FreezeRun | None:
    """Both steps on every rank, ``k`` stages frozen, ``m`` micro-batches, each padded step the fastest of
    ``repeats``; rank 0 returns the figures, the others ``None``. ``a`` holds the model and padding options."""
    model = tiny_model(a, world)
    layers = list(model.as_sequential())
    pieces = split_sequential(nn.Sequential(*layers), world)
    freeze(pieces[:k])
    reference = copy.deepcopy(model)             # the sequential step, prefix frozen
    x, y = make_tokens(m * a.microbatch_size, a.seq_len, vocab=a.vocab, seed=a.seed)
    loss_ref = lm_loss(reference(x), y)
    loss_ref.backward()
    refs = split_sequential(reference.as_sequential(), world)
    xs, ys = micro_batches(x, m), micro_batches(y, m)
    t_f, t_b = a.t_forward_ms / 1e3, a.t_backward_ms / 1e3
    pad = None if a.t_forward_ms <= 0 else {"F": t_f, "B": t_b}

    # 1. frozen in place
    mine_mod = copy.deepcopy(pieces[rank]).to(device)
    shapes = boundary_shapes(pieces, xs[0])

    def step(mb: int, padded: bool, count: bool) -> StageRun:
        _clear([mine_mod])
        dist.barrier()                           # start together, so idle time is the schedule's
        return run_stage(mine_mod, frozen_schedule("1f1b", world, mb, k), rank, shapes[rank],
                         inputs=xs[:mb] if rank == 0 else None, targets=ys[:mb] if rank == world - 1 else None,
                         loss_fn=lm_loss, op_seconds=pad if padded else None, device=device, clock=clock,
                         count_ops=count)

    counted = step(world, False, True)          # also the warm-up: first messages, first backward
    counted_ops = [(rank, op, i, n) for (op, i, *_), n in zip(counted.busy, counted.op_counts)]

    def padded() -> tuple[dict[str, float], Callable[[], tuple]]:
        run = step(m, True, False)
        return {"start": run.start, "end": run.end}, lambda: (
            run, grad_diff([mine_mod], [refs[rank]]), all(p.grad is None for p in mine_mod.parameters()))
    run, gdiff, no_grads = fastest_of(repeats, padded, device)
    mine = {"rank": rank, "start": run.start, "end": run.end, "busy": run.busy, "ops": counted_ops,
            "bytes": run.peak_activation_bytes, "messages": run.sent_messages, "sent": run.sent_bytes,
            "diff": gdiff, "none": no_grads, "losses": run.losses, "overruns": run.overruns}
    frozen_runs = gather_on_first(mine)

    # 2. repacked: the active layers on fewer stages, the freed ranks as replicas
    per_old = len(layers) // world               # layers of one stage before (split_sequential: equal here)
    plan = repack(len(layers), sum(len(p_) for p_ in pieces[:k]), world, per_old)
    K, R = plan.stages, plan.replicas
    replica, local = divmod(rank, K)
    prefix = nn.Sequential(*layers[:plan.frozen_layers])
    active = split_sequential(nn.Sequential(*copy.deepcopy(layers[plan.frozen_layers:])), K)
    new_mod = active[local].to(device)
    m_r = m // R
    own = list(range(replica * m_r, (replica + 1) * m_r))      # this replica's micro-batches
    groups = [dist.new_group([s + r * K for r in range(R)]) for s in range(K)]  # every rank makes each group
    with torch.no_grad():
        new_shapes = boundary_shapes(active, prefix(xs[0]))
    cache = None
    if local == 0:                               # the replica's first stage holds the prefix's outputs
        cache = ActivationCache(prefix.to(device), num_samples=m_r * a.microbatch_size)
    mbs = a.microbatch_size
    scale = max(plan.layers_per_stage) / per_old  # a stage's ops take as long as its layers
    pad_r = None if pad is None else {op: t * scale for op, t in pad.items()}
    flat_bytes = sum(p_.numel() * p_.element_size() for p_ in new_mod.parameters())
    refs_new = split_sequential(nn.Sequential(*list(reference.as_sequential())[plan.frozen_layers:]), K)

    def repacked_step() -> tuple[dict[str, float], Callable[[], tuple]]:
        _clear([new_mod])
        inputs = None
        if cache is not None:                    # served from the cache: the prefix runs in the first repeat only
            inputs = [cache.get(torch.arange(j * mbs, (j + 1) * mbs), xs[i].to(device)) for j, i in enumerate(own)]  # host: indices
        dist.barrier()
        r_run = run_stage(new_mod, make_schedule("1f1b", K, m_r), local, new_shapes[local], inputs=inputs,
                          targets=[ys[i] for i in own] if local == K - 1 else None, loss_fn=lm_loss,
                          op_seconds=pad_r, device=device, clock=clock,
                          ranks=list(range(replica * K, replica * K + K)))
        grads = [p_.grad for p_ in new_mod.parameters()]
        flat = torch.cat([g.reshape(-1) for g in grads])     # one message per stage, not one per tensor
        dist.all_reduce(flat, group=groups[local])   # sum over the replicas' copies of this stage
        flat /= R                                 # each replica's loss is its own mean: average them
        for g, part in zip(grads, flat.split([g.numel() for g in grads])):
            g.copy_(part.view_as(g))
        done = clock.mark()
        return ({"start": r_run.start, "done": clock.seconds(done)},
                lambda: (r_run, done, grad_diff([new_mod], [refs_new[local]])))
    r_run, done, rdiff = fastest_of(repeats, repacked_step, device, end="done")
    mine = {"rank": rank, "start": r_run.start, "end": r_run.end, "done": clock.seconds(done), "busy": r_run.busy,
            "diff": rdiff, "losses": r_run.losses, "bytes": r_run.peak_activation_bytes,
            "cache": None if cache is None else [cache.nbytes, cache.num_samples, cache.computed, cache.hits]}
    repacked = gather_on_first(mine)
    if rank != 0:
        return None
    meas, ops = timeline(frozen_runs)
    sim = simulate(frozen_schedule("1f1b", world, m, k), t_f or 1.0, t_b or 2.0)
    last = frozen_runs[-1]
    reps = [repacked[r * K:(r + 1) * K] for r in range(R)]
    r_meas = [timeline(rep)[0] for rep in reps]
    r_sim = simulate(make_schedule("1f1b", K, m_r), (t_f or 1.0) * scale, (t_b or 2.0) * scale)
    r0 = min(q["start"] for q in repacked)
    caches = [q["cache"] for q in repacked if q["cache"] is not None]
    losses = [l_ for q in repacked for l_ in q["losses"]]
    return FreezeRun(
        p=world, m=m, frozen_stages=k, loss_reference=loss_ref.item(),
        counted_ops=[o for r in frozen_runs for o in r["ops"]],
        makespan_s=meas["makespan"], makespan_simulated_s=sim.makespan, bubble_measured=meas["bubble_fraction"],
        bubble_simulated=sim.bubble_fraction, busy_s=meas["busy"],
        peak_activation_bytes=[r["bytes"] for r in frozen_runs],
        sent_messages=sum(r["messages"] for r in frozen_runs), sent_bytes=sum(r["sent"] for r in frozen_runs),
        grad_max_abs_diff=max(r["diff"] for r in frozen_runs if r["rank"] >= k),
        frozen_grads_none=all(r["none"] for r in frozen_runs if r["rank"] < k),
        loss=sum(last["losses"]) / len(last["losses"]), overruns=sum(r["overruns"] for r in frozen_runs),
        timings=ops,
        stages=K, replicas=R, layers_per_stage=plan.layers_per_stage,
        repacked_makespan_s=max(q["done"] for q in repacked) - r0,
        repacked_pipeline_s=max(q["end"] for q in repacked) - r0,
        repacked_makespan_simulated_s=r_sim.makespan,
        repacked_bubble_measured=[b["bubble_fraction"] for b in r_meas],
        repacked_bubble_simulated=r_sim.bubble_fraction,
        repacked_grad_max_abs_diff=max(q["diff"] for q in repacked), repacked_loss=sum(losses) / len(losses),
        repacked_peak_activation_bytes=[q["bytes"] for q in repacked], allreduce_bytes=flat_bytes,
        cache_bytes=caches[0][0], cache_samples=caches[0][1], cache_computed=caches[0][2], cache_hits=caches[0][3],
        repacked_timings=timeline(repacked)[1])


def add_model_args(parser: argparse.ArgumentParser) -> None:
    """The model's sizes and the ops' padding: options of this worker and of ``pipeline_run``."""
    parser.add_argument("--microbatch-size", type=int, default=2, help="sequences per micro-batch")
    parser.add_argument("--seq-len", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=64)
    parser.add_argument("--d-model", type=int, default=32)
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--layers", type=int, default=0, help="transformer blocks (0: 2p - 2)")
    parser.add_argument("--t-forward-ms", type=float, default=20.0, help="pad each forward to this (0: no padding)")
    parser.add_argument("--t-backward-ms", type=float, default=40.0, help="pad each backward to this")
    parser.add_argument("--seed", type=int, default=0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--frozen-stages", type=int, default=1)
    parser.add_argument("--microbatches", type=int, default=4)
    add_model_args(parser)
    parser.add_argument("--repeats", type=int, default=1, help="run each padded step this often, keep the fastest")

    def work(a: argparse.Namespace, rank: int, world: int, device: torch.device) -> FreezeRun | None:
        torch.set_num_threads(1)
        return freeze_steps(a, a.frozen_stages, a.microbatches, a.repeats, rank, world, device, clock_for(device))
    launch.serve(parser, work)


if __name__ == "__main__":
    main()
